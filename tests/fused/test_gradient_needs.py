"""The fused ops' backward gives a gradient to exactly the tensors that require one, each equal to
plain PyTorch's: x without grad, each parameter frozen in turn, one tensor alone requiring grad. Without
LoRA adapters the backward takes its plain path (remat.ops.fused._plain_*_backward); with them the
general one, checked by test_fused_lora.py. In float64 (the ops' reference), so the comparison is tight."""

import pytest
import torch
import torch.nn.functional as F

from remat.ops.fused import Linear, Norm, fused_mlp, norm_linears
from remat.specs import Activation

WIDTH, TOKENS = 11, 5  # prime width, a few rows


def _linear(out_features, in_features, transposed=False, bias=True):
    weight = torch.randn((in_features, out_features) if transposed else (out_features, in_features),
                         dtype=torch.float64) / in_features ** 0.5
    return Linear(weight, torch.randn(out_features, dtype=torch.float64) if bias else None, (), transposed)


def _stock_linear(x, linear):
    return F.linear(x, linear.weight.t() if linear.transposed else linear.weight, linear.bias)


def _stock_norm(x, norm):
    if norm.kind == "layer_norm":
        return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, norm.eps)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps) * norm.weight


def _layer_norm():
    return Norm(torch.randn(WIDTH, dtype=torch.float64), torch.randn(WIDTH, dtype=torch.float64), 1e-5)


def _rms_norm():
    return Norm(torch.randn(WIDTH, dtype=torch.float64), None, 1e-6, "rms_norm", "torch")


def _norm_linears_case():
    norm = _layer_norm()
    linears = [_linear(7, WIDTH), _linear(3, WIDTH, transposed=True), _linear(5, WIDTH, bias=False)]
    tensors = [norm.weight, norm.bias, *(t for lin in linears for t in (lin.weight, lin.bias) if t is not None)]

    def ours(x):
        return sum(out.square().sum() for out in norm_linears(x, norm, linears))

    def stock(x):
        normed = _stock_norm(x, norm)
        return sum(_stock_linear(normed, linear).square().sum() for linear in linears)

    return tensors, ours, stock


def _mlp_case(norm, gated, fused_gate_up=False):
    ffn = 13
    if not gated:
        fc1, act = _linear(ffn, WIDTH, transposed=True), Activation("gelu_tanh")
    elif fused_gate_up:
        fc1, act = _linear(2 * ffn, WIDTH, bias=False), Activation("silu", gated=True)
    else:
        fc1, act = (_linear(ffn, WIDTH), _linear(ffn, WIDTH, bias=False)), Activation("gelu", gated=True)
    fc2 = _linear(WIDTH, ffn, transposed=not gated)
    ups = [fc1] if isinstance(fc1, Linear) else list(fc1)  # (a Linear is a namedtuple)
    tensors = [t for t in (norm.weight, norm.bias) if t is not None] if norm is not None else []
    tensors += [t for linear in (*ups, fc2) for t in (linear.weight, linear.bias) if t is not None]

    def ours(x):
        return fused_mlp(x, fc1, act, fc2, norm).square().sum()

    def stock(x):
        h = _stock_norm(x, norm) if norm is not None else x
        hs = [_stock_linear(h, up) for up in ups]
        if not gated:
            a = F.gelu(hs[0], approximate="tanh")
        else:
            gate, up = hs if len(hs) == 2 else hs[0].chunk(2, dim=-1)
            a = (F.silu(gate) if act.name == "silu" else F.gelu(gate)) * up
        return _stock_linear(a, fc2).square().sum()

    return tensors, ours, stock


CASES = {
    "norm_linears, three Linears": _norm_linears_case,
    "mlp": lambda: _mlp_case(None, gated=False),
    "layer_norm mlp": lambda: _mlp_case(_layer_norm(), gated=False),
    "rms_norm gated mlp, gate and up": lambda: _mlp_case(_rms_norm(), gated=True),
    "gated mlp, one gate_up": lambda: _mlp_case(None, gated=True, fused_gate_up=True),
}


def _requiring(tensors, x, wanted):
    """x and `tensors` with requires_grad set where `wanted` (by index: 0 for x, i + 1 for tensors[i])."""
    for i, t in enumerate([x, *tensors]):
        t.requires_grad_(i in wanted)


@pytest.mark.parametrize("case", CASES)
def test_each_gradient_is_given_where_required_only(case):
    torch.manual_seed(0)
    tensors, ours, stock = CASES[case]()
    x = torch.randn(TOKENS, WIDTH, dtype=torch.float64)
    everything = set(range(len(tensors) + 1))
    # all, x without grad, each parameter frozen in turn, each tensor alone
    choices = [everything, *(everything - {i} for i in everything), *({i} for i in everything)]
    for wanted in choices:
        _requiring(tensors, x, wanted)
        inputs = [t for i, t in enumerate([x, *tensors]) if i in wanted]
        got = torch.autograd.grad(ours(x), inputs)
        want = torch.autograd.grad(stock(x), inputs)
        for index, g, w in zip(sorted(wanted), got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=f"tensor {index} of {sorted(wanted)}")
        for t in (x, *tensors):  # nothing given to a tensor autograd.grad did not ask for
            assert t.grad is None


@pytest.mark.parametrize("case", CASES)
def test_backward_fills_grad_of_the_required_only(case):
    torch.manual_seed(1)
    tensors, ours, _ = CASES[case]()
    x = torch.randn(TOKENS, WIDTH, dtype=torch.float64)
    for frozen in range(len(tensors) + 1):
        everything = set(range(len(tensors) + 1))
        _requiring(tensors, x, everything - {frozen})
        ours(x).backward()
        for i, t in enumerate([x, *tensors]):
            assert (t.grad is None) == (i == frozen), f"tensor {i}, tensor {frozen} frozen"
            t.grad = None
