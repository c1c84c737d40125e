"""GELU (exact and tanh, with and without fused bias): kernels against float64, op contract, module, bad input."""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.ops import gelu as gelu_ops

from numerics import REL_TOL, assert_close_to_ref, rel_error, saved_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROXIMATIONS = ["none", "tanh"]
SHAPES = [(1, 1), (1, 7), (3, 1), (5, 127), (17, 1000), (4, 4099), (2, 3, 37)]


def make_inputs(shape, dtype, device, bias=True, bias_dtype=None):
    x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device=device).to(bias_dtype or dtype).requires_grad_() if bias else None
    return x, b


def check_against_float64(x, b, approximate):
    dy = torch.randn(x.shape, device=x.device).to(x.dtype)
    x64 = x.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    want = F.gelu(x64 + b64 if b is not None else x64, approximate=approximate)
    want.backward(dy.double())
    got = remat.gelu(x, approximate, b)
    got.backward(dy)
    assert got.dtype == x.dtype
    assert_close_to_ref("y", got, want, x.dtype)
    assert_close_to_ref("dx", x.grad, x64.grad, x.dtype)
    if b is not None:
        assert b.grad.dtype == b.dtype
        assert_close_to_ref("dbias", b.grad, b64.grad, b.dtype)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(target, shape, dtype, approximate):
    device, _ = target
    check_against_float64(*make_inputs(shape, dtype, device, bias=False), approximate)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 127), (33, 1000), (3, 4099)], ids=lambda s: "x".join(map(str, s)))
def test_fused_bias_matches_float64(target, shape, dtype, approximate):
    device, _ = target
    check_against_float64(*make_inputs(shape, dtype, device), approximate)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_bias_with_half_input(target, dtype):
    device, _ = target
    check_against_float64(*make_inputs((9, 300), dtype, device, bias_dtype=torch.float32), "none")


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_large_inputs_saturate(target, approximate):
    """Far in the tails gelu(x) is x or 0 and its slope 1 or 0: no NaN, no overflow."""
    device, _ = target
    x = torch.tensor([[-1e4, -60.0, -30.0, -10.0, 10.0, 30.0, 60.0, 1e4]], device=device, requires_grad=True)
    y = remat.gelu(x, approximate)
    y.backward(torch.ones_like(y))
    expected = torch.tensor([[0, 0, 0, 0, 10.0, 30.0, 60.0, 1e4]], device=device)
    assert torch.allclose(y, expected, atol=1e-6, rtol=1e-6), y
    assert torch.allclose(x.grad, (expected > 0).float(), atol=1e-6), x.grad


def test_strided_rows_and_empty(target):
    device, _ = target
    wide = torch.randn(7, 50, device=device)
    x = wide[:, :37].detach().requires_grad_()
    check_against_float64(x, torch.randn(37, device=device, requires_grad=True), "tanh")
    empty = torch.randn(0, 5, device=device, requires_grad=True)
    bias = torch.randn(5, device=device, requires_grad=True)
    remat.gelu(empty, "none", bias).sum().backward()
    assert empty.grad.shape == (0, 5) and torch.equal(bias.grad, torch.zeros(5, device=device))
    scalar = torch.tensor(0.7, device=device)
    assert rel_error(remat.gelu(scalar), F.gelu(scalar.double())) < 1e-6


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_recompute_output_rebuilds_forward_bitwise(target, approximate):
    device, _ = target
    x, b = (t.detach() for t in make_inputs((19, 1031), torch.bfloat16, device))
    y = gelu_ops.gelu_fwd(x, b, approximate)
    dy = torch.randn_like(x)
    dx, db, y_again = gelu_ops.gelu_bwd(dy, x, b, approximate, True)
    assert torch.equal(y, y_again)
    dx_plain, db_plain, nothing = gelu_ops.gelu_bwd(dy, x, b, approximate, False)
    assert nothing.numel() == 0 and torch.equal(dx, dx_plain) and torch.equal(db, db_plain)


def test_bias_gradient_is_deterministic(target):
    device, _ = target
    x, b = make_inputs((301, 129), torch.float32, device)
    dy = torch.randn_like(x)
    first = torch.autograd.grad(remat.gelu(x, "none", b), (x, b), dy)
    second = torch.autograd.grad(remat.gelu(x, "none", b), (x, b), dy)
    assert all(torch.equal(a, c) for a, c in zip(first, second))


def test_backends_agree_with_reference_path(target):
    device, backend = target
    x, b = make_inputs((11, 257), torch.float32, device)
    dy = torch.randn_like(x)
    kernel = torch.autograd.grad(remat.gelu(x, "tanh", b), (x, b), dy)
    with remat.use_backend("reference"):
        reference = torch.autograd.grad(remat.gelu(x, "tanh", b), (x, b), dy)
    for ours, ref in zip(kernel, reference):
        assert rel_error(ours, ref) < REL_TOL[torch.float32]


def test_saves_input_only(target):
    device, _ = target
    x, b = make_inputs((64, 96), torch.bfloat16, device)
    assert saved_bytes(lambda: remat.gelu(x, "none", b)) == 64 * 96 * 2 + 96 * 2


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_module_is_a_drop_in(target, approximate):
    device, _ = target
    ours, stock = remat.nn.GELU(approximate), torch.nn.GELU(approximate)
    assert isinstance(ours, torch.nn.GELU) and repr(ours) == repr(stock)
    x = torch.randn(3, 4, 50, device=device)
    assert rel_error(ours(x), stock(x)) < 1e-5


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x, b: remat.gelu(x.long()), TypeError, "x must have dtype"),
        (lambda x, b: remat.gelu(x, "fast"), ValueError, "approximate must be one of"),
        (lambda x, b: remat.gelu(x, "none", b[:3]), ValueError, "bias must have shape (8,)"),
        (lambda x, b: remat.gelu(x, "none", b.to("meta")), ValueError, "bias is on meta"),
        (lambda x, b: remat.gelu(x, "none", b.int()), TypeError, "bias must have dtype"),
    ],
    ids=["int-x", "approximate", "bias-shape", "bias-device", "bias-dtype"],
)
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as caught:
        call(torch.randn(3, 8), torch.randn(8))
    assert words in str(caught.value)


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_keeps_the_memory_format(target, layout, with_bias):
    """As torch's elementwise ops: a channels_last or transposed input gives an output in its layout
    (without a copy of the input when there is no bias), and its gradient too."""
    device, _ = target
    x = torch.randn(2, 3, 4, 5, device=device)
    x = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x.transpose(1, 3)
    x.requires_grad_()
    bias = torch.randn(x.shape[-1], device=device) if with_bias else None
    out = remat.gelu(x, bias=bias)
    expected = F.gelu(x.double() + (bias.double() if with_bias else 0))
    assert out.stride() == F.gelu(x + (bias if with_bias else 0)).stride()
    assert_close_to_ref("gelu", out, expected, torch.float32)
    out.backward(torch.ones_like(out))
    assert x.grad.stride() == x.stride()
