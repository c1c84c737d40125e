"""GELU (exact erf, or tanh approximation) with an optional fused bias: reference, custom ops, public function.

The op works on a (rows, N) matrix whose last dim has stride 1; the bias, when given, has N
elements and is added before the activation: y = gelu(x + bias). Its backward kernel can also
rebuild y from x (recompute_output), so a fused MLP keeps only the pre-activation and never the
activation that the next Linear needs for its weight gradient.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _backend
from .._validate import check_float_tensor, check_optional_param, rows_with_unit_stride
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves

# "quick" is QuickGELU, h·σ(1.702h) (CLIP, and transformers' "quick_gelu").
APPROXIMATIONS = ("none", "tanh", "quick")

# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch, in fp32 (or float64 when given float64).
# ---------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715
_QUICK_SCALE = 1.702


def _pre_activation(x, bias):
    math_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(math_dtype)
    return h + bias.to(math_dtype) if bias is not None else h


def gelu_and_derivative(h, approximate):
    """gelu(h) and gelu'(h).

    exact:  gelu(h) = h·Φ(h),                 gelu'(h) = Φ(h) + h·φ(h)
    tanh:   gelu(h) = ½h(1 + t), t = tanh(u), u = √(2/π)(h + 0.044715h³)
            gelu'(h) = ½(1 + t) + ½h(1 − t²)·√(2/π)(1 + 3·0.044715h²)
    quick:  gelu(h) = h·s, s = σ(1.702h),    gelu'(h) = s + 1.702h·s(1 − s)
    """
    if approximate == "quick":
        s = torch.sigmoid(_QUICK_SCALE * h)
        return h * s, s + _QUICK_SCALE * h * s * (1 - s)
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (h + _TANH_CUBIC * h**3))
        value = 0.5 * h * (1 + t)
        derivative = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _TANH_CUBIC * h * h)
        return value, derivative
    cdf = 0.5 * (1 + torch.erf(h * (1 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * h * h) * (1 / math.sqrt(2 * math.pi))
    return h * cdf, cdf + h * pdf


def gelu_fwd_ref(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    """gelu(x + bias) of x (M, N), last dim of stride 1."""
    value, _ = gelu_and_derivative(_pre_activation(x, bias), approximate)
    return value.to(x.dtype)


def gelu_bwd_ref(
    dy: Tensor, x: Tensor, bias: Tensor | None, approximate: str, recompute_output: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dbias, y): the gradient of gelu_fwd, and its output rebuilt when recompute_output.

    dbias is summed over rows (deterministically, in the kernels); dbias and y are empty (shape
    (0,)) where there is no bias or no recompute.
    """
    value, derivative = gelu_and_derivative(_pre_activation(x, bias), approximate)
    dx = dy.to(derivative.dtype) * derivative
    dbias = dx.sum(dim=0).to(bias.dtype) if bias is not None else x.new_empty((0,))
    y = value.to(x.dtype) if recompute_output else x.new_empty((0,))
    return dx.to(x.dtype), dbias, y


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd (the ops themselves are declared at the end of the file)
# ---------------------------------------------------------------------------------------------


def _gelu_fwd_fake(x, bias, approximate):
    return x.new_empty(x.shape)


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
    order = _memory_order(x)
    if order is not None and bias is None:  # elementwise: computed in x's memory order, returned in it
        return gelu(x.permute(order), approximate).permute(sorted(range(x.dim()), key=order.__getitem__))
    rows = rows_with_unit_stride(x, width)
    y = gelu_fwd(rows, bias.contiguous() if bias is not None else None, approximate).view(x.shape)
    if order is not None:  # as torch's x + bias: the output in x's memory format
        return torch.empty_like(x).copy_(y)
    return y


def _memory_order(x):
    """The dims of x from the largest stride to the smallest when x is dense and non-overlapping but
    not contiguous (channels_last, a transpose): x.permute(order) is contiguous. Else None."""
    if x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d]))
    return order if x.permute(order).is_contiguous() else None


# ---------------------------------------------------------------------------------------------
# The family: remat::gelu_fwd and remat::gelu_bwd, and what the tooling needs
# ---------------------------------------------------------------------------------------------


def _samples(device):
    """A width of 37 (no power of two, a masked tail), with and without bias, both approximations;
    the forward's inputs require grad (so opcheck checks its autograd too), the backward's do not."""
    x, bias = torch.randn(5, 37, device=device), torch.randn(37, device=device)
    forward, backward = [], []
    for b in (bias, None):
        for approximate in APPROXIMATIONS:
            forward.append((*grad_leaves(x, b), approximate))
            backward += [(torch.randn_like(x), x, b, approximate, recompute) for recompute in (False, True)]
    return OpSamples(forward, backward)


_WIDTH = 24  # the validation table's width: no power of two
FAMILY = OpFamily(
    name="gelu",
    forward_ref=gelu_fwd_ref,
    backward_ref=gelu_bwd_ref,
    forward_fake=_gelu_fwd_fake,
    backward_fake=_gelu_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="gelu",
    calls=(PublicCall("gelu", {"x": (2, 3, _WIDTH), "bias": (_WIDTH,)},
                      lambda t: gelu(t["x"], "tanh", t["bias"]),
                      lambda t: F.gelu(t["x"] + t["bias"], approximate="tanh")),),
    triton="gelu",
    cuda=True,
)
gelu_fwd, gelu_bwd = FAMILY.forward, FAMILY.backward
