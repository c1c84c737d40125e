"""The fused layers where recomputation saves memory: LayerNorm → Linear, and [LayerNorm →] Linear → GELU → Linear.

A LayerNorm or GELU that recomputes on its own saves nothing, because the Linear after it
keeps its output for the weight gradient (dW = dyᵀ · input). Fused with that Linear, the
backward rebuilds the input of the Linear inside the kernel that computes the LayerNorm or GELU
gradient anyway, uses it for dW, and drops it:

    LayerNormLinear   keeps x, fp32 mean/rstd          rebuilds LN(x)            saves 2 bytes/elem of LN(x)
    MLP               keeps x and h = x·W1ᵀ            rebuilds gelu(h + b1)     saves gelu(h): 8·T·h bf16 at 4h
    LayerNormMLP      keeps x, mean/rstd and h         rebuilds both             saves both

With recompute=False the same functions keep the rebuilt tensors instead, as eager PyTorch
does, so tests and benchmarks can compare the two modes.
"""

import torch
import torch.nn.functional as F

from .._validate import (autocast_dtype, cast_for_autocast, check_eps, check_float_tensor, check_optional_param,
                         check_same_device, rows_with_unit_stride)
from .gelu import check_approximate, gelu_bwd, gelu_fwd
from .layer_norm import layer_norm_bwd, layer_norm_fwd


class _LayerNormLinear(torch.autograd.Function):
    """out = Linear(LayerNorm(x)) on rows x (M, K)."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, weight, bias, eps, recompute):
        normed, mean, rstd = layer_norm_fwd(x, norm_weight, norm_bias, eps)
        out = F.linear(normed, weight, bias)
        kept = () if recompute else (normed,)
        ctx.save_for_backward(x, norm_weight, norm_bias, weight, mean, rstd, *kept)
        ctx.recompute, ctx.has_bias = recompute, bias is not None
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, norm_weight, norm_bias, weight, mean, rstd, *kept = ctx.saved_tensors
        need_x, need_nw, need_nb, need_w, need_b = ctx.needs_input_grad[:5]
        d_normed = d_out.matmul(weight)
        dx, d_norm_weight, d_norm_bias, normed = layer_norm_bwd(
            d_normed, x, norm_weight, norm_bias, mean, rstd, ctx.recompute and need_w
        )
        if not ctx.recompute:
            normed = kept[0]
        d_weight = d_out.t().matmul(normed) if need_w else None
        d_bias = d_out.sum(0) if need_b and ctx.has_bias else None
        return (
            dx if need_x else None,
            d_norm_weight if need_nw and norm_weight is not None else None,
            d_norm_bias if need_nb and norm_bias is not None else None,
            d_weight, d_bias, None, None,
        )


class _MLP(torch.autograd.Function):
    """out = fc2(gelu(fc1(LayerNorm(x)))) on rows x (M, K); the LayerNorm is optional.

    fc1's bias is added inside the GELU kernel, so its gradient comes out of the same pass
    that computes dh, and h = x·W1ᵀ (without bias) is what is kept.
    """

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, has_norm, w1, b1, w2, b2, approximate, recompute):
        if has_norm:
            fc1_input, mean, rstd = layer_norm_fwd(x, norm_weight, norm_bias, eps)
        else:
            fc1_input, mean, rstd = x, None, None
        h = fc1_input.matmul(w1.t())
        activation = gelu_fwd(h, b1, approximate)
        out = F.linear(activation, w2, b2)
        kept = () if recompute else (fc1_input, activation)
        ctx.save_for_backward(x, norm_weight, norm_bias, mean, rstd, w1, b1, w2, h, *kept)
        ctx.has_norm, ctx.approximate, ctx.recompute = has_norm, approximate, recompute
        ctx.has_b2 = b2 is not None
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, norm_weight, norm_bias, mean, rstd, w1, b1, w2, h, *kept = ctx.saved_tensors
        need_x, need_nw, need_nb, _, _, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:9]
        need_fc1_input_grad = need_x or (ctx.has_norm and (need_nw or need_nb))
        recompute = ctx.recompute
        d_activation = d_out.matmul(w2)
        dh, d_b1, activation = gelu_bwd(d_activation, h, b1, ctx.approximate, recompute and need_w2)
        if not recompute:
            fc1_input, activation = kept
        d_w2 = d_out.t().matmul(activation) if need_w2 else None
        d_b2 = d_out.sum(0) if need_b2 and ctx.has_b2 else None
        activation = d_activation = None  # the rebuilt gelu(h) lives only for dW2
        d_fc1_input = dh.matmul(w1) if need_fc1_input_grad else None
        dx = d_norm_weight = d_norm_bias = None
        if ctx.has_norm:
            if d_fc1_input is None:  # only dW1 is wanted, but LayerNorm(x) must still be rebuilt
                d_fc1_input = torch.zeros_like(x)
            dx, d_norm_weight, d_norm_bias, normed = layer_norm_bwd(
                d_fc1_input, x, norm_weight, norm_bias, mean, rstd, recompute and need_w1
            )
            if recompute:
                fc1_input = normed
        else:
            dx, fc1_input = d_fc1_input, x
        d_w1 = dh.t().matmul(fc1_input) if need_w1 else None
        return (
            dx if need_x else None,
            d_norm_weight if need_nw and norm_weight is not None else None,
            d_norm_bias if need_nb and norm_bias is not None else None,
            None, None,
            d_w1,
            d_b1 if need_b1 and b1 is not None else None,
            d_w2, d_b2, None, None,
        )



# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def _check_linear(weight_name, weight, bias_name, bias, in_features, x):
    check_float_tensor(weight_name, weight)
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(
            f"{weight_name} must have shape (out_features, {in_features}), got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"{weight_name} has dtype {weight.dtype} but x has {x.dtype}; they must match")
    check_same_device(weight_name, weight, "x", x)
    check_optional_param(bias_name, bias, (weight.shape[0],), "x", x)
    if bias is not None and bias.dtype != weight.dtype:
        # As torch.nn.functional.linear, which would fail later with a message naming neither.
        raise TypeError(f"{bias_name} has dtype {bias.dtype} but {weight_name} has {weight.dtype}; they must match")


def _check_norm_params(norm_weight, norm_bias, width, x, eps):
    check_optional_param("norm_weight", norm_weight, (width,), "x", x)
    check_optional_param("norm_bias", norm_bias, (width,), "x", x)
    check_eps(eps)


def _contiguous(*params):
    """Parameters as the kernels take them: the CUDA extension refuses a strided weight or bias,
    and autograd carries the gradient back through the copy to the caller's view."""
    return tuple(p.contiguous() if p is not None else None for p in params)


def _rows(x):
    check_float_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., in_features)")
    return rows_with_unit_stride(x, x.shape[-1])


def _under_autocast(fn, x, *tensors, **kwargs):
    """Under autocast, run `fn` on inputs cast to the autocast dtype with autocast off inside.

    The Linears would autocast anyway; casting up front keeps every tensor of the fused layer in
    one dtype, so the outputs have the dtypes PyTorch's own layers give under autocast.
    """
    dtype = autocast_dtype(x.device.type)
    with torch.autocast(x.device.type, enabled=False):
        return fn(*cast_for_autocast(dtype, x, *tensors), **kwargs)


def layer_norm_linear(x, norm_weight, norm_bias, weight, bias=None, eps=1e-5, recompute=True):
    """Linear(LayerNorm(x)): autograd keeps x and fp32 mean/rstd, and rebuilds LayerNorm(x) for dW."""
    check_float_tensor("x", x)
    if autocast_dtype(x.device.type) is not None:
        return _under_autocast(layer_norm_linear, x, norm_weight, norm_bias, weight, bias, eps=eps, recompute=recompute)
    rows = _rows(x)
    _check_norm_params(norm_weight, norm_bias, x.shape[-1], x, eps)
    _check_linear("weight", weight, "bias", bias, x.shape[-1], x)
    norm_weight, norm_bias = _contiguous(norm_weight, norm_bias)
    out = _LayerNormLinear.apply(rows, norm_weight, norm_bias, weight, bias, float(eps), bool(recompute))
    return out.view(*x.shape[:-1], weight.shape[0])


def mlp(x, w1, b1, w2, b2=None, approximate="none", recompute=True,
        norm_weight=None, norm_bias=None, eps=1e-5, layer_norm=False):
    """fc2(gelu(fc1(x))), with LayerNorm(x) in front when layer_norm=True.

    Autograd keeps x, the fc1 output h (and fp32 mean/rstd with the LayerNorm), and rebuilds
    gelu(h) (and LayerNorm(x)) in the backward.
    """
    check_float_tensor("x", x)
    if autocast_dtype(x.device.type) is not None:
        return _under_autocast(mlp, x, w1, b1, w2, b2, approximate=approximate, recompute=recompute,
                               norm_weight=norm_weight, norm_bias=norm_bias, eps=eps, layer_norm=layer_norm)
    rows = _rows(x)
    check_approximate(approximate)
    if layer_norm:
        _check_norm_params(norm_weight, norm_bias, x.shape[-1], x, eps)
    elif norm_weight is not None or norm_bias is not None:
        raise ValueError("norm_weight and norm_bias need layer_norm=True")
    _check_linear("w1", w1, "b1", b1, x.shape[-1], x)
    _check_linear("w2", w2, "b2", b2, w1.shape[0], x)
    norm_weight, norm_bias, b1 = _contiguous(norm_weight, norm_bias, b1)
    out = _MLP.apply(rows, norm_weight, norm_bias, float(eps), bool(layer_norm),
                     w1, b1, w2, b2, approximate, bool(recompute))
    return out.view(*x.shape[:-1], w2.shape[0])
