"""RMSNorm references in plain PyTorch, one per stock rounding ("style"); float64-capable.

Each style computes xhat = x * rstd, rstd = rsqrt(mean(x^2) + eps), in fp32 (float64 for float64
input) and scales it by the weight, but the stock modules round at different points:

  torch  torch.nn.RMSNorm / F.rms_norm: y = (xhat * w) cast to x's dtype.
  llama  transformers' LlamaRMSNorm (Mistral, Qwen2/3, Phi-3 ...): xhat cast to x's dtype, then
         w * that, in the promoted dtype of w and x (fp32 for an fp32 weight on bf16 input).
  gemma  GemmaRMSNorm (Gemma 1/2/3): y = (xhat * (1 + w)) cast to x's dtype, all in fp32.
  t5     T5LayerNorm: xhat cast to w's dtype when that is fp16/bf16, then w * that; y in w's dtype.

The forward here runs the stock module's own sequence of operations, so given the same rstd it
rounds bitwise as the module does (rms_norm_output_ref). The backward is the exact gradient in
the math dtype, taking the casts as the identity (as autograd does for the stock modules).
"""

import torch

STYLES = ("torch", "llama", "gemma", "t5")


def _math_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def default_eps(dtype):
    """The eps torch's rms_norm uses for eps=None: that of its computation dtype, float32 for every
    input dtype but float64 (not finfo(dtype).eps: bfloat16's would be 2**-7)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def rms_norm_rstd_ref(x, eps):
    """rstd (M,) of x (M, N), with the operations the stock modules use for it."""
    xf = x.to(_math_dtype(x))
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps).squeeze(-1)


def rms_norm_output_ref(x, weight, rstd, style):
    """y from x and its rstd, rounded as the stock module of `style` rounds it."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    math_dtype = _math_dtype(x)
    xhat = x.to(math_dtype) * rstd[:, None].to(math_dtype)
    if weight is None:
        if style != "torch":
            raise ValueError(f"weight is required for style {style!r} (its stock module always has one)")
        return xhat.to(x.dtype)
    if style == "torch":
        return (xhat * weight).to(x.dtype)
    if style == "llama":
        return weight * xhat.to(x.dtype)
    if style == "gemma":
        return (xhat * (1.0 + weight.to(math_dtype))).to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        xhat = xhat.to(weight.dtype)
    return weight * xhat


def rms_norm_fwd_ref(x, weight, eps, style):
    """(y, rstd) for x (M, N); rstd fp32 (float64 for float64 input); eps None as torch's."""
    rstd = rms_norm_rstd_ref(x, default_eps(x.dtype) if eps is None else eps)
    return rms_norm_output_ref(x, weight, rstd, style), rstd


def rms_norm_bwd_ref(dy, x, weight, rstd, style, recompute_output):
    """(dx, dw, y): dx in x's dtype, dw in weight's (empty without a weight), y when recompute_output.

    With xhat = x * rstd, g = dy * w' (w' = 1 + w for gemma, w otherwise):
    dx = rstd * (g - xhat * mean(g * xhat)),  dw = sum over rows of dy * xhat.
    """
    math_dtype = _math_dtype(x)
    xhat = x.to(math_dtype) * rstd[:, None].to(math_dtype)
    dy_f = dy.to(math_dtype)
    g = dy_f
    if weight is not None:
        scale = weight.to(math_dtype) + 1.0 if style == "gemma" else weight.to(math_dtype)
        g = dy_f * scale
    c1 = (g * xhat).mean(dim=1, keepdim=True)
    dx = ((g - xhat * c1) * rstd[:, None].to(math_dtype)).to(x.dtype)
    dw = (dy_f * xhat).sum(dim=0).to(weight.dtype) if weight is not None else x.new_empty((0,))
    y = rms_norm_output_ref(x, weight, rstd, style) if recompute_output else x.new_empty((0,))
    return dx, dw, y
