"""LayerNorm: kernels against a float64 reference, the op contract, the module, bad input."""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.ops import layer_norm as ln_ops

from numerics import REL_TOL, assert_close_to_ref, rel_error, saved_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, width): one row, width 1, primes, not powers of two, wider than one block, very wide.
SHAPES = [(1, 1), (1, 7), (3, 1), (5, 127), (17, 1000), (4, 4099), (3, 16411), (2, 65536), (2, 100003)]
AFFINE = [(True, True), (True, False), (False, False)]


def make_inputs(shape, dtype, device, weight=True, bias=True, param_dtype=None):
    """Fresh random x and parameters (never zeros, never ones), requiring grad."""
    width = shape[-1]
    param_dtype = param_dtype or dtype
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.randn(width, device=device) + 1).to(param_dtype).requires_grad_() if weight else None
    b = torch.randn(width, device=device).to(param_dtype).requires_grad_() if bias else None
    return x, w, b


def float64_reference(x, w, b, dy, eps=1e-5):
    """Output and gradients of torch's own LayerNorm in float64 (an oracle independent of remat)."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = F.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2], eps)
    y.backward(dy.double())
    return y, *[t.grad if t is not None else None for t in leaves]


def run_remat(x, w, b, dy, eps=1e-5):
    y = remat.layer_norm(x, (x.shape[-1],), w, b, eps)
    y.backward(dy)
    return y, x.grad, w.grad if w is not None else None, b.grad if b is not None else None


def check_against_float64(x, w, b, eps=1e-5):
    dy = torch.randn(x.shape, device=x.device).to(x.dtype)
    ref = float64_reference(x, w, b, dy, eps)
    ours = run_remat(x, w, b, dy, eps)
    for name, out, expected, dtype in zip(
        ("y", "dx", "dw", "db"), ours, ref, (x.dtype, x.dtype, *(t.dtype if t is not None else None for t in (w, b)))
    ):
        if expected is None:
            assert out is None, f"{name} should not exist"
            continue
        assert out.dtype == dtype, f"{name} dtype {out.dtype} != {dtype}"
        assert_close_to_ref(name, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(target, shape, dtype):
    device, _ = target
    check_against_float64(*make_inputs(shape, dtype, device))


@pytest.mark.parametrize("affine", AFFINE, ids=["weight+bias", "weight", "none"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 16411)], ids=lambda s: "x".join(map(str, s)))
def test_optional_weight_and_bias(target, shape, affine):
    device, _ = target
    check_against_float64(*make_inputs(shape, torch.float16, device, *affine))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_parameters_with_half_input(target, dtype):
    device, _ = target
    check_against_float64(*make_inputs((9, 300), dtype, device, param_dtype=torch.float32))


def test_leading_dims_and_strides(target):
    """Rows with a stride larger than the width, and leading dims that cannot be flattened."""
    device, _ = target
    wide = torch.randn(6, 5, 96, device=device)
    sliced = wide[:, :, :80].detach().requires_grad_()  # row stride 96, width 80
    check_against_float64(sliced, *make_inputs((80,), torch.float32, device)[1:])
    transposed = torch.randn(5, 6, 40, device=device).transpose(0, 1).detach().requires_grad_()
    check_against_float64(transposed, *make_inputs((40,), torch.float32, device)[1:])


def test_multi_dim_normalized_shape(target):
    device, _ = target
    x = torch.randn(3, 4, 5, 6, device=device, requires_grad=True)
    w = torch.randn(5, 6, device=device, requires_grad=True)
    y = remat.layer_norm(x, (5, 6), w, None)
    ref = F.layer_norm(x.double(), (5, 6), w.double())
    assert_close_to_ref("y", y, ref, torch.float32)
    y.sum().backward()  # an expanded (stride 0) gradient
    assert w.grad.shape == (5, 6)


def test_empty_rows(target):
    device, _ = target
    x = torch.randn(0, 3, 17, device=device, requires_grad=True)
    w = torch.randn(17, device=device, requires_grad=True)
    b = torch.randn(17, device=device, requires_grad=True)
    y = remat.layer_norm(x, (17,), w, b)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_large_mean_is_stable(target):
    """Mean 1e4, spread 1: a variance from E[x²] − E[x]² would lose every digit here.

    y and the gradients cannot beat the fp32 rounding of the saved mean (as in PyTorch, which
    saves the same statistics), so they are held to twice PyTorch's own fp32 error.
    """
    device, _ = target
    x = (1e4 + torch.randn(4, 1000, device=device)).requires_grad_()
    w = torch.randn(1000, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    reference = float64_reference(x, w, None, dy)
    ours = run_remat(x, w, None, dy)
    x.grad = w.grad = None
    stock = F.layer_norm(x, (1000,), w)
    stock.backward(dy)
    for name, got, want, torch_own in zip(("y", "dx", "dw"), ours, reference, (stock, x.grad, w.grad)):
        assert rel_error(got, want) <= 2 * rel_error(torch_own, want) + 1e-6, name
    _, _, rstd = ln_ops.layer_norm_fwd(x.detach(), None, None, 1e-5)
    assert rel_error(rstd, torch.rsqrt(x.detach().double().var(1, unbiased=False) + 1e-5)) < 1e-5


def test_recompute_output_rebuilds_forward_bitwise(target):
    device, _ = target
    x, w, b = (t.detach() for t in make_inputs((13, 2053), torch.bfloat16, device))
    y, mean, rstd = ln_ops.layer_norm_fwd(x, w, b, 1e-5)
    dy = torch.randn_like(x)
    dx, dw, db, y_again = ln_ops.layer_norm_bwd(dy, x, w, b, mean, rstd, True)
    assert torch.equal(y, y_again), "recomputed output differs from the forward's"
    dx_plain, dw_plain, db_plain, nothing = ln_ops.layer_norm_bwd(dy, x, w, b, mean, rstd, False)
    assert nothing.numel() == 0
    assert torch.equal(dx, dx_plain) and torch.equal(dw, dw_plain) and torch.equal(db, db_plain)


def test_statistics_are_fp32(target):
    device, _ = target
    x = torch.randn(6, 50, device=device).to(torch.bfloat16)
    _, mean, rstd = ln_ops.layer_norm_fwd(x, None, None, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32
    xd = x.double()
    assert rel_error(mean, xd.mean(1)) < 1e-6
    assert rel_error(rstd, torch.rsqrt(xd.var(1, unbiased=False) + 1e-5)) < 1e-6


def test_backward_is_deterministic(target):
    device, _ = target
    x, w, b = make_inputs((67, 300), torch.float32, device)
    dy = torch.randn_like(x)
    first = torch.autograd.grad(remat.layer_norm(x, (300,), w, b), (x, w, b), dy)
    second = torch.autograd.grad(remat.layer_norm(x, (300,), w, b), (x, w, b), dy)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


# The backward's parameter-gradient path: persistent programs that each loop over several row
# blocks (the last one partial), then one kernel summing the (G, N) partials and casting them.
# Under the interpreter 1 x 97 is one program, 257 x 97 six programs of three 16-row steps, 700 x
# 33 eight programs of four 32-row steps.
PARAM_GRAD_SHAPES = [(1, 97), (257, 97), (700, 33)]


@pytest.mark.parametrize("param_dtype", ["same", torch.float32], ids=["same-params", "fp32-params"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PARAM_GRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_parameter_gradients_over_many_row_blocks(target, shape, dtype, param_dtype):
    device, _ = target
    param_dtype = dtype if param_dtype == "same" else param_dtype
    for weight, bias in AFFINE:
        check_against_float64(*make_inputs(shape, dtype, device, weight, bias, param_dtype=param_dtype))


@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                (torch.float32, torch.float32)], ids=str)
def test_parameter_gradients_are_bitwise_reproducible(target, dtype, param_dtype):
    device, _ = target
    x, w, b = (t.detach() for t in make_inputs((257, 97), dtype, device, param_dtype=param_dtype))
    _, mean, rstd = ln_ops.layer_norm_fwd(x, w, b, 1e-5)
    dy = torch.randn_like(x)
    first = ln_ops.layer_norm_bwd(dy, x, w, b, mean, rstd, False)
    for _ in range(2):
        again = ln_ops.layer_norm_bwd(dy, x, w, b, mean, rstd, False)
        assert all(torch.equal(a, c) for a, c in zip(first, again))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_partial_sums_reduce_in_one_kernel(target, out_dtype):
    """The second step on its own, with more partial rows than one pass of its loop takes (G = 70
    is two full 32-row chunks and a partial one) and a ragged width: fp32 sums, cast to the output
    dtype, each output present or absent."""
    device, backend = target
    if backend != "triton":
        pytest.skip("a Triton launcher")
    from remat.triton_kernels import layer_norm as kernels

    dw_partial, db_partial = (torch.randn(70, 45, device=device) for _ in range(2))
    for with_dw, with_db in ((True, True), (True, False), (False, True)):
        dw, db = (torch.full((45,), float("nan"), device=device, dtype=out_dtype) for _ in range(2))
        kernels._sum_partials(dw_partial if with_dw else None, db_partial if with_db else None, dw, db)
        for wanted, out, partial in ((with_dw, dw, dw_partial), (with_db, db, db_partial)):
            if wanted:
                assert_close_to_ref("sum", out, partial.double().sum(0), out_dtype)
            else:
                assert out.isnan().all(), "an absent output was written"


@pytest.mark.parametrize("row_stride", [4112, 4120], ids=["aligned-rows", "unaligned-rows"])
def test_rows_between_4096_and_8192_wide(target, row_stride):
    """4112 columns: fused on rows Triton vectorises (row stride a multiple of 16), the looped path
    on the others (their per-element predicates spill in the fused kernel); both exact."""
    device, _ = target
    storage = torch.randn(3, row_stride, device=device).to(torch.bfloat16)
    x = storage[:, :4112].detach().requires_grad_()
    check_against_float64(x, *make_inputs((4112,), torch.bfloat16, device)[1:])


def test_backends_agree_with_reference_path(target):
    """The kernel and the PyTorch reference (the CPU fallback) give the same numbers."""
    device, backend = target
    x, w, b = make_inputs((11, 257), torch.float32, device)
    dy = torch.randn_like(x)
    kernel = torch.autograd.grad(remat.layer_norm(x, (257,), w, b), (x, w, b), dy)
    remat.set_backend("reference")
    try:
        reference = torch.autograd.grad(remat.layer_norm(x, (257,), w, b), (x, w, b), dy)
    finally:
        remat.set_backend(backend)
    for ours, ref in zip(kernel, reference):
        assert rel_error(ours, ref) < REL_TOL[torch.float32]


# --- memory ------------------------------------------------------------------------------------


def test_saves_input_and_fp32_statistics_only(target):
    device, _ = target
    rows, width = 64, 96
    x, w, b = make_inputs((rows, width), torch.bfloat16, device)
    measured = saved_bytes(lambda: remat.layer_norm(x, (width,), w, b))
    x_bytes, params, stats = rows * width * 2, 2 * width * 2, 2 * rows * 4
    assert measured == x_bytes + params + stats


# --- the module --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}], ids=str)
def test_module_is_a_drop_in(target, kwargs):
    device, _ = target
    stock = torch.nn.LayerNorm(48, **kwargs).to(device)
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(torch.randn_like(p))
    ours = remat.nn.LayerNorm(48, **kwargs).to(device)
    assert isinstance(ours, torch.nn.LayerNorm)
    ours.load_state_dict(stock.state_dict())
    assert ours.state_dict().keys() == stock.state_dict().keys()
    x = torch.randn(2, 5, 48, device=device)
    assert rel_error(ours(x), stock(x)) < 1e-5
    shared = remat.nn.LayerNorm.from_torch(stock)
    assert rel_error(shared(x), stock(x)) < 1e-5
    assert all(a is b for a, b in zip(shared.parameters(), stock.parameters()))


# --- bad input ---------------------------------------------------------------------------------


def test_reference_path_matches_float64(reference_backend):
    check_against_float64(*make_inputs((7, 129), torch.float32, "cpu"))
    check_against_float64(*make_inputs((7, 129), torch.bfloat16, "cpu", bias=False))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x, w: remat.layer_norm(x.long(), (8,), w), TypeError, "x must have dtype"),
        (lambda x, w: remat.layer_norm(x.to(torch.complex64), (8,), w), TypeError, "x must have dtype"),
        (lambda x, w: remat.layer_norm(x.tolist(), (8,), w), TypeError, "x must be a torch.Tensor"),
        (lambda x, w: remat.layer_norm(x, (8,), w[:5]), ValueError, "weight must have shape (8,)"),
        (lambda x, w: remat.layer_norm(x, (8,), None, w.int()), TypeError, "bias must have dtype"),
        (lambda x, w: remat.layer_norm(x, (8,), w.to("meta")), ValueError, "weight is on meta"),
        (lambda x, w: remat.layer_norm(x, (7,), None), ValueError, "normalized_shape (7,) does not match"),
        (lambda x, w: remat.layer_norm(x, (2, 3, 8), None), ValueError, "does not match"),
        (lambda x, w: remat.layer_norm(x, (0,), None), ValueError, "normalized_shape must be"),
        (lambda x, w: remat.layer_norm(x, (8,), w, eps=-1.0), ValueError, "eps must be"),
        (lambda x, w: remat.set_backend("tpu"), ValueError, "backend must be one of"),
    ],
    ids=["int-x", "complex-x", "list-x", "weight-shape", "bias-dtype", "weight-device",
         "normalized-shape", "normalized-shape-too-long", "normalized-shape-zero", "eps", "backend"],
)
def test_bad_input_is_named(call, error, words):
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(error) as caught:
        call(x, w)
    assert words in str(caught.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU for a CUDA input")
def test_cpu_weight_with_cuda_input_is_named():
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        remat.layer_norm(torch.randn(3, 8, device="cuda"), (8,), torch.randn(8))


def test_parameter_gradients_do_not_depend_on_recompute_at_scale(target):
    """dw/db bits must not change with recompute_output, also where the GPU grid has many programs."""
    device, _ = target
    if device == "cpu":
        pytest.skip("the interpreter's grid is fixed at 4 programs; the GPU grid follows occupancy")
    x, w, b = (t.detach() for t in make_inputs((16384, 128), torch.float16, device))
    _, mean, rstd = ln_ops.layer_norm_fwd(x, w, b, 1e-5)
    dy = torch.randn_like(x)
    with_y = ln_ops.layer_norm_bwd(dy, x, w, b, mean, rstd, True)
    without_y = ln_ops.layer_norm_bwd(dy, x, w, b, mean, rstd, False)
    assert torch.equal(with_y[1], without_y[1]) and torch.equal(with_y[2], without_y[2])


def test_integer_like_normalized_shapes_are_ints(target):
    """numpy's and torch's integer scalars in normalized_shape are ints, as torch.nn.functional.layer_norm
    takes them; a float is refused by name."""
    import numpy as np

    device, _ = target
    x = torch.randn(3, 16, device=device)
    expected = remat.layer_norm(x, (16,))
    for shape in [(np.int64(16),), np.int64(16), [torch.tensor(16)]]:
        assert torch.equal(remat.layer_norm(x, shape), expected)
    with pytest.raises(ValueError, match="normalized_shape must be a non-empty tuple of positive ints"):
        remat.layer_norm(x, (16.0,))
