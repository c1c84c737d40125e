"""RMSNorm: references (one per stock rounding, "style"), custom ops (kernel, fake, autograd), public function.

The op works on a (rows, N) matrix whose last dim has stride 1. The forward keeps x and one fp32
rstd per row (4 bytes a row); the backward recomputes x̂ = x · rstd from them, and can also
rebuild the output y (recompute_output) for a fused consumer, a Linear that needs it for its
weight gradient. The kernels are the LayerNorm kernels' RMS mode (triton_kernels/layer_norm.py).

Each style computes x̂ = x · rstd, rstd = rsqrt(mean(x²) + eps), in fp32 (float64 for float64
input) and scales it by the weight, but the stock modules round at different points:

  torch  torch.nn.RMSNorm / F.rms_norm: y = (x̂ · w) cast to x's dtype.
  llama  transformers' LlamaRMSNorm (Mistral, Qwen2/3, Phi-3 ...): x̂ cast to x's dtype, then
         w · that, in the promoted dtype of w and x (fp32 for an fp32 weight on bf16 input).
  gemma  GemmaRMSNorm (Gemma 1/2/3): y = (x̂ · (1 + w)) cast to x's dtype, all in fp32.
  t5     T5LayerNorm: x̂ cast to w's dtype when that is fp16/bf16, then w · that; y in w's dtype.

The reference forward runs the stock module's own sequence of operations, so given the same rstd it
rounds bitwise as the module does. The backward is the exact gradient in the math dtype, taking the
casts as the identity (as autograd does for the stock modules).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _backend
from .._numerics import math_dtype
from .._validate import check_choice, check_eps, check_float_tensor, check_optional_param, rows_with_unit_stride
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves
from .layer_norm import normalized_width

STYLES = ("torch", "llama", "gemma", "t5")

# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch, in fp32 (or float64 when given float64, as the tests do).
# ---------------------------------------------------------------------------------------------



def default_eps(dtype):
    """The eps torch's rms_norm uses for eps=None: that of its computation dtype, float32 for every
    input dtype but float64 (not finfo(dtype).eps: bfloat16's would be 2**-7)."""
    return torch.finfo(math_dtype(torch.empty((), dtype=dtype))).eps


def rms_norm_rstd_ref(x, eps):
    """rstd (M,) of x (M, N), with the operations the stock modules use for it; differentiable."""
    xf = x.to(math_dtype(x))
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps).squeeze(-1)


def output_dtype(style, x_dtype, weight):
    """The dtype of y: x's, but for "llama" (promoted with w's) and "t5" (w's) with a weight."""
    if weight is None:
        return x_dtype
    if style == "llama":
        return torch.promote_types(x_dtype, weight.dtype)
    return weight.dtype if style == "t5" else x_dtype


def rms_norm_output_ref(x, weight, rstd, style):
    """y from x and its rstd, rounded as the stock module of `style` rounds it."""
    compute = math_dtype(x)
    x_hat = x.to(compute) * rstd[:, None].to(compute)
    if weight is None:
        return x_hat.to(x.dtype)
    if style == "torch":
        return (x_hat * weight).to(x.dtype)
    if style == "llama":
        return weight * x_hat.to(x.dtype)
    if style == "gemma":
        return (x_hat * (1.0 + weight.to(compute))).to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):  # t5
        x_hat = x_hat.to(weight.dtype)
    return weight * x_hat


def rms_norm_fwd_ref(x: Tensor, weight: Tensor | None, eps: float, style: str) -> tuple[Tensor, Tensor]:
    """(y, rstd) for x (M, N); rstd fp32 (float64 for float64 input)."""
    rstd = rms_norm_rstd_ref(x, eps)
    return rms_norm_output_ref(x, weight, rstd, style), rstd


def rms_norm_bwd_ref(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, style: str, recompute_output: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, y): dx in x's dtype, dw in weight's (empty (0,) in x's dtype without a weight), y (in
    output_dtype, empty (0,) without recompute_output).

    With x̂ = x · rstd and g = dy · w' (w' = 1 + w for gemma, w otherwise):
    dx = rstd · (g − x̂ · mean(g · x̂)),  dw = Σ over rows of dy · x̂.
    """
    compute = math_dtype(x)
    x_hat = x.to(compute) * rstd[:, None].to(compute)
    dy_f = dy.to(compute)
    g = dy_f
    if weight is not None:
        g = dy_f * (weight.to(compute) + 1.0 if style == "gemma" else weight.to(compute))
    c1 = (g * x_hat).mean(dim=1, keepdim=True)
    dx = ((g - x_hat * c1) * rstd[:, None].to(compute)).to(x.dtype)
    dw = (dy_f * x_hat).sum(dim=0).to(weight.dtype) if weight is not None else x.new_empty((0,))
    y = rms_norm_output_ref(x, weight, rstd, style) if recompute_output else \
        x.new_empty((0,), dtype=output_dtype(style, x.dtype, weight))
    return dx, dw, y


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd (the ops themselves are declared at the end of the file)
# ---------------------------------------------------------------------------------------------


def _rms_norm_fwd_fake(x, weight, eps, style):
    return (x.new_empty(x.shape, dtype=output_dtype(style, x.dtype, weight)),
            x.new_empty((x.shape[0],), dtype=math_dtype(x)))


def _rms_norm_bwd_fake(dy, x, weight, rstd, style, recompute_output):
    dw = x.new_empty(weight.shape, dtype=weight.dtype) if weight is not None else x.new_empty((0,))
    y = x.new_empty(x.shape if recompute_output else (0,), dtype=output_dtype(style, x.dtype, weight))
    return x.new_empty(x.shape), dw, y


def _setup_context(ctx, inputs, output):
    x, weight, eps, style = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.eps, ctx.style = eps, style
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dy = rows_with_unit_stride(dy, x.shape[1])
    if _backend.backward_is_differentiated():
        # create_graph=True: the reference's formula, which a second backward can differentiate,
        # with rstd recomputed from x: the saved one is a constant to autograd.
        dx, dw, _ = rms_norm_bwd_ref(dy, x, weight, rms_norm_rstd_ref(x, ctx.eps), ctx.style, False)
    else:
        dx, dw, _ = rms_norm_bwd(dy, x, weight, rstd, ctx.style, False)
    return dx if ctx.needs_input_grad[0] else None, dw if weight is not None and ctx.needs_input_grad[1] else None, \
        None, None


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def check_style(style, weight):
    check_choice("style", style, STYLES)
    if weight is None and style != "torch":
        raise ValueError(f"weight is required for style {style!r} (its stock module always has one)")


def rms_norm(x, normalized_shape, weight=None, eps=None, style="torch"):
    """RMSNorm over the trailing `normalized_shape` dims of x, like torch.nn.functional.rms_norm.

    x: float32, float16 or bfloat16, any leading shape. weight: optional, of `normalized_shape`,
    float32 or x's dtype. eps: None means torch's default (float32's machine epsilon). style: whose
    rounding to match, "torch" (F.rms_norm), "llama" (LlamaRMSNorm and its kin), "gemma" (y · (1 + w))
    or "t5" (T5LayerNorm); see this module's docstring. Math in fp32; autograd saves x and one fp32
    rstd per row (4 bytes a row), never the output. A backward with create_graph=True runs the
    differentiable reference, so a double backward works.
    """
    check_float_tensor("x", x)
    normalized_shape, width = normalized_width(x, normalized_shape)
    check_optional_param("weight", weight, normalized_shape, "x", x)
    check_style(style, weight)
    eps = default_eps(x.dtype) if eps is None else eps
    check_eps(eps)
    rows = rows_with_unit_stride(x, width)
    flat_weight = weight.reshape(width).contiguous() if weight is not None else None
    y, _rstd = rms_norm_fwd(rows, flat_weight, float(eps), style)
    return y.view(x.shape)


# ---------------------------------------------------------------------------------------------
# The family: remat::rms_norm_fwd and remat::rms_norm_bwd, and what the tooling needs
# ---------------------------------------------------------------------------------------------


def _samples(device):
    """A width of 37 (no power of two, a masked tail), every style, with and without weight (style
    torch) and with a float32 weight on half input where the styles' output dtypes differ."""
    x, weight = torch.randn(5, 37, device=device), torch.randn(37, device=device)
    half = x.to(torch.bfloat16)
    forward, backward = [], []
    for inputs, style in [((x, None), "torch"), *(((x, weight), s) for s in STYLES), ((half, weight), "llama"),
                          ((half, weight.to(torch.bfloat16)), "t5")]:
        forward.append((*grad_leaves(*inputs), 1e-6, style))
        y, rstd = rms_norm_fwd_ref(*inputs, 1e-6, style)
        backward += [(torch.randn_like(y), *inputs, rstd, style, recompute)
                     for recompute in (False, True)]
    return OpSamples(forward, backward)


_WIDTH = 24  # the validation table's width: no power of two
FAMILY = OpFamily(
    name="rms_norm",
    forward_ref=rms_norm_fwd_ref,
    backward_ref=rms_norm_bwd_ref,
    forward_fake=_rms_norm_fwd_fake,
    backward_fake=_rms_norm_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="rms_norm",
    calls=(PublicCall("rms_norm", {"x": (2, 3, _WIDTH), "weight": (_WIDTH,)},
                      lambda t: rms_norm(t["x"], (_WIDTH,), t["weight"], 1e-6),
                      lambda t: F.rms_norm(t["x"], (_WIDTH,), t["weight"], 1e-6)),),
    triton="layer_norm",
    triton_launchers=("rms_norm_fwd", "rms_norm_bwd"),
    cuda=True,
)
rms_norm_fwd, rms_norm_bwd = FAMILY.forward, FAMILY.backward
