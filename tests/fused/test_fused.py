"""Fused layers: LayerNormLinear, MLP, LayerNormMLP against the unfused torch stacks, and their exact memory."""


import pytest
import torch

import remat
from remat._guards import RematFallbackWarning

from numerics import (
    activation_bytes,
    assert_close_to_ref,
    assert_compiled_matches_eager,
    float64_step,
    rel_error,
    saved_bytes,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randomize(module):
    """Fresh random parameters (a LayerNorm starts at ones and zeros, which hides bugs)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (1 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.5) + (p.dim() == 1) * 0.1)
    return module


def build(kind, hidden, ffn, dtype, device, recompute=True, activation="gelu"):
    """(remat layer, the equivalent stock torch stack sharing no storage with it)."""
    if kind == "LayerNormLinear":
        stock = torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, ffn))
        ours = remat.nn.LayerNormLinear.from_modules(*randomize(stock), recompute=recompute)
    else:
        gelu = torch.nn.GELU("tanh" if activation == "gelu_tanh" else "none")
        layers = [torch.nn.Linear(hidden, ffn), gelu, torch.nn.Linear(ffn, hidden)]
        if kind == "LayerNormMLP":
            stock = randomize(torch.nn.Sequential(torch.nn.LayerNorm(hidden), *layers))
            ours = remat.nn.LayerNormMLP.from_modules(*stock, recompute=recompute)
        else:
            stock = randomize(torch.nn.Sequential(*layers))
            ours = remat.nn.MLP.from_modules(*stock, recompute=recompute)
    return ours.to(device, dtype), stock.to(device)


KINDS = ["LayerNormLinear", "MLP", "LayerNormMLP"]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64_stock_stack(target, kind, dtype, recompute):
    """Output and every gradient (input, weights, biases) against the unfused stack in float64."""
    device, _ = target
    ours, stock = build(kind, 48, 136, dtype, device, recompute)
    x = torch.randn(3, 7, 48, device=device).to(dtype).requires_grad_()
    dy = torch.randn(3, 7, ours(x).shape[-1], device=device).to(dtype)
    y = ours(x)
    y.backward(dy)
    want_y, want_dx, want_grads = float64_step(stock, x, dy)
    assert y.dtype == dtype
    assert_close_to_ref("y", y, want_y, dtype)
    assert_close_to_ref("dx", x.grad, want_dx, dtype)
    for name, p in ours.named_parameters():
        stock_name = STOCK_INDEX[kind][name.split(".")[0]] + "." + name.split(".")[1]
        assert_close_to_ref(name, p.grad, want_grads[stock_name], dtype)


# Where each of our submodules sits in the stock nn.Sequential that build() makes.
STOCK_INDEX = {
    "LayerNormLinear": {"norm": "0", "linear": "1"},
    "MLP": {"fc1": "0", "fc2": "2"},
    "LayerNormMLP": {"norm": "0", "fc1": "1", "fc2": "3"},
}


@pytest.mark.parametrize("kind", KINDS)
def test_recompute_matches_keep_bitwise(target, kind):
    """Recompute rebuilds exactly what the keep mode stores, so the gradients are bitwise equal."""
    device, _ = target
    ours, _ = build(kind, 32, 96, torch.float16, device, recompute=True)
    x = torch.randn(4, 9, 32, device=device, dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(ours(x))
    first = torch.autograd.grad(ours(x), [x, *ours.parameters()], dy)
    ours.recompute = False
    second = torch.autograd.grad(ours(x), [x, *ours.parameters()], dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_tanh_activation_and_no_bias(target):
    device, _ = target
    stock = randomize(torch.nn.Sequential(torch.nn.Linear(20, 50, bias=False), torch.nn.GELU("tanh"),
                                          torch.nn.Linear(50, 20, bias=False))).to(device)
    ours = remat.nn.MLP.from_modules(*stock)
    assert ours.activation == "gelu_tanh" and ours.fc1.bias is None
    x = torch.randn(6, 20, device=device, requires_grad=True)
    assert rel_error(ours(x), stock(x)) < 1e-5
    grads = torch.autograd.grad(ours(x).sum(), [x, *ours.parameters()])
    want = torch.autograd.grad(stock(x).sum(), [x, *stock.parameters()])
    assert all(rel_error(g, w) < 1e-5 for g, w in zip(grads, want))


def test_frozen_weights_and_input_without_grad(target):
    device, _ = target
    ours, stock = build("LayerNormMLP", 24, 64, torch.float32, device)
    ours.fc1.weight.requires_grad_(False)
    ours.norm.bias.requires_grad_(False)
    x = torch.randn(5, 24, device=device)
    ours(x).sum().backward()
    assert ours.fc1.weight.grad is None and ours.norm.bias.grad is None
    want = torch.autograd.grad(stock(x).sum(), list(stock.parameters()))
    assert rel_error(ours.fc2.weight.grad, want[-2]) < 1e-5
    assert rel_error(ours.norm.weight.grad, want[0]) < 1e-5


# --- memory: exact byte counts -----------------------------------------------------------------


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_mlp_keeps_input_and_fc1_output_only(target, recompute):
    device, _ = target
    tokens, hidden = 64, 32
    ours, stock = build("MLP", hidden, 4 * hidden, torch.bfloat16, device, recompute)
    stock = stock.to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    measured = activation_bytes(ours, x)
    eager = activation_bytes(stock, x)
    assert eager == 18 * tokens * hidden  # x 2·T·h, fc1 output 8·T·h, GELU output 8·T·h
    assert measured == (10 * tokens * hidden if recompute else eager)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_layer_norm_linear_keeps_input_and_statistics_only(target, recompute):
    device, _ = target
    tokens, hidden = 64, 48
    ours, stock = build("LayerNormLinear", hidden, 3 * hidden, torch.bfloat16, device, recompute)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    statistics = 2 * tokens * 4  # fp32 mean and rstd
    assert activation_bytes(ours, x) == 2 * tokens * hidden + statistics + (0 if recompute else 2 * tokens * hidden)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_layer_norm_mlp_saves_ten_bytes_per_token_and_width(target, recompute):
    device, _ = target
    tokens, hidden = 64, 32
    ours, stock = build("LayerNormMLP", hidden, 4 * hidden, torch.bfloat16, device, recompute)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    statistics = 2 * tokens * 4
    kept = 2 * tokens * hidden + 8 * tokens * hidden  # x and the fc1 output
    dropped = 2 * tokens * hidden + 8 * tokens * hidden  # LayerNorm output and GELU output
    assert activation_bytes(ours, x) == kept + statistics + (0 if recompute else dropped)


def _parallel_layer(x, norm, q, fc1, fc2, shared):
    """A parallel layer's two consumers of one norm (Phi's attention q/k/v and MLP), summed."""
    from remat.ops.fused import fused_mlp, norm_linears

    (attention,) = norm_linears(x, norm, [q], shared=shared)
    return attention + fused_mlp(x, fc1, remat.specs.gelu("tanh"), fc2, norm, shared=shared)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_parallel_consumers_of_one_norm_keep_its_statistics_once(target, kind):
    """Given one SharedStatistics, the second fused op applying the norm to the same x keeps the
    first one's statistics: 4 bytes per row less per statistic, the same gradients; an x changed
    in place in between, or another x, gets its own."""
    from remat.ops.fused import SharedStatistics
    from remat.specs import Linear, Norm

    device, _ = target
    tokens, hidden, ffn = 37, 24, 40
    g = torch.Generator().manual_seed(5)
    param = lambda *shape: torch.randn(*shape, generator=g).to(device).requires_grad_()  # noqa: E731
    if kind == "layer_norm":
        norm = Norm(param(hidden), param(hidden), 1e-5)
    else:
        norm = Norm(param(hidden), None, 1e-5, kind, "llama")
    q, fc1 = Linear(param(hidden, hidden), None), Linear(param(ffn, hidden), param(ffn))
    fc2 = Linear(param(hidden, ffn))
    params = [t for t in (norm.weight, norm.bias, q.weight, fc1.weight, fc1.bias, fc2.weight) if t is not None]
    statistics = (2 if kind == "layer_norm" else 1) * tokens * 4
    x = torch.randn(tokens, hidden, generator=g).to(device).requires_grad_()

    def step(shared):
        kept = saved_bytes(lambda: _parallel_layer(x, norm, q, fc1, fc2, shared).square().sum().backward(),
                           exclude=params)
        grads = [t.grad.clone() for t in (x, *params)]
        for t in (x, *params):
            t.grad = None
        return kept, grads

    alone, alone_grads = step(None)
    shared, shared_grads = step(SharedStatistics())
    assert alone - shared == statistics
    for a, b in zip(alone_grads, shared_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    holder = SharedStatistics()
    from remat.ops.fused import norm_linears

    with torch.no_grad():
        first = x.detach().clone()
        norm_linears(first, norm, [q], shared=holder)
        assert holder.lookup(first) is None  # nothing kept them without autograd: nothing to share
    first.requires_grad_()
    out = norm_linears(first, norm, [q], shared=holder)  # its graph keeps the statistics alive
    assert holder.lookup(first) is not None and holder.lookup(first.detach().clone()) is None
    with torch.no_grad():
        first.add_(1.0)
    assert holder.lookup(first) is None
    del out


# --- contract -----------------------------------------------------------------------------------


def test_torch_compile_fullgraph(target):
    device, _ = target
    ours, _ = build("LayerNormMLP", 16, 40, torch.float32, device)
    x = torch.randn(2, 5, 16, device=device)
    assert_compiled_matches_eager(ours, x)


def test_state_dict_is_the_unfused_stack():
    ours = remat.nn.LayerNormMLP(16, 64)
    assert set(ours.state_dict()) == {"norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert set(remat.nn.LayerNormLinear(16, 8).state_dict()) == {
        "norm.weight", "norm.bias", "linear.weight", "linear.bias"}


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: remat.nn.MLP(8, 16, activation="relu"), ValueError, "activation must be one of"),
        (lambda: remat.nn.MLP(8, 16, recompute="yes"), TypeError, "recompute must be True or False"),
        (lambda: remat.nn.MLP.from_modules(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)),
         TypeError, "activation must be a torch.nn.GELU"),
        (lambda: remat.nn.MLP.from_modules(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)),
         ValueError, "fc2 must map 16 back to 8"),
        (lambda: remat.nn.MLP(8, 16)(torch.randn(2, 9)), ValueError,
         "x must have 8 features in its last dimension (the in_features of MLP), got shape (2, 9)"),
        (lambda: remat.nn.MLP(8, 16)(torch.randn(2, 8, dtype=torch.float16)), TypeError,
         "w1 has dtype torch.float32 but x"),
        (lambda: remat.nn.LayerNormLinear(64, 192)(torch.randn(2, 32)), ValueError,
         "x must have 64 features in its last dimension (the in_features of LayerNormLinear), got shape (2, 32)"),
        (lambda: remat.mlp(torch.randn(2, 8), torch.randn(16, 8), None, torch.randn(8, 16), None, "exact"),
         ValueError, "approximate must be one of"),
    ],
    ids=["activation", "recompute", "from-relu", "fc2-shape", "x-width", "x-dtype", "norm-width", "approximate"],
)
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as caught:
        call()
    assert words in str(caught.value)


def test_quick_gelu_mlp_and_its_stock_fallback_agree(target):
    """remat.nn.MLP(activation="gelu_quick") fuses QuickGELU (x·σ(1.702x)); a hook on fc1 makes it run
    the layers one after the other, with QuickGELU's own formula: the same output."""
    device, _ = target
    ours = randomize(remat.nn.MLP(16, 40, activation="gelu_quick")).to(device)
    x = torch.randn(5, 16, device=device)
    fused = ours(x)
    stock = ours.fc2(ours.fc1(x) * torch.sigmoid(1.702 * ours.fc1(x)))
    assert rel_error(fused, stock) < 1e-5
    ours.fc1.register_forward_hook(lambda *args: None)
    with pytest.warns(RematFallbackWarning):
        assert rel_error(ours(x), stock) < 1e-5
