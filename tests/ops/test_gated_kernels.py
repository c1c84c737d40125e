"""Gated activation kernels (act(gate) * up) and QuickGELU: against float64 and PyTorch's own error,
the stock rounding bitwise where round_activation claims it, recompute, strided halves, bad input,
and the ahead-of-time compile of the gated kernels for sm_80/sm_90 (16-byte accesses, no spills).

The launchers are called directly; the stock implementations are act(gate) * up in the input
dtype (transformers' LlamaMLP, GemmaMLP, Phi3MLP) and transformers' QuickGELUActivation.
"""

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from remat.ops import gated as ref
from remat.ops import gelu as gelu_ops
from remat.triton_kernels import gated as kernels
from remat.triton_kernels import gelu as gelu_kernels

from kernel_checks import assert_within_twice_stock, kernel_device  # noqa: F401 (the device fixture)
from numerics import rel_error
from triton_aot import compile_module_cases, format_results

ACTIVATIONS = kernels.ACTIVATIONS
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, width): one element, one row, primes, widths just past a block (257, 1025).
SHAPES = [(1, 1), (1, 7), (5, 127), (3, 257), (17, 1000), (2, 1025)]
STOCK_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.abspath(__file__))


def make_gate_up(shape, dtype, device, halves=True):
    """Fresh random gate and up: the two halves of one (M, 2N) projection output, or two tensors."""
    rows, width = shape
    if halves:
        return (torch.randn(rows, 2 * width, device=device) * 2).to(dtype).chunk(2, dim=1)
    return tuple((torch.randn(shape, device=device) * 2).to(dtype) for _ in range(2))


def check_gated(gate, up, activation, round_activation):
    y = kernels.gated_fwd(gate, up, activation, round_activation)
    dy = torch.randn(y.shape, device=y.device).to(y.dtype)
    d_gate_up, nothing = kernels.gated_bwd(dy, gate, up, activation, False, round_activation)
    assert d_gate_up.shape == (gate.shape[0], 2 * gate.shape[1]) and d_gate_up.is_contiguous()
    assert nothing.numel() == 0
    act = STOCK_ACTIVATIONS[activation]
    leaves64 = [t.detach().double().requires_grad_() for t in (gate, up)]
    y64 = act(leaves64[0]) * leaves64[1]
    y64.backward(dy.double())
    leaves = [t.detach().clone().requires_grad_() for t in (gate, up)]
    stock = act(leaves[0]) * leaves[1]  # in the input dtype: act rounded, then the product
    stock.backward(dy)
    assert_within_twice_stock("y", y, y64, stock)
    width = gate.shape[1]
    assert_within_twice_stock("d_gate", d_gate_up[:, :width], leaves64[0].grad, leaves[0].grad,
                              terms=dy.double() * up.double())
    assert_within_twice_stock("d_up", d_gate_up[:, width:], leaves64[1].grad, leaves[1].grad)


@pytest.mark.parametrize("round_activation", [False, True], ids=["round-once", "round-activation"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(device, shape, dtype, activation, round_activation):
    check_gated(*make_gate_up(shape, dtype, device), activation, round_activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_separate_gate_and_up(device, activation):
    check_gated(*make_gate_up((33, 300), torch.bfloat16, device, halves=False), activation, False)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_activation_rounds_as_the_stock_product(device, dtype, activation):
    """With round_activation, y = round(round(act(gate)) * up) and d_up = round(dy * round(act(gate))),
    bitwise as torch multiplies in the input dtype (act(gate) itself is fp32 math rounded once, like
    torch's; its last fp32 bit may differ, so it is taken from the kernel: up = 1 gives it)."""
    gate, up = make_gate_up((9, 300), dtype, device)
    rounded_act = kernels.gated_fwd(gate, torch.ones_like(up), activation, True)
    assert torch.equal(kernels.gated_fwd(gate, up, activation, True), rounded_act * up)
    dy = torch.randn(gate.shape, device=device).to(dtype)
    d_gate_up, _ = kernels.gated_bwd(dy, gate, up, activation, False, True)
    assert torch.equal(d_gate_up[:, 300:], dy * rounded_act)


@pytest.mark.parametrize("round_activation", [False, True], ids=["round-once", "round-activation"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_recompute_output_is_the_forward_bitwise(device, activation, round_activation):
    for shape, dtype in (((19, 1031), torch.bfloat16), ((4, 96), torch.float32)):
        gate, up = make_gate_up(shape, dtype, device)
        y = kernels.gated_fwd(gate, up, activation, round_activation)
        dy = torch.randn_like(y)
        d_gate_up, y_again = kernels.gated_bwd(dy, gate, up, activation, True, round_activation)
        assert torch.equal(y, y_again)
        assert torch.equal(d_gate_up, kernels.gated_bwd(dy, gate, up, activation, False, round_activation)[0])


def test_strided_halves_read_in_place(device):
    """Halves of one (M, 2N) tensor (row stride 2N, up starting mid-row) give the bits contiguous
    copies give, forward and backward."""
    gate, up = make_gate_up((11, 77), torch.float16, device)
    assert gate.stride(0) == up.stride(0) == 154
    dy = torch.randn(11, 77, device=device).to(torch.float16)
    copies = gate.contiguous(), up.contiguous()
    assert torch.equal(kernels.gated_fwd(gate, up, "silu"), kernels.gated_fwd(*copies, "silu"))
    in_place, copied = (kernels.gated_bwd(dy, g, u, "gelu", False)[0] for g, u in ((gate, up), copies))
    assert torch.equal(in_place, copied)


def test_reference_matches_float64_autograd():
    """The reference's formulas (both roundings collapse in float64) against autograd."""
    gate, up = make_gate_up((7, 65), torch.float64, "cpu")
    dy = torch.randn(7, 65, dtype=torch.float64)
    for activation in ACTIVATIONS:
        leaves = [t.detach().requires_grad_() for t in (gate, up)]
        want = STOCK_ACTIVATIONS[activation](leaves[0]) * leaves[1]
        want.backward(dy)
        d_gate_up, y = ref.gated_bwd_ref(dy, gate, up, activation, True, False)
        assert rel_error(y, want) < 1e-13 and rel_error(ref.gated_fwd_ref(gate, up, activation, False), want) < 1e-13
        assert rel_error(d_gate_up, torch.cat([leaves[0].grad, leaves[1].grad], 1)) < 1e-13, activation


def test_large_gates_saturate(device):
    """Far in the tails act(g) is g or 0 and its slope 1 or 0: no NaN, no overflow."""
    gate = torch.tensor([[-1e4, -100.0, -30.0, 30.0, 100.0, 1e4]], device=device)
    up = torch.full_like(gate, 3.0)
    for activation in ACTIVATIONS:
        y = kernels.gated_fwd(gate, up, activation)
        d_gate_up, _ = kernels.gated_bwd(torch.ones_like(y), gate, up, activation, False)
        assert torch.allclose(y, torch.where(gate > 0, 3 * gate, 0.0), atol=1e-6, rtol=1e-6), activation
        assert torch.allclose(d_gate_up[:, :6], (gate > 0).float() * 3, atol=1e-6), activation


def test_empty_rows(device):
    gate, up = make_gate_up((0, 5), torch.bfloat16, device)
    assert kernels.gated_fwd(gate, up, "silu").shape == (0, 5)
    d_gate_up, y = kernels.gated_bwd(torch.empty(0, 5, device=device, dtype=torch.bfloat16), gate, up, "silu", True)
    assert d_gate_up.shape == (0, 10) and y.shape == (0, 5)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda g, u: kernels.gated_fwd(g, u, "relu"), ValueError, "activation must be one of"),
        (lambda g, u: kernels.gated_fwd(g, u[:, :5], "silu"), ValueError, "up must have shape (3, 8)"),
        (lambda g, u: kernels.gated_fwd(g, u.half(), "silu"), TypeError, "up must have dtype float32"),
        (lambda g, u: kernels.gated_fwd(g.long(), u, "silu"), TypeError, "gate must have dtype"),
        (lambda g, u: kernels.gated_fwd(g[None], u, "silu"), ValueError, "gate must have 2 dims"),
        (lambda g, u: kernels.gated_fwd(g, u.to("meta"), "gelu"), ValueError, "up is on meta"),
        (lambda g, u: kernels.gated_bwd(g[:2], g, u, "silu", False), ValueError, "dy must have shape (3, 8)"),
        (lambda g, u: kernels.gated_bwd(g, g, u, "swish", False), ValueError, "activation must be one of"),
        (lambda g, u: gelu_kernels.gelu_fwd(g, None, "fast"), ValueError, "approximate must be one of"),
    ],
    ids=["activation", "up-shape", "up-dtype", "int-gate", "3d-gate", "up-device", "dy-shape", "bwd-activation",
         "gelu-approximate"],
)
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as caught:
        call(torch.randn(3, 8), torch.randn(3, 8))
    assert words in str(caught.value)


# --- QuickGELU: gelu_fwd/gelu_bwd with approximate="quick" ---------------------------------------


def stock_quick_gelu(h):
    """transformers' QuickGELUActivation: input * sigmoid(1.702 * input)."""
    return h * torch.sigmoid(1.702 * h)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 127), (17, 1000), (4, 4099)], ids=lambda s: "x".join(map(str, s)))
def test_quick_gelu_matches_float64(device, shape, dtype, with_bias):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    bias = torch.randn(shape[-1], device=device).to(dtype) if with_bias else None
    y = gelu_kernels.gelu_fwd(x, bias, "quick")
    dy = torch.randn_like(y)
    dx, dbias, _ = gelu_kernels.gelu_bwd(dy, x, bias, "quick", False)
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in (x, bias)]
    y64 = stock_quick_gelu(leaves64[0] + leaves64[1] if with_bias else leaves64[0])
    y64.backward(dy.double())
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, bias)]
    stock = stock_quick_gelu(leaves[0] + leaves[1] if with_bias else leaves[0])
    stock.backward(dy)
    assert_within_twice_stock("y", y, y64, stock)
    # QuickGELU's derivative has a root, where dx cancels: noise measured on dy (see assert_within_twice_stock)
    assert_within_twice_stock("dx", dx, leaves64[0].grad, leaves[0].grad, terms=dy.double())
    if with_bias:
        assert_within_twice_stock("dbias", dbias, leaves64[1].grad, leaves[1].grad, terms=dy.double().abs().sum(0))
    ref_dx, ref_dbias, ref_y = gelu_ops.gelu_bwd_ref(dy.double(), x.double(), leaves64[1], "quick", True)
    assert rel_error(ref_y, y64) < 1e-13 and rel_error(ref_dx, leaves64[0].grad) < 1e-13
    assert rel_error(gelu_ops.gelu_fwd_ref(x.double(), leaves64[1], "quick"), y64) < 1e-13
    if with_bias:
        assert rel_error(ref_dbias, leaves64[1].grad) < 1e-13


def test_quick_gelu_recompute_and_saturation(device):
    x = (torch.randn(19, 1031, device=device) * 3).to(torch.bfloat16)
    bias = torch.randn(1031, device=device)
    y = gelu_kernels.gelu_fwd(x, bias, "quick")
    dy = torch.randn_like(y)
    dx, dbias, y_again = gelu_kernels.gelu_bwd(dy, x, bias, "quick", True)
    assert torch.equal(y, y_again)
    assert all(torch.equal(a, b) for a, b in zip((dx, dbias), gelu_kernels.gelu_bwd(dy, x, bias, "quick", False)))
    tails = torch.tensor([[-1e4, -100.0, 100.0, 1e4]], device=device)
    y = gelu_kernels.gelu_fwd(tails, None, "quick")
    dx, _, _ = gelu_kernels.gelu_bwd(torch.ones_like(tails), tails, None, "quick", False)
    assert torch.allclose(y, torch.tensor([[0.0, 0.0, 100.0, 1e4]], device=device), atol=1e-6, rtol=1e-6)
    assert torch.allclose(dx, torch.tensor([[0.0, 0.0, 1.0, 1.0]], device=device), atol=1e-6)


# --- ahead-of-time compile (every case of gated.aot_cases(): tests/package/test_triton_aot.py) ---------


def vector_cases():
    """The fused-projection layout at a 16-divisible width, forward and backward with recompute."""
    return [case for case in kernels.aot_cases()
            if "_bf16_round0_BN256_64x1024_halves" in case["name"] and "rec0" not in case["name"]]


def test_halves_of_a_fused_projection_use_16_byte_accesses():
    """gate and up as the halves of one (M, 2N) tensor: the kernels load and store 16 bytes at a
    time (LDG.E.128 / STG.E.128 in the SASS), the halves' row stride and offset notwithstanding."""
    pytest.importorskip("triton")
    results = compile_module_cases("test_gated_kernels:vector_cases", archs=(90,), extra_paths=[REPO, TESTS],
                                   sass=True)
    assert len(results) == 2 * len(ACTIVATIONS), format_results(results)
    for result in results:
        assert "LDG.E.128" in result["sass"] and "STG.E.128" in result["sass"], result["name"]
