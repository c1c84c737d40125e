"""The fused layers where recomputation saves memory: LayerNorm → Linear, and [LayerNorm →] Linear → GELU → Linear.

A LayerNorm or GELU that recomputes on its own saves nothing, because the Linear after it
keeps its output for the weight gradient (dW = dyᵀ · input). Fused with that Linear, the
backward rebuilds the input of the Linear inside the kernel that computes the LayerNorm or GELU
gradient anyway, uses it for dW, and drops it:

    LayerNormLinear   keeps x, fp32 mean/rstd          rebuilds LN(x)            saves 2 bytes/elem of LN(x)
    MLP               keeps x and h = x·W1ᵀ            rebuilds gelu(h + b1)     saves gelu(h): 8·T·h bf16 at 4h
    LayerNormMLP      keeps x, mean/rstd and h         rebuilds both             saves both

Each Linear may carry LoRA adapters (peft's vanilla LoRA: y = x·Wᵀ + b + Σ scale·B(A(x))), computed
inside the fused op in peft's order and dtypes. An adapter keeps only its rank-r intermediate
A(x), for B's gradient; A's gradient needs the Linear's input, which is rebuilt like the rest.

What is kept follows the gradients that are actually required (ctx.needs_input_grad), as eager
PyTorch does: a frozen weight needs no rebuilt input, a layer whose input needs no gradient keeps
nothing for dx. With recompute=False the same functions keep the rebuilt tensors instead, as
eager PyTorch does, so tests and benchmarks can compare the two modes.
"""

import collections

import torch
import torch.nn.functional as F

from .. import _backend
from .._validate import (
    autocast_dtype,
    cast_for_autocast,
    check_eps,
    check_float_tensor,
    check_optional_param,
    check_same_device,
    rows_with_unit_stride,
)
from ..specs import GELU_APPROXIMATE, Activation, Linear, LoRA, Norm, check_activation, check_norm, gelu
from ._checked import Checked
from ._family import eager_backward_device, eager_device
from ._fused_layout import (
    _flat_linears,
    _kept_intermediates,
    _mlp_needs,
    _norm_linears_needs,
    _unpack_linears,
)
from ._lora import (
    _PER_ADAPTER,
    _adapter_grads,
    _add_adapters,
    _cast_adapters,
    _check_adapters,
    _finish_adapter_grads,
    _input_grad_from_adapters,
)
from ._shared_statistics import SharedStatistics, exchange, sharing
from .gated import FAMILY as GATED
from .gelu import FAMILY as GELU
from .gelu import check_approximate
from .layer_norm import FAMILY as LAYER_NORM
from .rms_norm import FAMILY as RMS_NORM
from .rms_norm import check_style, default_eps

__all__ = ["Activation", "Checked", "Linear", "LoRA", "Norm", "SharedStatistics", "layer_norm_linear", "mlp",
           "norm_linears", "fused_mlp"]

# What the fused ops compute of a remat.specs.Norm besides its tensors.
_NormLayout = collections.namedtuple("_NormLayout", "kind eps style")


def norm_layout(norm):
    return _NormLayout(norm.kind, float(norm.eps), norm.style)


def norm_forward(layout, x, weight, bias, device=None):
    """(norm(x), its fp32 row statistics: (mean, rstd) for a LayerNorm, (rstd,) for an RMSNorm). device: the
    fused call's (remat.ops._family.eager_device), where its op calls run their implementations directly."""
    if layout.kind == "rms_norm":
        # Llama's and T5's styles give a float32 weight's dtype: the Linears read x's, as autocast casts it
        y, rstd = RMS_NORM.run(0, device, x, weight, layout.eps, layout.style)
        return y.to(x.dtype), (rstd,)
    y, mean, rstd = LAYER_NORM.run(0, device, x, weight, bias, layout.eps)
    return y, (mean, rstd)


def norm_backward(layout, dy, x, weight, bias, stats, rebuild, device=None):
    """(dx, d weight, d bias, norm(x) rebuilt when `rebuild`, else None) from x and its statistics."""
    if layout.kind == "rms_norm":
        dx, d_weight, rebuilt = RMS_NORM.run(1, device, dy, x, weight, *stats, layout.style, rebuild)
        return dx, d_weight, None, rebuilt.to(x.dtype) if rebuild else None
    dx, d_weight, d_bias, rebuilt = LAYER_NORM.run(1, device, dy, x, weight, bias, *stats, rebuild)
    return dx, d_weight, d_bias, rebuilt if rebuild else None


def _project(x, linear):
    """F.linear(x, weight, bias) of rows x without the adapters, for either layout of the weight: one stored
    (in, out) (transposed) as transformers' Conv1D computes it, addmm(bias, x, weight), with no transposed
    view of the parameter (whose op and backward node a converted GPT-2 would pay at every fused call)."""
    if not linear.transposed:
        return F.linear(x, linear.weight, linear.bias)
    return x.matmul(linear.weight) if linear.bias is None else torch.addmm(linear.bias, x, linear.weight)


def _out_in(linear):
    """The weight as an (out, in) matrix (a view for a transposed one): d_out·it is the input's gradient."""
    return linear.weight.t() if linear.transposed else linear.weight


def _out_features(linear):
    return linear.weight.shape[1] if linear.transposed else linear.weight.shape[0]


def _weight_grad(d_out, inp, linear):
    """d_outᵀ·inp, the gradient of the Linear's weight, laid out as its weight is: one stored (in, out)
    (transposed) gets inpᵀ·d_out, and so, transposed back, does a transposed view of an (in, out)
    parameter passed as (out, in), so that autograd hands the parameter a contiguous gradient instead
    of copying a transposed one into its layout."""
    weight = linear.weight
    if linear.transposed:
        return inp.t().matmul(d_out)
    if weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) != 1:
        return inp.t().matmul(d_out).t()
    return d_out.t().matmul(inp)


def _kept(keep, *tensors):
    """The tensors when `keep`, else Nones of the same count (save_for_backward takes None)."""
    return tensors if keep else (None,) * len(tensors)


class _LayerNormLinears(torch.autograd.Function):
    """outs[i] = Linear_i(LayerNorm(x)) [+ its LoRA adapters] on rows x (M, K), for one or more Linears
    reading the same LayerNorm (ViT's q, k, v): LayerNorm(x) is computed once, and x with one fp32
    mean/rstd pair kept once, whatever the number of Linears.

    tensors: per Linear, its weight, bias and flat adapters; layout: their _LinearsLayout.
    """

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, norm_layout, recompute, layout, slot, *tensors):
        _backend.remember_backend(ctx)
        linears = _unpack_linears(tensors, layout)
        needs, need_norm_grad, need_normed = _norm_linears_needs(ctx.needs_input_grad, layout)
        # Rebuilding LN(x) pays only where x is kept anyway, for the LayerNorm's own backward;
        # otherwise LN(x) is kept as eager keeps it (it is smaller than x and its statistics).
        rebuild = recompute and need_norm_grad
        ctx.eager_device = device = eager_device((x, norm_weight, norm_bias, *tensors))  # its op calls', decided once
        normed, stats = norm_forward(norm_layout, x, norm_weight, norm_bias, device)
        stats = exchange(slot, stats)
        outs, intermediates = [], []
        for linear in linears:
            out, ts = _add_adapters(_project(normed, linear), normed, linear.adapters)
            outs.append(out)
            intermediates.extend(ts)
        kept = _kept_intermediates(intermediates, needs)
        ctx.save_for_backward(*_kept(need_norm_grad or (need_normed and rebuild), x, *stats),
                              *_kept(need_normed and not rebuild, normed), norm_weight, norm_bias, *tensors, *kept)
        ctx.norm_layout, ctx.statistics, ctx.layout, ctx.needs = norm_layout, len(stats), layout, needs
        ctx.need_norm_grad, ctx.need_normed = need_norm_grad, need_normed
        return tuple(outs)

    @staticmethod
    @_backend.on_forward_backend
    def backward(ctx, *d_outs):
        x, *rest = ctx.saved_tensors
        stats, (normed, norm_weight, norm_bias, *rest) = rest[:ctx.statistics], rest[ctx.statistics:]
        if not any(ctx.layout.scales):
            return _plain_norm_linears_backward(ctx, d_outs, x, stats, normed, norm_weight, norm_bias, rest)
        count = sum(2 + _PER_ADAPTER * len(scales) for scales in ctx.layout.scales)
        linears = _unpack_linears(rest[:count], ctx.layout)
        intermediates = iter(rest[count:])
        grads, d_normed = [], None
        for linear, need, d_out in zip(linears, ctx.needs, d_outs, strict=True):
            ts = [next(intermediates) for _ in linear.adapters]
            adapter_grads, d_ts = _adapter_grads(d_out, linear.adapters, ts, need.adapters, ctx.need_norm_grad)
            if ctx.need_norm_grad:
                part = _input_grad_from_adapters(d_out.matmul(_out_in(linear)), linear.adapters, d_ts)
                d_normed = part if d_normed is None else d_normed + part
            grads.append((d_out, adapter_grads, d_ts))
        dx, d_norm_weight, d_norm_bias, normed = _normed_backward(ctx, d_normed, x, norm_weight, norm_bias, stats,
                                                                  normed)
        flat = []
        for linear, need, (d_out, adapter_grads, d_ts) in zip(linears, ctx.needs, grads):
            flat.append(_weight_grad(d_out, normed, linear) if need.weight else None)
            flat.append(d_out.sum(0) if need.bias and linear.bias is not None else None)
            flat.extend(_finish_adapter_grads(adapter_grads, linear.adapters, d_ts, normed, need.adapters))
        need_x, need_nw, need_nb = ctx.needs_input_grad[:3]
        return (
            dx if need_x else None,
            d_norm_weight if need_nw and norm_weight is not None else None,
            d_norm_bias if need_nb and norm_bias is not None else None,
            None, None, None, None, *flat,
        )


def _normed_backward(ctx, d_normed, x, norm_weight, norm_bias, stats, normed):
    """(dx, d norm weight, d norm bias, norm(x)) of _LayerNormLinears' backward, from the gradient that reached
    norm(x), norm(x) rebuilt in the norm's pass where it was not kept; Nones and the kept norm(x) where the
    norm's backward does not run."""
    if not ctx.need_norm_grad:
        return None, None, None, normed
    rebuild = ctx.need_normed and normed is None
    device = eager_backward_device(ctx.eager_device, d_normed)
    dx, d_norm_weight, d_norm_bias, rebuilt = norm_backward(ctx.norm_layout, d_normed, x, norm_weight, norm_bias,
                                                            stats, rebuild, device)
    return dx, d_norm_weight, d_norm_bias, rebuilt if rebuild else normed


def _plain_norm_linears_backward(ctx, d_outs, x, stats, normed, norm_weight, norm_bias, tensors):
    """_LayerNormLinears.backward where no Linear carries adapters (every call of a converted model without
    LoRA): the same gradients, in straight-line code. The general path's adapter bookkeeping (empty loops,
    comprehensions, lists of Nones) costs a converted layer's backward its host time at every step
    (docs/overhead.md). tensors: per Linear, its weight and bias."""
    linears = _unpack_linears(tensors, ctx.layout)
    d_normed = None
    if ctx.need_norm_grad:
        for linear, d_out in zip(linears, d_outs):
            part = d_out.matmul(_out_in(linear))
            d_normed = part if d_normed is None else d_normed + part
    dx, d_norm_weight, d_norm_bias, normed = _normed_backward(ctx, d_normed, x, norm_weight, norm_bias, stats, normed)
    grads = ()
    for linear, need, d_out in zip(linears, ctx.needs, d_outs):
        grads += (_weight_grad(d_out, normed, linear) if need.weight else None,
                  d_out.sum(0) if need.bias and linear.bias is not None else None)
    need_x, need_nw, need_nb = ctx.needs_input_grad[:3]
    return (dx if need_x else None, d_norm_weight if need_nw and norm_weight is not None else None,
            d_norm_bias if need_nb and norm_bias is not None else None, None, None, None, None, *grads)


# What _MLP computes besides its tensors: the norm in front (a _NormLayout, or None), the Activation,
# the recompute switch, and the _LinearsLayout of its Linears (the up projections, then the down projection).
_MLPLayout = collections.namedtuple("_MLPLayout", "norm act recompute linears")


def _bias_in_kernel(act, ups):
    """The up projection's bias when the GELU kernel adds it (one up projection without adapters): its
    gradient then comes out of the pass that computes dh, and h = x·W1ᵀ without bias is what is kept."""
    return ups[0].bias if not act.gated and not ups[0].adapters else None


def _gate_and_up(hs):
    """(gate, up) from the up projections' outputs: [gate, up], or [gate ∥ up], one tensor whose
    halves are read in place (a fused gate_up projection, gate first)."""
    if len(hs) == 2:
        return hs
    width = hs[0].shape[1] // 2
    return hs[0][:, :width], hs[0][:, width:]


def _activation_forward(act, hs, bias, device):
    """act over the up projections' outputs hs: gelu(h + bias) of [h], or act(gate) * up."""
    if act.gated:
        return GATED.run(0, device, *_gate_and_up(hs), act.name, True)
    return GELU.run(0, device, hs[0], bias, GELU_APPROXIMATE[act.name])


def _activation_backward(act, d_activation, hs, bias, rebuild, device):
    """([d h] per up projection output, d bias (None without it), the rebuilt activation or None).
    device: the fused backward's eager_backward_device."""
    if act.gated:
        d_gate_up, rebuilt = GATED.run(1, device, d_activation, *_gate_and_up(hs), act.name, rebuild, True)
        width = d_gate_up.shape[1] // 2
        d_hs = [d_gate_up[:, :width], d_gate_up[:, width:]] if len(hs) == 2 else [d_gate_up]
        return d_hs, None, rebuilt if rebuild else None
    dh, d_bias, rebuilt = GELU.run(1, device, d_activation, hs[0], bias, GELU_APPROXIMATE[act.name], rebuild)
    return [dh], d_bias if bias is not None else None, rebuilt if rebuild else None


class _MLP(torch.autograd.Function):
    """out = down(act(up(norm(x)))) on rows x (M, K); the norm is optional, and each Linear may carry
    LoRA adapters. tensors: per Linear (the up projection, then the down one) its weight, bias and flat
    adapters.

    Without adapters on the up projection, its bias is added inside the GELU kernel (_bias_in_kernel).
    With adapters, h = fc1(x) + its adapters' terms, bias included in peft's order, and dh sums to db1.
    """

    @staticmethod
    def forward(ctx, layout, x, norm_weight, norm_bias, slot, *tensors):
        _backend.remember_backend(ctx)
        linears = _unpack_linears(tensors, layout.linears)
        ups, down = linears[:-1], linears[-1]
        has_norm = layout.norm is not None
        needs, need_norm_grad, need_up_input, need_dh, need_activation = _mlp_needs(ctx.needs_input_grad, has_norm,
                                                                                    layout.linears)
        ctx.eager_device = device = eager_device((x, norm_weight, norm_bias, *tensors))  # its op calls', decided once
        if has_norm:
            up_input, stats = norm_forward(layout.norm, x, norm_weight, norm_bias, device)
            stats = exchange(slot, stats)
        else:
            up_input, stats = x, ()
        kernel_bias = _bias_in_kernel(layout.act, ups)
        hs, intermediates = [], []
        for up in ups:
            if kernel_bias is not None:
                h, ts = up_input.matmul(up.weight if up.transposed else up.weight.t()), []
            else:
                h, ts = _add_adapters(_project(up_input, up), up_input, up.adapters)
            hs.append(h)
            intermediates += ts
        activation = _activation_forward(layout.act, hs, kernel_bias, device)
        out, ts = _add_adapters(_project(activation, down), activation, down.adapters)
        intermediates += ts
        # As for the norm: rebuilding pays only where the backward runs that pass anyway (the norm's
        # for norm(x), the activation's for act(h)); else the tensor is kept, as eager does.
        rebuild_up_input = layout.recompute and need_norm_grad
        rebuild_activation = layout.recompute and need_dh
        keep_x = need_norm_grad or (need_up_input and not has_norm)
        keep_up_input = has_norm and need_up_input and not rebuild_up_input
        kept = _kept_intermediates(intermediates, needs)
        ctx.save_for_backward(
            *_kept(keep_x, x), *_kept(keep_x and has_norm, *stats), *_kept(keep_up_input, up_input),
            *_kept(need_dh, *hs), *_kept(need_activation and not rebuild_activation, activation),
            norm_weight, norm_bias, *tensors, *kept)
        ctx.layout, ctx.needs, ctx.statistics, ctx.tensors = layout, needs, len(stats), len(tensors)
        ctx.need_norm_grad, ctx.need_up_input, ctx.need_dh = need_norm_grad, need_up_input, need_dh
        ctx.need_activation = need_activation
        return out

    @staticmethod
    @_backend.on_forward_backend
    def backward(ctx, d_out):
        layout, needs = ctx.layout, ctx.needs
        # its op calls' device, asked once: the gradients they take are computed from d_out and the forward's tensors
        device = eager_backward_device(ctx.eager_device, d_out)
        if not any(layout.linears.scales):
            return _plain_mlp_backward(ctx, d_out, device)
        saved = iter(ctx.saved_tensors)
        x = next(saved)
        stats = tuple(next(saved) for _ in range(ctx.statistics))
        up_input = next(saved)
        hs = [next(saved) for _ in layout.linears.scales[:-1]]
        activation, norm_weight, norm_bias = next(saved), next(saved), next(saved)
        linears = _unpack_linears([next(saved) for _ in range(ctx.tensors)], layout.linears)
        intermediates = [[next(saved) for _ in linear.adapters] for linear in linears]
        ups, down, up_needs, down_needs = linears[:-1], linears[-1], needs[:-1], needs[-1]
        need_x = ctx.needs_input_grad[1]
        kernel_bias = _bias_in_kernel(layout.act, ups)

        # The down projection and its adapters; act(h) is rebuilt in the activation backward's pass
        # when dW2 or the down projection's dA needs it
        down_grads, down_d_ts = _adapter_grads(d_out, down.adapters, intermediates[-1], down_needs.adapters,
                                               ctx.need_dh)
        d_hs, d_kernel_bias = [None] * len(ups), None
        rebuild_activation = ctx.need_activation and activation is None
        if ctx.need_dh:
            d_activation = _input_grad_from_adapters(d_out.matmul(_out_in(down)), down.adapters, down_d_ts)
            d_hs, d_kernel_bias, rebuilt = _activation_backward(layout.act, d_activation, hs, kernel_bias,
                                                                rebuild_activation, device)
            activation = rebuilt if rebuild_activation else activation
            d_activation = None
        flat_down = [_weight_grad(d_out, activation, down) if down_needs.weight else None,
                     d_out.sum(0) if down_needs.bias and down.bias is not None else None,
                     *_finish_adapter_grads(down_grads, down.adapters, down_d_ts, activation, down_needs.adapters)]
        activation = None  # the rebuilt act(h) lives only for dW2 and the down projection's dA

        # The up projections and their adapters, then the norm; norm(x) is rebuilt in its backward's pass
        need_d_up_input = need_x or ctx.need_norm_grad
        flat_ups = [None] * sum(2 + _PER_ADAPTER * len(up.adapters) for up in ups)
        dx = d_norm_weight = d_norm_bias = None
        if ctx.need_dh:
            d_up_input, pending = None, []
            for up, need, dh, ts in zip(ups, up_needs, d_hs, intermediates):
                grads, d_ts = _adapter_grads(dh, up.adapters, ts, need.adapters, need_d_up_input)
                if need_d_up_input:
                    part = _input_grad_from_adapters(dh.matmul(_out_in(up)), up.adapters, d_ts)
                    d_up_input = part if d_up_input is None else d_up_input + part
                pending.append((grads, d_ts))
            dx, d_norm_weight, d_norm_bias, up_input = _up_input_backward(ctx, d_up_input, x, norm_weight, norm_bias,
                                                                          stats, up_input, device)
            flat_ups = []
            for up, need, dh, (grads, d_ts) in zip(ups, up_needs, d_hs, pending):
                d_bias = d_kernel_bias if kernel_bias is not None else dh.sum(0) if up.bias is not None else None
                flat_ups += [_weight_grad(dh, up_input, up) if need.weight else None,
                             d_bias if need.bias else None,
                             *_finish_adapter_grads(grads, up.adapters, d_ts, up_input, need.adapters)]
        need_nw, need_nb = ctx.needs_input_grad[2:4]
        return (
            None,  # the layout
            dx if need_x else None,
            d_norm_weight if need_nw and norm_weight is not None else None,
            d_norm_bias if need_nb and norm_bias is not None else None,
            None,  # the statistics slot
            *flat_ups, *flat_down,
        )


def _up_input_backward(ctx, d_up_input, x, norm_weight, norm_bias, stats, up_input, device):
    """(dx, d norm weight, d norm bias, the up projections' input) of _MLP's backward, from the gradient that
    reached that input: through the norm, norm(x) rebuilt in its pass where it was not kept; x itself
    without a norm. device: the backward's eager_backward_device."""
    norm = ctx.layout.norm
    if norm is None:
        return d_up_input, None, None, x
    if not ctx.need_norm_grad:
        return None, None, None, up_input
    rebuild = ctx.need_up_input and up_input is None
    dx, d_norm_weight, d_norm_bias, rebuilt = norm_backward(norm, d_up_input, x, norm_weight, norm_bias, stats,
                                                            rebuild, device)
    return dx, d_norm_weight, d_norm_bias, rebuilt if rebuild else up_input


def _plain_mlp_backward(ctx, d_out, device):
    """_MLP.backward where no Linear carries adapters (every call of a converted model without LoRA): the
    same gradients, in the same order (the rebuilt act(h) dropped before the up projections' pass), in
    straight-line code, for the reason _plain_norm_linears_backward gives."""
    layout, needs = ctx.layout, ctx.needs
    count = len(needs) - 1  # up projections
    x, *saved = ctx.saved_tensors
    stats, (up_input, *saved) = saved[:ctx.statistics], saved[ctx.statistics:]
    hs, (activation, norm_weight, norm_bias, *tensors) = saved[:count], saved[count:]
    *ups, down = _unpack_linears(tensors, layout.linears)
    kernel_bias = _bias_in_kernel(layout.act, ups)
    d_hs = d_kernel_bias = None
    if ctx.need_dh:
        rebuild = ctx.need_activation and activation is None
        d_hs, d_kernel_bias, rebuilt = _activation_backward(layout.act, d_out.matmul(_out_in(down)), hs, kernel_bias,
                                                            rebuild, device)
        activation = rebuilt if rebuild else activation
    grads_down = (_weight_grad(d_out, activation, down) if needs[-1].weight else None,
                  d_out.sum(0) if needs[-1].bias and down.bias is not None else None)
    activation = None  # the rebuilt act(h) lives only for dW2
    need_x, need_nw, need_nb = ctx.needs_input_grad[1:4]
    dx = d_norm_weight = d_norm_bias = None
    grads_up = (None, None) * count
    if d_hs is not None:
        d_up_input = None
        if need_x or ctx.need_norm_grad:
            for up, dh in zip(ups, d_hs):
                part = dh.matmul(_out_in(up))
                d_up_input = part if d_up_input is None else d_up_input + part
        dx, d_norm_weight, d_norm_bias, up_input = _up_input_backward(ctx, d_up_input, x, norm_weight, norm_bias,
                                                                      stats, up_input, device)
        grads_up = ()
        for up, need, dh in zip(ups, needs, d_hs):
            d_bias = d_kernel_bias if kernel_bias is not None else dh.sum(0) if up.bias is not None else None
            grads_up += (_weight_grad(dh, up_input, up) if need.weight else None, d_bias if need.bias else None)
    return (None, dx if need_x else None, d_norm_weight if need_nw and norm_weight is not None else None,
            d_norm_bias if need_nb and norm_bias is not None else None, None, *grads_up, *grads_down)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def _check_linear(weight_name, linear, bias_name, in_features, x):
    weight, bias = linear.weight, linear.bias
    check_float_tensor(weight_name, weight)
    if not isinstance(linear.transposed, bool):
        raise TypeError(f"the transposed of the Linear of {weight_name} must be True or False, "
                        f"got {linear.transposed!r}")
    if weight.dim() != 2 or weight.shape[0 if linear.transposed else 1] != in_features:
        expected = f"({in_features}, out_features) (transposed)" if linear.transposed else \
            f"(out_features, {in_features})"
        raise ValueError(f"{weight_name} must have shape {expected}, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{weight_name} has dtype {weight.dtype} but x has {x.dtype}; they must match")
    check_same_device(weight_name, weight, "x", x)
    check_optional_param(bias_name, bias, (_out_features(linear),), "x", x)
    if bias is not None and bias.dtype != weight.dtype:
        # As torch.nn.functional.linear, which would fail later with a message naming neither.
        raise TypeError(f"{bias_name} has dtype {bias.dtype} but {weight_name} has {weight.dtype}; they must match")


def check_input_width(x, width, what):
    """x's last dimension must be `width` (what expects it, for the message)."""
    if x.shape[-1] != width:
        raise ValueError(f"x must have {width} features in its last dimension ({what}), "
                         f"got shape {tuple(x.shape)}")


def _check_width_against_norm(x, norm_weight, linear):
    """When the LayerNorm weight and the Linear agree on a width that x does not have, x is what is wrong."""
    width = _in_features(linear)
    if width is not None and isinstance(norm_weight, torch.Tensor) and tuple(norm_weight.shape) == (width,):
        check_input_width(x, width, "the width of the LayerNorm and of the Linear after it")


def norm_params(norm, x):
    """(`norm` checked against x's rows, with an RMSNorm's eps=None resolved as torch resolves it; its
    weight and bias as the kernels take them): what a fused op applying `norm` to x reads."""
    width = x.shape[-1]
    check_optional_param("norm_weight", norm.weight, (width,), "x", x)
    check_optional_param("norm_bias", norm.bias, (width,), "x", x)
    if norm.kind == "rms_norm" and norm.eps is None:  # torch.nn.RMSNorm's default
        norm = norm._replace(eps=default_eps(x.dtype))
    check_eps(norm.eps)
    if norm.kind == "rms_norm":
        check_style(norm.style, norm.weight)
    return norm, *_contiguous(norm.weight, norm.bias)


def _contiguous(weight, bias):
    """A weight and bias as the kernels take them: the CUDA extension refuses a strided weight or bias,
    and autograd carries the gradient back through the copy to the caller's view."""
    return weight.contiguous() if weight is not None else None, bias.contiguous() if bias is not None else None


def _check_rows(x):
    """x must have rows: at least one dimension (..., in_features)."""
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., in_features)")


def _in_features(linear):
    """The in_features of a Linear whose weight is a matrix (checked later by name), or None."""
    weight = linear.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return weight.shape[0] if linear.transposed is True else weight.shape[1]


def _cast_linears(dtype, linears):
    cast = []
    for lin in linears:
        if isinstance(lin, Linear):  # (anything else is refused by name in the check)
            weight, bias = cast_for_autocast(dtype, lin.weight, lin.bias)
            lin = lin._replace(weight=weight, bias=bias, adapters=_cast_adapters(dtype, lin.adapters))
        cast.append(lin)
    return cast


def norm_linears(x, norm, linears, recompute=True, shared=None, checked=None):
    """[Linear_i(norm(x)) + its LoRA adapters] for each remat.specs.Linear(weight, bias, adapters) in
    `linears`, all reading one remat.specs.Norm (as ViT's q, k and v do).

    The norm is computed once; autograd keeps x and one fp32 mean/rstd pair (and each adapter's
    rank-r A(norm(x))), and rebuilds norm(x) for every dW and dA. shared: a SharedStatistics of
    this norm, when other fused ops apply it to the same x: the statistics are then kept once.
    checked: a Checked, for a caller that passes the same parameters at every call (below).
    """
    if checked is not None and checked.holds(x, linears):
        call = checked.keep(*_norm_linears_call(x, norm, linears, recompute), (norm.eps, None, bool(recompute)))
        return sharing(shared, x, call)
    out = sharing(shared, x, lambda x, slot: _norm_linears(x, norm, linears, recompute, slot))
    if checked is not None:
        checked.passed(x)
    return out


def _norm_linears(x, norm, linears, recompute, slot):
    check_float_tensor("x", x)
    check_norm(norm)
    if not isinstance(linears, (tuple, list)) or not linears or not all(isinstance(lin, Linear) for lin in linears):
        raise TypeError(f"linears must be a non-empty list of remat.specs.Linear(weight, bias, adapters), "
                        f"got {linears!r}")
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:
        with torch.autocast(x.device.type, enabled=False):
            return _norm_linears(cast_for_autocast(dtype, x)[0], norm, _cast_linears(dtype, linears), recompute, slot)
    names = _linear_names(len(linears))
    _check_rows(x)
    _check_width_against_norm(x, norm.weight, linears[0])
    norm_params(norm, x)
    for linear, (weight_name, bias_name, adapters_name) in zip(linears, names):
        _check_linear(weight_name, linear, bias_name, x.shape[-1], x)
        _check_adapters(adapters_name, linear.adapters, _out_in(linear), x)
    return _apply_norm_linears(x, norm, linears, recompute, slot)


def _apply_norm_linears(x, norm, linears, recompute, slot):
    """norm_linears on checked arguments, outside autocast."""
    return _norm_linears_call(x, norm, linears, recompute)[0](x, slot)


def _norm_linears_call(x, norm, linears, recompute):
    """(call(x, slot): norm_linears on checked arguments like these, outside autocast, everything but x
    worked out now; _whole_as_given: the tensors a kernel reads whole, or None where it may not be kept)."""
    norm_weight, norm_bias = _contiguous(norm.weight, norm.bias)
    tensors, layout = _flat_linears(linears)
    norm_layout, recompute = _checked_layout(norm, x), bool(recompute)
    features = [_out_features(linear) for linear in linears]

    def call(x, slot):
        *lead, width = x.shape
        outs = _LayerNormLinears.apply(rows_with_unit_stride(x, width), norm_weight, norm_bias, norm_layout,
                                       recompute, layout, slot, *tensors)
        return [out.view(*lead, n) for out, n in zip(outs, features)]

    return call, _whole_as_given(norm, norm_weight, norm_bias, linears, tensors)


def _whole_as_given(norm, norm_weight, norm_bias, linears, tensors):
    """The tensors a kernel reads whole (the norm's weight and bias, each Linear's bias) where every tensor a
    call reads (norm_weight, norm_bias, the flat `tensors`) is the caller's own as given in `norm` and
    `linears`, none copied to be contiguous nor an adapter's (a call that may be kept); else None."""
    given = [norm.weight, norm.bias] if norm is not None else [None, None]
    given += [t for linear in linears for t in (linear.weight, linear.bias)]
    used = [norm_weight, norm_bias, *tensors]
    if len(used) != len(given) or any(u is not g for u, g in zip(used, given)):
        return None
    return tuple(t for t in (norm_weight, norm_bias, *tensors[1::2]) if t is not None)


def _linear_names(count):
    """The argument names of norm_linears' Linears in its error messages (not functools.cache'd: torch.compile
    warns on every cached function it traces; a converted module's calls skip the check, Checked)."""
    if count == 1:
        return [("weight", "bias", "adapters")]
    return [(f"linears[{i}].weight", f"linears[{i}].bias", f"linears[{i}].adapters") for i in range(count)]


# The argument names of fused_mlp's up projections in its error messages.
_FC1_NAMES = (("w1", "b1", "fc1_adapters"),)
_GATE_UP_NAMES = tuple((f"{n}.weight", f"{n}.bias", f"{n}.adapters") for n in ("gate", "up"))


def _up_projections(fc1, act):
    """(fc1 as a list of up projections, their argument names): [fc1], or for a gated act [gate, up]
    from a (gate, up) pair (a single Linear then holds gate ∥ up, gate first, as Phi-3's gate_up_proj)."""
    if act.gated and isinstance(fc1, (tuple, list)) and not isinstance(fc1, Linear):
        if len(fc1) != 2 or not all(isinstance(lin, Linear) for lin in fc1):
            raise TypeError(f"fc1 must be a remat.specs.Linear or a (gate, up) pair of them, got {fc1!r}")
        return list(fc1), _GATE_UP_NAMES
    if not isinstance(fc1, Linear):
        raise TypeError(f"fc1 must be a remat.specs.Linear(weight, bias, adapters), got {type(fc1).__name__}")
    return [fc1], _FC1_NAMES


def fused_mlp(x, fc1, act, fc2, norm=None, recompute=True, shared=None, checked=None):
    """fc2(act(fc1(x))), with `norm` (a remat.specs.Norm) applied to x first when given; fc1 and fc2 are
    remat.specs.Linear, with their LoRA adapters; act a remat.specs.Activation.

    A gated act computes fc2(act(gate(x)) * up(x)): fc1 is then a (gate, up) pair of Linears, or one
    Linear whose output holds gate then up (a fused gate_up projection, as Phi-3's).

    Autograd keeps x, the fc1 output h (gate and up when gated; and fp32 norm statistics with the
    norm, and each adapter's rank-r intermediate), and rebuilds act(h) (and norm(x)) in the backward.
    shared: a SharedStatistics of the norm, as for norm_linears; checked: a Checked, as for norm_linears.
    """
    if checked is not None:  # the arguments were checked once: fc1 a Linear, or a (gate, up) pair of them
        ups = _up_projections(fc1, act)[0]
        if checked.holds(x, (*ups, fc2)):
            made_for = (norm.eps if norm is not None else None, act, bool(recompute))
            call = checked.keep(*_mlp_call(x, ups, act, fc2, norm, recompute), made_for)
            return sharing(shared, x, call)
    out = sharing(shared, x, lambda x, slot: _fused_mlp(x, fc1, act, fc2, norm, recompute, slot))
    if checked is not None:
        checked.passed(x)
    return out


def _fused_mlp(x, fc1, act, fc2, norm, recompute, slot):
    check_float_tensor("x", x)
    check_activation(act)
    ups, names = _up_projections(fc1, act)
    if not isinstance(fc2, Linear):
        raise TypeError(f"fc2 must be a remat.specs.Linear(weight, bias, adapters), got {type(fc2).__name__}")
    if norm is not None:
        check_norm(norm)
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:
        with torch.autocast(x.device.type, enabled=False):
            *ups, fc2 = _cast_linears(dtype, [*ups, fc2])
            return _fused_mlp(cast_for_autocast(dtype, x)[0], ups if len(ups) == 2 else ups[0], act, fc2, norm,
                              recompute, slot)
    _check_rows(x)
    if norm is not None:
        _check_width_against_norm(x, norm.weight, ups[0])
        norm_params(norm, x)
    for up, (weight_name, bias_name, adapters_name) in zip(ups, names):
        _check_linear(weight_name, up, bias_name, x.shape[-1], x)
        _check_adapters(adapters_name, up.adapters, _out_in(up), x)
    hidden = _activation_width(act, ups)
    _check_linear("w2", fc2, "b2", hidden, x)
    _check_adapters("fc2_adapters", fc2.adapters, _out_in(fc2), x)
    return _apply_mlp(x, ups, act, fc2, norm, recompute, slot)


def _apply_mlp(x, ups, act, fc2, norm, recompute, slot):
    """fused_mlp on checked arguments (ups: the up projections, a list), outside autocast."""
    return _mlp_call(x, ups, act, fc2, norm, recompute)[0](x, slot)


def _mlp_call(x, ups, act, fc2, norm, recompute):
    """(call(x, slot), _whole_as_given) as _norm_linears_call's, for fused_mlp."""
    norm_weight, norm_bias = _contiguous(norm.weight, norm.bias) if norm is not None else (None, None)
    tensors, linears = _flat_linears((*ups, fc2))
    layout = _MLPLayout(_checked_layout(norm, x) if norm is not None else None, act, bool(recompute), linears)
    features = _out_features(fc2)

    def call(x, slot):
        out = _MLP.apply(layout, rows_with_unit_stride(x, x.shape[-1]), norm_weight, norm_bias, slot, *tensors)
        return out.view(*x.shape[:-1], features)

    return call, _whole_as_given(norm, norm_weight, norm_bias, (*ups, fc2), tensors)


def _checked_layout(norm, x):
    """The _NormLayout of a checked norm applied to x: an RMSNorm's eps=None resolved as torch resolves it,
    its eps checked again (read from its module at every call, it may have been set since)."""
    eps = default_eps(x.dtype) if norm.eps is None and norm.kind == "rms_norm" else norm.eps
    check_eps(eps)
    return _NormLayout(norm.kind, float(eps), norm.style)


def _activation_width(act, ups):
    """The width of act's output: the up projection's, or a gate's (the half of a fused gate ∥ up)."""
    width = _out_features(ups[0])
    if not act.gated:
        return width
    if len(ups) == 2:
        shapes = [tuple(_out_in(up).shape) for up in ups]
        if shapes[0] != shapes[1]:
            raise ValueError(f"gate and up must have the same shape (out, in), got {shapes[0]} and {shapes[1]}")
        return width
    if width % 2:
        raise ValueError(f"a fused gate_up projection has an even number of outputs (gate, then up), got {width}")
    return width // 2


# ---------------------------------------------------------------------------------------------
# The functions in loose arguments, as remat exports them
# ---------------------------------------------------------------------------------------------


def layer_norm_linear(x, norm_weight, norm_bias, weight, bias=None, eps=1e-5, recompute=True, adapters=()):
    """Linear(LayerNorm(x)) [+ LoRA adapters]: autograd keeps x and fp32 mean/rstd (and each adapter's
    rank-r A(LN(x))), and rebuilds LayerNorm(x) for dW and each dA."""
    check_float_tensor("x", x)
    return norm_linears(x, Norm(norm_weight, norm_bias, eps), [Linear(weight, bias, adapters)], recompute)[0]


def mlp(x, w1, b1, w2, b2=None, approximate="none", recompute=True,
        norm_weight=None, norm_bias=None, eps=1e-5, layer_norm=False, fc1_adapters=(), fc2_adapters=()):
    """fc2(gelu(fc1(x))), with LayerNorm(x) in front when layer_norm=True, and LoRA adapters on fc1/fc2
    (fused_mlp in loose arguments)."""
    check_float_tensor("x", x)
    check_approximate(approximate)
    if not layer_norm and (norm_weight is not None or norm_bias is not None):
        raise ValueError("norm_weight and norm_bias need layer_norm=True")
    norm = Norm(norm_weight, norm_bias, eps) if layer_norm else None
    return fused_mlp(x, Linear(w1, b1, fc1_adapters), gelu(approximate), Linear(w2, b2, fc2_adapters), norm,
                     recompute)
