"""GELU (exact erf, or tanh approximation) with an optional fused bias: reference, custom ops, public function.

The op works on a (rows, N) matrix whose last dim has stride 1; the bias, when given, has N
elements and is added before the activation: y = gelu(x + bias). Its backward kernel can also
rebuild y from x (recompute_output), so a fused MLP keeps only the pre-activation and never the
activation that the next Linear needs for its weight gradient.
"""

import math

import torch
from torch import Tensor

from .. import _backend
from .._validate import check_float_tensor, check_optional_param, rows_with_unit_stride

APPROXIMATIONS = ("none", "tanh")

# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch, in fp32 (or float64 when given float64).
# ---------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def _pre_activation(x, bias):
    math_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(math_dtype)
    return h + bias.to(math_dtype) if bias is not None else h


def _gelu_and_derivative(h, approximate):
    """gelu(h) and gelu'(h).

    exact:  gelu(h) = h·Φ(h),                 gelu'(h) = Φ(h) + h·φ(h)
    tanh:   gelu(h) = ½h(1 + t), t = tanh(u), u = √(2/π)(h + 0.044715h³)
            gelu'(h) = ½(1 + t) + ½h(1 − t²)·√(2/π)(1 + 3·0.044715h²)
    """
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (h + _TANH_CUBIC * h**3))
        value = 0.5 * h * (1 + t)
        derivative = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _TANH_CUBIC * h * h)
        return value, derivative
    cdf = 0.5 * (1 + torch.erf(h * (1 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * h * h) * (1 / math.sqrt(2 * math.pi))
    return h * cdf, cdf + h * pdf


def gelu_fwd_ref(x, bias, approximate):
    value, _ = _gelu_and_derivative(_pre_activation(x, bias), approximate)
    return value.to(x.dtype)


def gelu_bwd_ref(dy, x, bias, approximate, recompute_output):
    """(dx, dbias, y); dbias and y are empty where there is no bias or no recompute."""
    value, derivative = _gelu_and_derivative(_pre_activation(x, bias), approximate)
    dx = dy.to(derivative.dtype) * derivative
    dbias = dx.sum(dim=0).to(bias.dtype) if bias is not None else x.new_empty((0,))
    y = value.to(x.dtype) if recompute_output else x.new_empty((0,))
    return dx.to(x.dtype), dbias, y


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------


def _implementation(device):
    backend = _backend.choose("gelu", device)
    if backend == "triton":
        from ..triton_kernels import gelu as triton_gelu

        return triton_gelu.gelu_fwd, triton_gelu.gelu_bwd
    if backend == "cuda":
        return torch.ops.remat_C.gelu_fwd, torch.ops.remat_C.gelu_bwd
    return gelu_fwd_ref, gelu_bwd_ref


@torch.library.custom_op("remat::gelu_fwd", mutates_args=())
def gelu_fwd(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    """gelu(x + bias) of x (M, N), last dim of stride 1."""
    forward, _ = _implementation(x.device)
    return forward(x, bias, approximate)


@gelu_fwd.register_fake
def _gelu_fwd_fake(x, bias, approximate):
    return x.new_empty(x.shape)


@torch.library.custom_op("remat::gelu_bwd", mutates_args=())
def gelu_bwd(
    dy: Tensor, x: Tensor, bias: Tensor | None, approximate: str, recompute_output: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dbias, y): the gradient of gelu_fwd, and its output rebuilt when recompute_output.

    dbias is summed over rows deterministically; dbias and y are empty (shape (0,)) where
    there is no bias or no recompute.
    """
    _, backward = _implementation(x.device)
    return backward(dy, x, bias, approximate, recompute_output)


@gelu_bwd.register_fake
def _gelu_bwd_fake(dy, x, bias, approximate, recompute_output):
    dbias = x.new_empty(bias.shape, dtype=bias.dtype) if bias is not None else x.new_empty((0,))
    y = x.new_empty(x.shape) if recompute_output else x.new_empty((0,))
    return x.new_empty(x.shape), dbias, y


def _setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dy = rows_with_unit_stride(dy, x.shape[1])
    # Under create_graph=True the reference's formula, which a second backward can differentiate.
    backward = gelu_bwd_ref if _backend.backward_is_differentiated() else gelu_bwd
    dx, dbias, _ = backward(dy, x, bias, ctx.approximate, False)
    return dx, dbias if bias is not None and ctx.needs_input_grad[1] else None, None


gelu_fwd.register_autograd(_backward, setup_context=_setup_context)
_backend.refuse_double_backward(gelu_bwd, "remat::gelu_bwd")


def _register_cuda_extension_fakes():
    if not _backend.backends()["cuda"][0] or not hasattr(torch.ops.remat_C, "gelu_fwd"):
        return
    torch.library.register_fake("remat_C::gelu_fwd")(_gelu_fwd_fake)
    torch.library.register_fake("remat_C::gelu_bwd")(_gelu_bwd_fake)


_register_cuda_extension_fakes()

# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def check_approximate(approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")


def gelu(x, approximate="none", bias=None):
    """gelu(x + bias), like torch.nn.functional.gelu(x + bias, approximate=...) in one kernel.

    x: float32, float16 or bfloat16, any shape. bias: optional, of shape (x.shape[-1],),
    float32 or x's dtype. Math in fp32; autograd saves x (and the bias), never the output. A double
    backward works: a backward with create_graph=True runs the differentiable reference instead of
    the kernel.
    """
    check_float_tensor("x", x)
    check_approximate(approximate)
    if x.dim() == 0:
        return gelu(x.reshape(1), approximate, bias).reshape(())
    width = x.shape[-1]
    check_optional_param("bias", bias, (width,), "x", x)
    rows = rows_with_unit_stride(x, width)
    y = gelu_fwd(rows, bias.contiguous() if bias is not None else None, approximate)
    return y.view(x.shape)
