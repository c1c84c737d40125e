"""The LoRA plumbing of the fused ops (remat.ops.fused): a Linear's peft LoRA adapters computed inside a fused
op, in peft's order and dtypes, each keeping its rank-r intermediate A(x) only; their flat form for an
autograd Function's arguments; their argument check and autocast."""

import torch.nn.functional as F

from .._validate import cast_for_autocast, check_float_tensor, check_same_device
from ..specs import LoRA

# A LoRA adapter on a Linear (remat.specs.LoRA): out += F.linear(F.linear(x, a), b, b_bias) * scale, x
# cast to a's dtype first (peft's order). a: (rank, in_features), b: (out_features, rank), b_bias:
# (out_features,) or None. A Linear (remat.specs.Linear): F.linear(x, weight, bias) plus its adapters.
_PER_ADAPTER = 3  # tensors per adapter in the flat argument lists of the autograd functions


def _flatten(adapters):
    """(flat tensors a0, b0, b_bias0, a1, ..., scales) for an autograd function's arguments."""
    if not adapters:  # a Linear without adapters, at every fused call
        return (), ()
    return [t for lora in adapters for t in (lora.a, lora.b, lora.b_bias)], tuple(float(a.scale) for a in adapters)


def _unflatten(tensors, scales):
    return [LoRA(*tensors[i * _PER_ADAPTER:(i + 1) * _PER_ADAPTER], scale) for i, scale in enumerate(scales)]


def _adapter_needs(needs, count):
    """[(needs a's grad, needs b's grad, needs b_bias's grad)] per adapter, from a needs_input_grad slice."""
    return [tuple(needs[i * _PER_ADAPTER:(i + 1) * _PER_ADAPTER]) for i in range(count)]


def _add_adapters(out, inp, adapters):
    """out + Σ F.linear(F.linear(inp, a), b, b_bias) * scale in peft's order and dtypes; also
    [A(inp)] per adapter. The sum is cast back to out's dtype once, at the end, as peft does."""
    dtype, intermediates = out.dtype, []
    for lora in adapters:
        inp = inp.to(lora.a.dtype)
        t = F.linear(inp, lora.a)
        out = out + F.linear(t, lora.b, lora.b_bias) * lora.scale
        intermediates.append(t)
    # No cast when none is needed: under torch 2.11's torch.compile, an autograd.Function whose output
    # is a no-op .to() of one of its own intermediates is handed zeros as that output's gradient.
    return (out if out.dtype == dtype else out.to(dtype)), intermediates


def _adapter_grads(d_out, adapters, intermediates, needs, need_input_grad):
    """Gradients of the adapters' terms: ([(da, db, d_b_bias)], [d_t]) where d_t = dL/dA(inp) is
    returned for the adapters whose a (or the input) needs a gradient. The input's own gradient
    part, Σ d_t·a, is added by the caller."""
    grads, d_ts = [], []
    for lora, t, (need_a, need_b, need_bb) in zip(adapters, intermediates, needs, strict=True):
        scaled = d_out.to(lora.b.dtype) * lora.scale  # the gradient reaching F.linear(t, b, b_bias)
        db = scaled.t().matmul(t) if need_b else None
        d_bb = scaled.sum(0) if need_bb and lora.b_bias is not None else None
        d_t = scaled.matmul(lora.b) if need_a or need_input_grad else None
        grads.append([None, db, d_bb])
        d_ts.append(d_t)
    return grads, d_ts


def _input_grad_from_adapters(d_inp, adapters, d_ts):
    """d_inp + Σ d_t·a (each cast to d_inp's dtype, as autograd casts through peft's .to())."""
    for lora, d_t in zip(adapters, d_ts, strict=True):
        d_inp = d_inp + d_t.matmul(lora.a).to(d_inp.dtype)
    return d_inp


def _finish_adapter_grads(grads, adapters, d_ts, inp, needs):
    """Fill in da = d_tᵀ·inp (inp the Linear's input, rebuilt) for the adapters that need it; flat list."""
    flat = []
    for g, lora, d_t, (need_a, _, _) in zip(grads, adapters, d_ts, needs, strict=True):
        if need_a:
            g[0] = d_t.t().matmul(inp.to(lora.a.dtype))
        flat.extend(g)
    return flat


def _check_adapters(name, adapters, weight, x):
    """Each adapter of the Linear whose weight as (out, in) is `weight`: a LoRA of matching shapes on x's device, its
    a, b and b_bias in one floating dtype (peft may keep adapters in float32 beside half weights)."""
    if not isinstance(adapters, (tuple, list)) or not all(isinstance(a, LoRA) for a in adapters):
        raise TypeError(f"{name} must be a tuple of remat.specs.LoRA(a, b, b_bias, scale), got {adapters!r}")
    out_features, in_features = weight.shape
    for i, lora in enumerate(adapters):
        label = f"{name}[{i}]"
        check_float_tensor(f"{label}.a", lora.a)
        check_float_tensor(f"{label}.b", lora.b)
        if lora.a.dim() != 2 or lora.a.shape[1] != in_features:
            raise ValueError(f"{label}.a must have shape (rank, {in_features}), got {tuple(lora.a.shape)}")
        if tuple(lora.b.shape) != (out_features, lora.a.shape[0]):
            raise ValueError(f"{label}.b must have shape ({out_features}, {lora.a.shape[0]}), "
                             f"got {tuple(lora.b.shape)}")
        for part in ("a", "b", "b_bias"):
            tensor = getattr(lora, part)
            if tensor is None:
                continue
            check_same_device(f"{label}.{part}", tensor, "x", x)
            if tensor.dtype != lora.a.dtype:
                raise TypeError(f"{label}.{part} has dtype {tensor.dtype} but {label}.a has {lora.a.dtype}; "
                                "they must match")
        if lora.b_bias is not None and tuple(lora.b_bias.shape) != (out_features,):
            raise ValueError(f"{label}.b_bias must have shape ({out_features},), got {tuple(lora.b_bias.shape)}")
        if isinstance(lora.scale, bool) or not isinstance(lora.scale, (int, float)):
            raise TypeError(f"{label}.scale must be a number, got {lora.scale!r}")


def _cast_adapters(dtype, adapters):
    """Under autocast the adapters' Linears autocast too (peft's lora_A, lora_B are nn.Linear)."""
    if not isinstance(adapters, (tuple, list)):
        return adapters  # refused by name in _check_adapters
    return tuple(LoRA(*cast_for_autocast(dtype, a.a, a.b, a.b_bias), a.scale) if isinstance(a, LoRA) else a
                 for a in adapters)
