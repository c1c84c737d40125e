"""A fused op's eager call decides once, for all the op calls inside it, that they may run their
implementations directly (remat.ops._family.eager_device, OpFamily.run): the norm's and the activation's
forward and backward skip their own per-call checks, and compute bit for bit what those checks let through.
Where one of those checks would not let a call through (a dispatch mode, float64, a backward that will be
differentiated, a gradient that is a tensor subclass), the op calls take their own path as before."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.ops import _family, fused
from remat.ops.fused import Linear, Norm, fused_mlp, norm_linears
from remat.specs import Activation


def _leaves(*shapes, dtype=torch.float32):
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in shapes]


def _mlp(gated, dtype=torch.float32):
    """(call, its tensors): a fused LayerNorm -> Linear -> GELU -> Linear, or RMSNorm -> gated SiLU MLP, at
    awkward widths (13 in, 7 hidden, one row of 5 and one of 1)."""
    if gated:
        x, nw, gate, up, down = _leaves((5, 13), (13,), (7, 13), (7, 13), (13, 7), dtype=dtype)
        return (lambda: fused_mlp(x, (Linear(gate), Linear(up)), Activation("silu", gated=True), Linear(down),
                                  Norm(nw, None, 1e-6, "rms_norm", "llama"))), [x, nw, gate, up, down]
    x, nw, nb, w1, b1, w2, b2 = _leaves((1, 5, 13), (13,), (13,), (7, 13), (7,), (13, 7), (13,), dtype=dtype)
    return (lambda: fused_mlp(x, Linear(w1, b1), Activation("gelu_tanh"), Linear(w2, b2), Norm(nw, nb, 1e-5))), \
        [x, nw, nb, w1, b1, w2, b2]


def _norm_linears(dtype=torch.float32):
    x, nw, nb, q, k = _leaves((3, 13), (13,), (13,), (7, 13), (5, 13), dtype=dtype)
    return (lambda: norm_linears(x, Norm(nw, nb, 1e-5), [Linear(q), Linear(k)])), [x, nw, nb, q, k]


CALLS = {"mlp": lambda **kw: _mlp(False, **kw), "gated mlp": lambda **kw: _mlp(True, **kw),
         "norm_linears": _norm_linears}


def _outputs_and_grads(call, tensors, create_graph=False):
    outs = call()
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
    return [o.detach() for o in outs], torch.autograd.grad(loss, tensors, create_graph=create_graph)


def _counting_checks(monkeypatch):
    """The number of the op families' own per-call checks (_plain_eager_call), counted."""
    seen = []
    real = _family._plain_eager_call
    monkeypatch.setattr(_family, "_plain_eager_call", lambda args: seen.append(1) or real(args))
    return seen


@pytest.mark.parametrize("name", list(CALLS))
def test_a_fused_call_decides_its_op_calls_once_and_computes_the_same(monkeypatch, name):
    call, tensors = CALLS[name]()
    checks = _counting_checks(monkeypatch)
    direct = _outputs_and_grads(call, tensors)
    assert checks == []  # neither the forward's op calls nor the backward's checked each call
    monkeypatch.setattr(fused, "eager_device", lambda tensors: None)  # each op call decides, as before
    each = _outputs_and_grads(call, tensors)
    assert len(checks) >= 2  # (the counter sees that path: the test above can fail)
    for got, want in zip([*direct[0], *direct[1]], [*each[0], *each[1]], strict=True):
        assert torch.equal(got, want)


class _RemattedOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("remat."):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(CALLS))
def test_under_a_dispatch_mode_the_op_calls_are_the_ops(name):
    """A tracer or counter (a dispatch mode) sees each of remat's ops, forward and backward, as before."""
    call, tensors = CALLS[name]()
    with _RemattedOps() as mode:
        _outputs_and_grads(call, tensors)
    norm = "remat.rms_norm" if name == "gated mlp" else "remat.layer_norm"
    expected = {f"{norm}_fwd.default", f"{norm}_bwd.default"}
    if name != "norm_linears":
        activation = "remat.gated" if name == "gated mlp" else "remat.gelu"
        expected |= {f"{activation}_fwd.default", f"{activation}_bwd.default"}
    assert set(mode.names) == expected


def test_the_direct_path_is_taken_only_where_every_per_call_check_would_pass():
    x = torch.randn(4, 13)
    assert _family.eager_device((x,)) is None  # a gradient to record: the op calls need their autograd
    with torch.no_grad():  # as inside an autograd.Function's forward
        assert _family.eager_device((x, None, torch.randn(13))) == x.device
        assert _family.eager_device((x, x.double())) is None  # float64 runs the reference, decided per call
        assert _family.eager_device((x, torch.randn(2, device="meta"))) is None
        assert _family.eager_device((torch.nn.Parameter(x), x)) == x.device
        with _RemattedOps():
            assert _family.eager_device((x,)) is None
        assert _family.eager_backward_device(x.device, x) == x.device
        assert _family.eager_backward_device(None, x) is None
        assert _family.eager_backward_device(x.device, None) is None  # (no gradient: each call decides)

        class Subclass(torch.Tensor):
            pass

        assert _family.eager_backward_device(x.device, x.as_subclass(Subclass)) is None
    with torch.enable_grad():  # a create_graph backward
        assert _family.eager_backward_device(x.device, x) is None


def _dispatched_remat_ops(step):
    """The remat:: ops the dispatcher saw while `step` ran: torch's profiler records every op dispatched,
    without being a mode the direct path would step aside for."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    return {event.name for event in profile.events() if event.name.startswith("remat::")}


@pytest.mark.parametrize("name", list(CALLS))
def test_float64_and_create_graph_calls_check_each_op_call(monkeypatch, name):
    call, tensors = CALLS[name](dtype=torch.float64)
    checks = _counting_checks(monkeypatch)
    _outputs_and_grads(call, tensors)
    assert len(checks) >= 2  # float64: each op call checks and chooses (the reference)
    call, tensors = CALLS[name]()
    assert _dispatched_remat_ops(lambda: _outputs_and_grads(call, tensors)) == set()
    norm = "remat::rms_norm_bwd" if name == "gated mlp" else "remat::layer_norm_bwd"
    # a backward that will be differentiated: its op calls are the backward ops (whose derivative is refused)
    assert norm in _dispatched_remat_ops(lambda: _outputs_and_grads(call, tensors, create_graph=True))
