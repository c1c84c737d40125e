"""remat.ops.fused.Checked: a fused op's argument check kept by a caller that passes the same parameters
at every call (a converted module, remat.nn's fused layers). The kept check changes nothing computed,
and never lets through what the full check refuses: an input of another dtype, width or device, a call
under autocast, LoRA adapters, or parameters whose data were replaced by others of another shape."""

import pytest
import torch

import remat
from remat.ops.fused import Checked, Linear, LoRA, Norm, fused_mlp, norm_linears
from remat.specs import Activation


def _norm_linears_args(width=13, outs=(7, 5)):
    norm = Norm(torch.randn(width, requires_grad=True), torch.randn(width, requires_grad=True), 1e-5)
    linears = [Linear(torch.randn(o, width, requires_grad=True), torch.randn(o, requires_grad=True)) for o in outs]
    return norm, linears


def _grads(outs, tensors):
    return torch.autograd.grad(sum(o.square().sum() for o in outs), tensors)


def test_a_kept_check_computes_what_the_full_check_computes():
    norm, linears = _norm_linears_args()
    params = [norm.weight, norm.bias, *(t for lin in linears for t in lin[:2])]
    checked = Checked()
    x = torch.randn(1, 3, 13, requires_grad=True)  # one sequence, 3 tokens, a prime width
    assert not checked.holds(x, linears)  # nothing checked yet
    first = norm_linears(x, norm, linears, checked=checked)
    assert checked.holds(x, linears)
    kept = norm_linears(x, norm, linears, checked=checked)  # the check skipped
    full = norm_linears(x, norm, linears)
    for a, b, c in zip(first, kept, full, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    for a, b in zip(_grads(kept, [x, *params]), _grads(full, [x, *params]), strict=True):
        assert torch.equal(a, b)


def test_a_kept_check_refuses_what_the_full_check_refuses():
    norm, linears = _norm_linears_args()
    checked = Checked()
    norm_linears(torch.randn(4, 13), norm, linears, checked=checked)
    with pytest.raises(TypeError, match="has dtype torch.float32 but x has torch.float16"):
        norm_linears(torch.randn(4, 13, dtype=torch.float16), norm, linears, checked=checked)
    with pytest.raises(ValueError, match="x must have 13 features"):
        norm_linears(torch.randn(4, 11), norm, linears, checked=checked)
    with pytest.raises(ValueError, match="at least one dimension"):
        norm_linears(torch.tensor(1.0), norm, linears, checked=checked)
    assert checked.holds(torch.randn(2, 13), linears)  # the refused calls recorded nothing


def test_under_autocast_a_kept_check_is_not_used():
    norm, linears = _norm_linears_args()
    checked = Checked()
    x = torch.randn(5, 13)
    norm_linears(x, norm, linears, checked=checked)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not checked.holds(x, linears)
        out = norm_linears(x, norm, linears, checked=checked)
        want = norm_linears(x, norm, linears)
    assert out[0].dtype == torch.bfloat16 and all(torch.equal(a, b) for a, b in zip(out, want, strict=True))
    assert checked.holds(x, linears)  # the autocast call left the fp32 record as it was


def test_linears_with_adapters_are_checked_at_every_call():
    norm, linears = _norm_linears_args(outs=(7,))
    checked = Checked()
    x = torch.randn(3, 13)
    norm_linears(x, norm, linears, checked=checked)
    bad = [linears[0]._replace(adapters=(LoRA(torch.randn(2, 11), torch.randn(7, 2), None, 1.0),))]
    assert not checked.holds(x, bad)
    with pytest.raises(ValueError, match=r"adapters\[0\].a must have shape \(rank, 13\)"):
        norm_linears(x, norm, bad, checked=checked)


def test_fused_mlp_with_a_kept_check_equals_the_full_check():
    gate, up, down = torch.randn(11, 7), torch.randn(11, 7), torch.randn(7, 11)
    norm = Norm(torch.randn(7), None, 1e-6, "rms_norm", "llama")
    checked, x = Checked(), torch.randn(2, 1, 7, requires_grad=True)
    args = ((Linear(gate), Linear(up)), Activation("silu", gated=True), Linear(down), norm)
    first = fused_mlp(x, *args, checked=checked)
    kept = fused_mlp(x, *args, checked=checked)
    assert checked.holds(x, [Linear(gate), Linear(up), Linear(down)])
    assert torch.equal(first, kept) and torch.equal(kept, fused_mlp(x, *args))


def test_parameters_given_data_of_another_shape_are_checked_again():
    """A fused layer's verdict is kept while its parameters' fingerprint holds: data of another shape
    (param.data = ..., as ZeRO-3 or a loader may set it) changes it, and the call is refused by name,
    not computed on parameters the fused op did not check."""
    mlp = remat.nn.GatedMLP(8, 12)
    x = torch.randn(3, 8)
    mlp(x)
    mlp(x)  # the kept verdict and check
    mlp.down_proj.weight.data = torch.randn(8, 10)
    with pytest.raises(ValueError, match=r"w2 must have shape \(out_features, 12\), got \(8, 10\)"):
        mlp(x)


# --- the kept call: the fused op's arguments but x, worked out once per verdict --------------------


def _fused_mlp_args(width=13, hidden=19):
    norm = Norm(torch.randn(width, requires_grad=True), torch.randn(width, requires_grad=True), 1e-5)
    fc1 = Linear(torch.randn(hidden, width, requires_grad=True), torch.randn(hidden, requires_grad=True))
    fc2 = Linear(torch.randn(width, hidden, requires_grad=True), torch.randn(width, requires_grad=True))
    return norm, fc1, fc2


@pytest.mark.parametrize("op", ["norm_linears", "fused_mlp"])
def test_a_kept_call_computes_what_the_full_check_computes(op):
    """The call kept after a checked one, run on a new x of the same kind, gives the outputs and gradients
    the full path gives, bit for bit."""
    if op == "norm_linears":
        norm, linears = _norm_linears_args()
        params = [norm.weight, norm.bias, *(t for lin in linears for t in lin[:2])]
        run = lambda x, checked=None: norm_linears(x, norm, linears, checked=checked)  # noqa: E731
        made_for = (None, True)  # no activation; recompute
    else:
        norm, fc1, fc2 = _fused_mlp_args()
        params = [norm.weight, norm.bias, *fc1[:2], *fc2[:2]]
        run = lambda x, checked=None: [fused_mlp(x, fc1, remat.specs.gelu("tanh"), fc2, norm,  # noqa: E731
                                                 checked=checked)]
        made_for = (remat.specs.gelu("tanh"), True)
    checked = Checked()
    assert checked.kept_call(torch.randn(2, 13), norm.eps, *made_for) is None  # nothing kept yet
    run(torch.randn(2, 13), checked)  # the full check
    run(torch.randn(2, 13), checked)  # checked, kept
    x = torch.randn(1, 5, 13, requires_grad=True)  # another x: one sequence, 5 tokens
    call = checked.kept_call(x, norm.eps, *made_for)
    assert call is not None
    kept, full = call(x, None), run(x)
    kept = kept if isinstance(kept, list) else [kept]
    assert all(torch.equal(a, b) for a, b in zip(kept, full, strict=True))
    for a, b in zip(_grads(kept, [x, *params]), _grads(full, [x, *params]), strict=True):
        assert torch.equal(a, b)


def test_a_kept_call_is_given_only_for_what_it_was_made_for():
    """Not for another input dtype or width, another eps of the norm, activation or recompute switch (module
    attributes, which no fingerprint covers), under autocast, nor once a tensor a kernel reads whole has
    strided data (a .data replaced in place: the full path then copies it)."""
    norm, fc1, fc2 = _fused_mlp_args()
    act = remat.specs.gelu("tanh")
    checked = Checked()
    for _ in range(2):
        fused_mlp(torch.randn(3, 13), fc1, act, fc2, norm, checked=checked)
    x = torch.randn(4, 13)
    assert checked.kept_call(x, norm.eps, act, True) is not None
    assert checked.kept_call(x.double(), norm.eps, act, True) is None
    assert checked.kept_call(torch.randn(4, 11), norm.eps, act, True) is None
    assert checked.kept_call(x, 1e-3, act, True) is None
    assert checked.kept_call(x, norm.eps, remat.specs.gelu("none"), True) is None
    assert checked.kept_call(x, norm.eps, act, False) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert checked.kept_call(x, norm.eps, act, True) is None
    fc1.bias.data = torch.randn(38)[::2]  # strided, the same shape: no fingerprint sees it
    assert checked.kept_call(x, norm.eps, act, True) is None
    fc1.bias.data = fc1.bias.data.contiguous()
    norm.weight.data = torch.randn(26)[::2]
    assert checked.kept_call(x, norm.eps, act, True) is None


def _called_twice(norm, linears, checked):
    """`checked` after two norm_linears calls on fresh (3, 13) inputs: the full check, then the kept one."""
    for _ in range(2):
        norm_linears(torch.randn(3, 13), norm, linears, checked=checked)
    return checked


def test_copies_and_partitioned_parameters_are_never_kept():
    """A call that reads a contiguous copy of a strided parameter is not kept (the copy would not see the
    optimizer's steps), nor is any call of a Checked made not to keep (ZeRO-3: the parameters are
    gathered at each call)."""
    norm, linears = _norm_linears_args()
    strided = Norm(torch.randn(26)[::2].requires_grad_(), norm.bias, norm.eps)
    checked = _called_twice(strided, linears, Checked())
    assert checked.kept_call(torch.randn(3, 13), norm.eps, None, True) is None
    refusing = _called_twice(norm, linears, Checked(keeps_calls=False))
    assert refusing.holds(torch.randn(3, 13), linears) and refusing.kept_call(torch.randn(3, 13), norm.eps, None,
                                                                                         True) is None


def test_a_traced_call_keeps_nothing():
    """While torch.compile traces, the kept call is neither made nor replaced: one made inside a trace would
    hold the trace's tensors."""
    norm, linears = _norm_linears_args()
    checked = _called_twice(norm, linears, Checked())
    kept = checked.kept_call(torch.randn(3, 13), norm.eps, None, True)
    compiled = torch.compile(lambda x: norm_linears(x, norm, linears, checked=checked)[0], backend="eager",
                             fullgraph=True)
    compiled(torch.randn(3, 13))
    assert kept is not None and checked.kept_call(torch.randn(3, 13), norm.eps, None, True) is kept


def test_a_copy_keeps_no_call():
    """A deep copy or a pickle of a Checked (a converted model's, copied with it) starts afresh: a kept call
    holds the original's parameters."""
    import copy
    import pickle

    norm, linears = _norm_linears_args()
    checked = _called_twice(norm, linears, Checked())
    for twin in (copy.deepcopy(checked), pickle.loads(pickle.dumps(checked))):
        assert twin.keeps_calls and not twin.holds(torch.randn(3, 13), linears)
        assert twin.kept_call(torch.randn(3, 13), norm.eps, None, True) is None


CHANGES_A_FINGERPRINT_MISSES = {
    "activation": lambda mlp: setattr(mlp, "activation", "gelu_tanh"),
    "recompute": lambda mlp: setattr(mlp, "recompute", False),
    "eps": lambda mlp: setattr(mlp.norm, "eps", 0.5),
}


@pytest.mark.parametrize("change", CHANGES_A_FINGERPRINT_MISSES)
def test_a_fused_layer_changed_after_its_kept_calls_computes_the_change(change):
    """remat.nn.LayerNormMLP's attributes no fingerprint covers (its activation, recompute switch, its norm's
    eps), set after the calls that kept its fused op's call: the next call computes with them, as a copy made
    after the change does (a copy keeps no call): the same outputs, gradients and bytes kept."""
    import copy

    from numerics import activation_bytes

    torch.manual_seed(0)
    mlp = remat.nn.LayerNormMLP(16, 24)
    x = torch.randn(3, 16, requires_grad=True)
    for _ in range(2):
        mlp(x)
    CHANGES_A_FINGERPRINT_MISSES[change](mlp)
    fresh = copy.deepcopy(mlp)
    out, want = mlp(x), fresh(x)
    assert torch.equal(out, want)
    params = list(mlp.parameters())
    grads = torch.autograd.grad(out.square().sum(), [x, *params])
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), [x, *fresh.parameters()]), strict=True):
        assert torch.equal(a, b)
    assert activation_bytes(mlp, x) == activation_bytes(fresh, x)
