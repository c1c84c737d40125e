"""LayerNorm: reference, custom ops (kernel, fake, autograd), public function.

The op works on a (rows, N) matrix whose last dim has stride 1. The forward keeps x and the
fp32 per-row statistics (mean, rstd); the backward recomputes x̂ = (x - mean) * rstd from them,
and can also rebuild the output y (recompute_output) for a fused consumer such as a Linear
that needs LN(x) for its weight gradient.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _backend
from .._numerics import math_dtype
from .._validate import (
    autocast_dtype,
    cast_for_autocast,
    check_eps,
    check_float_tensor,
    check_optional_param,
    integer,
    rows_with_unit_stride,
)
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves

# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch, in fp32 (or float64 when given float64, as the tests do).
# ---------------------------------------------------------------------------------------------



def layer_norm_fwd_ref(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) for x of shape (M, N), last dim of stride 1; mean/rstd in fp32 (float64 for
    float64 input)."""
    xf = x.to(math_dtype(x))
    mean, rstd = _statistics(xf, eps)
    # y is normalised with the stored fp32 mean, as the backward recomputes it, so a recomputed y
    # is bitwise the forward's.
    y = _affine((xf - mean[:, None]) * rstd[:, None], weight, bias)
    return y.to(x.dtype), mean, rstd


def _statistics(xf, eps):
    """(mean, rstd) per row of xf (M, N), in xf's dtype; differentiable.

    Corrected two-pass statistics: the rounding error of the first mean is measured on the
    centred values and removed, so the variance of inputs whose mean is far above their spread
    keeps full precision.
    """
    rough_mean = xf.mean(dim=1, keepdim=True)
    centered = xf - rough_mean
    correction = centered.mean(dim=1, keepdim=True)
    rstd = torch.rsqrt((centered - correction).square().mean(dim=1) + eps)
    return (rough_mean + correction).squeeze(1), rstd


def _affine(x_hat, weight, bias):
    y = x_hat
    if weight is not None:
        y = y * weight.to(x_hat.dtype)
    if bias is not None:
        y = y + bias.to(x_hat.dtype)
    return y


def layer_norm_bwd_ref(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    recompute_output: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw, db, y) from the saved x and statistics: the gradients of layer_norm_fwd, and its
    output y rebuilt when recompute_output.

    dw, db and y are empty (shape (0,)) where there is no weight, no bias, or no recompute.
    """
    compute = math_dtype(x)
    x_hat = (x.to(compute) - mean[:, None].to(compute)) * rstd[:, None].to(compute)
    dy_f = dy.to(compute)
    w_dy = dy_f * weight.to(compute) if weight is not None else dy_f
    c1 = (w_dy * x_hat).mean(dim=1, keepdim=True)
    c2 = w_dy.mean(dim=1, keepdim=True)
    dx = (w_dy - x_hat * c1 - c2) * rstd[:, None].to(compute)
    dw = (dy_f * x_hat).sum(dim=0).to(weight.dtype) if weight is not None else _absent(x)
    db = dy_f.sum(dim=0).to(bias.dtype) if bias is not None else _absent(x)
    y = _affine(x_hat, weight, bias).to(x.dtype) if recompute_output else _absent(x)
    return dx.to(x.dtype), dw, db, y


def _absent(x):
    """Placeholder for an output that does not exist (no weight, no bias, no recompute)."""
    return x.new_empty((0,))


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd (the ops themselves are declared at the end of the file)
# ---------------------------------------------------------------------------------------------


def _layer_norm_fwd_fake(x, weight, bias, eps):
    rows = x.shape[0]
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=math_dtype(x)), x.new_empty((rows,), dtype=math_dtype(x))


def _layer_norm_bwd_fake(dy, x, weight, bias, mean, rstd, recompute_output):
    def param_grad(param):
        return x.new_empty(param.shape, dtype=param.dtype) if param is not None else x.new_empty((0,))

    y = x.new_empty(x.shape) if recompute_output else x.new_empty((0,))
    return x.new_empty(x.shape), param_grad(weight), param_grad(bias), y


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps = eps
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dy = rows_with_unit_stride(dy, x.shape[1])
    if _backend.backward_is_differentiated():
        # create_graph=True: the reference's formula, which a second backward can differentiate,
        # with the statistics recomputed from x: the saved ones are constants to autograd.
        mean, rstd = _statistics(x.to(math_dtype(x)), ctx.eps)
        dx, dw, db, _ = layer_norm_bwd_ref(dy, x, weight, bias, mean, rstd, False)
    else:
        dx, dw, db, _ = layer_norm_bwd(dy, x, weight, bias, mean, rstd, False)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw if weight is not None and ctx.needs_input_grad[1] else None,
        db if bias is not None and ctx.needs_input_grad[2] else None,
        None,
    )


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def normalized_width(x, normalized_shape):
    if integer(normalized_shape) is not None:
        normalized_shape = (normalized_shape,)
    dims = tuple(map(integer, normalized_shape)) if isinstance(normalized_shape, (tuple, list, torch.Size)) else ()
    if not dims or any(d is None or d < 1 for d in dims):
        raise ValueError(f"normalized_shape must be a non-empty tuple of positive ints, got {normalized_shape!r}")
    normalized_shape = dims
    if tuple(x.shape[x.dim() - len(normalized_shape):]) != normalized_shape or x.dim() < len(
        normalized_shape
    ):
        raise ValueError(
            f"normalized_shape {normalized_shape} does not match the trailing dims of x "
            f"(shape {tuple(x.shape)})"
        )
    return normalized_shape, math.prod(normalized_shape)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the trailing `normalized_shape` dims of x, like torch.nn.functional.layer_norm.

    x: float32, float16 or bfloat16, any leading shape. weight/bias: optional, of
    `normalized_shape`, float32 or x's dtype, on x's device. Statistics are computed in fp32; autograd saves
    x and the fp32 mean/rstd per row (8 bytes a row), never the output. A double backward works: a
    backward with create_graph=True runs the differentiable reference instead of the kernel.
    """
    check_float_tensor("x", x)
    if x.device.type == "cuda" and autocast_dtype("cuda") is not None:
        # As torch's own: under CUDA autocast, layer_norm runs and returns float32.
        with torch.autocast("cuda", enabled=False):
            return layer_norm(*cast_for_autocast(torch.float32, x), normalized_shape,
                              *cast_for_autocast(torch.float32, weight, bias), eps)
    normalized_shape, width = normalized_width(x, normalized_shape)
    check_optional_param("weight", weight, normalized_shape, "x", x)
    check_optional_param("bias", bias, normalized_shape, "x", x)
    check_eps(eps)
    rows = rows_with_unit_stride(x, width)
    flat_weight = weight.reshape(width).contiguous() if weight is not None else None
    flat_bias = bias.reshape(width).contiguous() if bias is not None else None
    y, _mean, _rstd = layer_norm_fwd(rows, flat_weight, flat_bias, float(eps))
    return y.view(x.shape)


# ---------------------------------------------------------------------------------------------
# The family: remat::layer_norm_fwd and remat::layer_norm_bwd, and what the tooling needs
# ---------------------------------------------------------------------------------------------


def _samples(device):
    """A width of 37 (no power of two, a masked tail), with and without weight and bias; the forward's
    inputs require grad (so opcheck checks its autograd too), the backward's do not (it has no derivative)."""
    x, weight, bias = (torch.randn(*shape, device=device) for shape in ((5, 37), (37,), (37,)))
    forward, backward = [], []
    for params in ((weight, bias), (None, None)):
        forward.append((*grad_leaves(x, *params), 1e-5))
        _, mean, rstd = layer_norm_fwd_ref(x, *params, 1e-5)
        backward += [(torch.randn_like(x), x, *params, mean, rstd, recompute) for recompute in (False, True)]
    return OpSamples(forward, backward)


_WIDTH = 24  # the validation table's width: no power of two
FAMILY = OpFamily(
    name="layer_norm",
    forward_ref=layer_norm_fwd_ref,
    backward_ref=layer_norm_bwd_ref,
    forward_fake=_layer_norm_fwd_fake,
    backward_fake=_layer_norm_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="layernorm",
    calls=(PublicCall("layer_norm", {"x": (2, 3, _WIDTH), "weight": (_WIDTH,), "bias": (_WIDTH,)},
                      lambda t: layer_norm(t["x"], (_WIDTH,), t["weight"], t["bias"]),
                      lambda t: F.layer_norm(t["x"], (_WIDTH,), t["weight"], t["bias"])),),
    triton="layer_norm",
    cuda=True,
)
layer_norm_fwd, layer_norm_bwd = FAMILY.forward, FAMILY.backward
