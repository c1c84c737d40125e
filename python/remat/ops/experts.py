"""A mixture of experts' expert MLPs, routed: reference, custom ops (kernels, fakes, autograd), public function.

out_t = sum_k w_tk · expert_{e_tk}(x_t) for the tokens x (T, h), the router's choices top_k_index (T, K)
and weights top_k_weights (T, K), with each expert e an MLP on the weights as transformers' experts
modules store them (`@use_experts_implementation`): gate_up (E, N1, h), N1 = 2I gated (gate and up
concatenated, or interleaved as gpt-oss stores them) or I (non-gated: the `up_proj` alone), and
down (E, h, I), with optional biases (E, N1) and (E, h). The transposed layouts ((E, h, N1) and
(E, I, h)) are read in place, as strided views.

    expert_e(x) = down_e · act(gate_up_e · x + b_e) + c_e

act: gated "silu" (SwiGLU), "gelu" / "gelu_tanh" (GeGLU), "swiglu_clamped" (gpt-oss: gate clamped
above at limit, up to [-limit, limit], act = (up + 1) · gate · sigmoid(alpha · gate)); non-gated
"silu", "gelu", "gelu_tanh", "relu", "relu2" (squared ReLU, Nemotron-H's).

Routing: the (token, k) pairs are sorted by expert once (a stable sort: the order, hence every
sum's order, depends on the routing alone), giving `order` (S = T·K pair indices, int32) and the
per-expert `offsets` (E + 1, int32) into it. Expert ids >= E are expert-parallel sentinels: they
sort to the tail, past offsets[E], and are skipped (no output, zero weight gradient), as
transformers' grouped_mm skips them. A negative id is an error.

What autograd keeps (policy keep_hidden=False, "recompute"): x, top_k_weights, order and offsets,
and the weights. The backward rebuilds the gathered inputs, gate_up · x and the activation tile by
tile (triton_kernels/experts.py). keep_hidden=True also keeps the pre-activation H (S, N1) in x's
dtype: no repeated up projection in the backward, S·N1 more elements kept.

With a norm in front (`norm`: the post-attention RMSNorm or LayerNorm that feeds the router and the
experts), the experts read norm(x) but keep x and the norm's fp32 row statistics instead: the
backward rebuilds norm(x) with the norm's own forward kernel (bit for bit what the forward read),
runs the experts' backward on it, and carries the gradient through the norm's backward.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from .. import _backend
from .._numerics import math_dtype
from .._validate import autocast_dtype_for, cast_for_autocast, check_choice, check_float_tensor, check_same_device
from ..specs import check_norm
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves
from .fused import exchange, norm_backward, norm_forward, norm_layout, norm_params, sharing
from .gelu import gelu_and_derivative

GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_clamped")
PLAIN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
INDEX_DTYPES = (torch.int64, torch.int32)
MAX_TOP_K = 8
# gpt-oss's defaults (GptOssConfig.swiglu_alpha, swiglu_limit); read only by "swiglu_clamped".
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0

# ---------------------------------------------------------------------------------------------
# Routing and activations, shared by the reference and the kernels' launchers
# ---------------------------------------------------------------------------------------------


def route(top_k_index, num_experts):
    """(order, offsets): the (token, k) pair indices sorted by expert (stably), int32 (T·K,), and the
    first sorted position of each expert, int32 (E + 1,); offsets[E] counts the pairs not skipped."""
    ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)
    return order.to(torch.int32), offsets.to(torch.int32)


def split_gate_up(h, interleaved):
    """(gate, up) columns of a gated (rows, 2I) pre-activation: halves, or even and odd columns."""
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    return h.chunk(2, dim=1)


def join_gate_up(gate, up, interleaved):
    """The inverse of split_gate_up: (rows, 2I) in the weight's row layout."""
    if interleaved:
        return torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1)
    return torch.cat([gate, up], dim=1)


def _base_activation(h, activation):
    """(act(h), act'(h)) of a plain activation, in h's dtype."""
    if activation == "silu":
        s = torch.sigmoid(h)
        return h * s, s + h * s * (1 - s)
    if activation in ("gelu", "gelu_tanh"):
        return gelu_and_derivative(h, "tanh" if activation == "gelu_tanh" else "none")
    r = torch.relu(h)
    if activation == "relu":
        return r, (h > 0).to(h.dtype)
    return r * r, 2 * r  # relu2


def activation_and_derivatives(h, activation, gated, interleaved, alpha, limit):
    """(a, d): a = act(h) (rows, I) and d the derivatives in h's column layout (rows, N1): da/dgate and
    da/dup for a gated h, act'(h) for a plain one. Math in h's dtype, no rounding."""
    if not gated:
        return _base_activation(h, activation)
    gate, up = split_gate_up(h, interleaved)
    if activation == "swiglu_clamped":
        gate_c, up_c = gate.clamp(max=limit), up.clamp(-limit, limit)
        s = torch.sigmoid(alpha * gate_c)
        glu = gate_c * s
        d_gate = torch.where(gate <= limit, (up_c + 1) * (s + alpha * gate_c * s * (1 - s)), 0.0)
        d_up = torch.where((up >= -limit) & (up <= limit), glu, 0.0)
        return (up_c + 1) * glu, join_gate_up(d_gate, d_up, interleaved)
    value, derivative = _base_activation(gate, activation)
    return value * up, join_gate_up(derivative * up, value, interleaved)


# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch, in fp32 (or float64 when given float64), one expert at a time.
# ---------------------------------------------------------------------------------------------


def _expert_rows(offsets, order, top_k):
    """(expert, pair indices, token indices) of every expert that has a pair (reads the offsets)."""
    bounds = offsets.tolist()
    pairs = order.long()
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            p = pairs[bounds[e]:bounds[e + 1]]
            yield e, slice(bounds[e], bounds[e + 1]), p, torch.div(p, top_k, rounding_mode="floor")


def _pre_activation(x_rows, gate_up, gate_up_bias, e, compute):
    h = x_rows.to(compute) @ gate_up[e].to(compute).T
    return h + gate_up_bias[e].to(compute) if gate_up_bias is not None else h


def _expert_output(a, down, down_bias, e, compute):
    y = a @ down[e].to(compute).T
    return y + down_bias[e].to(compute) if down_bias is not None else y


def experts_fwd_ref(
    x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor | None,
    down_bias: Tensor | None, activation: str, gated: bool, interleaved: bool, alpha: float, limit: float,
    keep_hidden: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, order, offsets, hidden): out (T, h) in x's dtype; the routing (see route); hidden the
    pre-activation (T·K, N1) in x's dtype in sorted order (0 on skipped pairs) with keep_hidden, else
    an empty (0,). Differentiable in x, the weights and the biases (a double backward runs through it)."""
    tokens, top_k = top_k_index.shape
    compute = math_dtype(x)
    order, offsets = route(top_k_index, gate_up.shape[0])
    weights = top_k_weights.reshape(-1).to(compute)
    pair_out = x.new_zeros((tokens * top_k, x.shape[1]), dtype=compute)
    hidden = x.new_zeros((tokens * top_k, gate_up.shape[1])) if keep_hidden else x.new_empty((0,))
    for e, rows, p, t in _expert_rows(offsets, order, top_k):
        h = _pre_activation(x[t], gate_up, gate_up_bias, e, compute)
        if keep_hidden:
            hidden[rows] = h.detach().to(x.dtype)
        a, _ = activation_and_derivatives(h, activation, gated, interleaved, alpha, limit)
        y = _expert_output(a, down, down_bias, e, compute)
        pair_out = pair_out.index_add(0, p, y * weights[p, None])
    return pair_out.view(tokens, top_k, x.shape[1]).sum(dim=1).to(x.dtype), order, offsets, hidden


def experts_bwd_ref(
    dout: Tensor, x: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor | None,
    down_bias: Tensor | None, order: Tensor, offsets: Tensor, hidden: Tensor, activation: str, gated: bool,
    interleaved: bool, alpha: float, limit: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dtop_k_weights, dgate_up, ddown, dgate_up_bias, ddown_bias), each in its input's dtype and
    shape (contiguous); a bias's gradient is an empty (0,) without the bias. The pre-activation is
    hidden's rows where it is kept, else recomputed from x."""
    tokens, top_k = top_k_weights.shape
    compute = math_dtype(x)
    experts, n1, width = gate_up.shape
    weights = top_k_weights.reshape(-1).to(compute)
    dx = x.new_zeros(x.shape, dtype=compute)
    dweights = x.new_zeros((tokens * top_k,), dtype=compute)
    zeros = {"gate_up": x.new_zeros((n1, width), dtype=compute), "down": x.new_zeros(down.shape[1:], dtype=compute),
             "gate_up_bias": x.new_zeros((n1,), dtype=compute), "down_bias": x.new_zeros((width,), dtype=compute)}
    grads = {name: [zero] * experts for name, zero in zeros.items()}
    for e, rows, p, t in _expert_rows(offsets, order, top_k):
        x_rows = x[t].to(compute)
        h = hidden[rows].to(compute) if hidden.numel() else _pre_activation(x_rows, gate_up, gate_up_bias, e, compute)
        a, derivative = activation_and_derivatives(h, activation, gated, interleaved, alpha, limit)
        d_rows = dout[t].to(compute)
        w = weights[p, None]
        g = d_rows @ down[e].to(compute)  # d out_pair / d a, before the routing weight
        dweights = dweights.index_add(0, p, (d_rows * _expert_output(a, down, down_bias, e, compute)).sum(dim=1))
        da = g * w
        dh = derivative * (join_gate_up(da, da, interleaved) if gated else da)
        dx = dx.index_add(0, t, dh @ gate_up[e].to(compute))
        grads["gate_up"][e] = dh.T @ x_rows
        grads["down"][e] = (d_rows * w).T @ a
        grads["gate_up_bias"][e] = dh.sum(dim=0)
        grads["down_bias"][e] = (d_rows * w).sum(dim=0)
    return (dx.to(x.dtype), dweights.view(tokens, top_k).to(top_k_weights.dtype),
            torch.stack(grads["gate_up"]).to(gate_up.dtype), torch.stack(grads["down"]).to(down.dtype),
            torch.stack(grads["gate_up_bias"]).to(gate_up_bias.dtype) if gate_up_bias is not None else _absent(x),
            torch.stack(grads["down_bias"]).to(down_bias.dtype) if down_bias is not None else _absent(x))


def _absent(like):
    """Placeholder for the gradient of an absent bias."""
    return like.new_empty((0,))


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd (the ops themselves are declared at the end of the file)
# ---------------------------------------------------------------------------------------------


def _fwd_fake(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gated, interleaved,
              alpha, limit, keep_hidden):
    pairs = top_k_index.numel()
    hidden = x.new_empty((pairs, gate_up.shape[1]) if keep_hidden else (0,))
    return (x.new_empty(x.shape), x.new_empty((pairs,), dtype=torch.int32),
            x.new_empty((gate_up.shape[0] + 1,), dtype=torch.int32), hidden)


def _bwd_fake(dout, x, top_k_weights, gate_up, down, gate_up_bias, down_bias, order, offsets, hidden, activation, gated,
              interleaved, alpha, limit):
    return (x.new_empty(x.shape), top_k_weights.new_empty(top_k_weights.shape), gate_up.new_empty(gate_up.shape),
            down.new_empty(down.shape),
            gate_up_bias.new_empty(gate_up_bias.shape) if gate_up_bias is not None else _absent(x),
            down_bias.new_empty(down_bias.shape) if down_bias is not None else _absent(x))


def _without_autocast(x):
    """Autocast off for a backward called inside an autocast block: it computes in the forward's dtypes,
    not autocast's (on devices autocast knows; meta tensors have none)."""
    if torch.amp.is_autocast_available(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def _setup_context(ctx, inputs, output):
    x, _index, top_k_weights, gate_up, down, gate_up_bias, down_bias, *options, _keep_hidden = inputs
    _out, order, offsets, hidden = output
    # The router's index is not kept: the sorted order and the offsets say everything it said.
    ctx.save_for_backward(x, top_k_weights, gate_up, down, gate_up_bias, down_bias, order, offsets, hidden)
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(order, offsets, hidden)


def _backward(ctx, dout, _dorder, _doffsets, _dhidden):
    x, top_k_weights, gate_up, down, gate_up_bias, down_bias, order, offsets, hidden = ctx.saved_tensors
    # Under create_graph=True the reference's formulas, which a second backward can differentiate
    # (the pre-activation recomputed from x: the kept one is a constant to autograd).
    if _backend.backward_is_differentiated():
        backward, hidden = experts_bwd_ref, hidden.new_empty((0,))
    else:
        backward = experts_bwd
    with _without_autocast(x):
        dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias = backward(
            dout.contiguous(), x, top_k_weights, gate_up, down, gate_up_bias, down_bias, order, offsets, hidden,
            *ctx.options)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, None, dweights if need[2] else None, dgate_up if need[3] else None,
            ddown if need[4] else None, dgate_up_bias if need[5] and gate_up_bias is not None else None,
            ddown_bias if need[6] and down_bias is not None else None, None, None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def _readable(t):
    """Whether t's values may be read here: not while tracing (torch.compile, fake or meta tensors)
    nor while a CUDA graph is being captured (a read would synchronise)."""
    if torch.compiler.is_compiling() or isinstance(t, FakeTensor) or t.device.type == "meta":
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _check_routing(x, top_k_index, top_k_weights):
    if x.dim() != 2:
        raise ValueError(f"x must have shape (tokens, hidden), got {tuple(x.shape)}")
    if not isinstance(top_k_index, torch.Tensor):
        raise TypeError(f"top_k_index must be a torch.Tensor of expert ids, got {type(top_k_index).__name__}")
    if top_k_index.dtype not in INDEX_DTYPES:
        raise TypeError(f"top_k_index must have dtype int64 or int32 (expert ids), got {top_k_index.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] or not 1 <= top_k_index.shape[1] <= MAX_TOP_K:
        raise ValueError(f"top_k_index must have shape ({x.shape[0]}, K) with 1 <= K <= {MAX_TOP_K} (x has "
                         f"{x.shape[0]} tokens), got {tuple(top_k_index.shape)}")
    check_same_device("top_k_index", top_k_index, "x", x)
    check_float_tensor("top_k_weights", top_k_weights)
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, got "
                         f"{tuple(top_k_weights.shape)}")
    check_same_device("top_k_weights", top_k_weights, "x", x)


def _check_ids(top_k_index):
    """No negative expert id (ids >= num_experts are expert-parallel sentinels, skipped). Reads the
    values outside torch.compile and CUDA graphs (one synchronisation with the GPU); there a negative
    id sorts before expert 0's pairs, outside every expert's range, and is skipped as a sentinel is."""
    if top_k_index.numel() and _readable(top_k_index) and bool((top_k_index < 0).any()):
        value = top_k_index[top_k_index < 0][0].item()
        raise ValueError(f"top_k_index must hold expert ids >= 0 (ids >= num_experts are skipped as expert-parallel "
                         f"sentinels), got {value}")


def _check_weights(x, gate_up, down, gate_up_bias, down_bias, gated):
    """gate_up (E, N1, h) and down (E, h, I) as the op reads them (transposed layouts already turned)."""
    for name, w in (("gate_up", gate_up), ("down", down)):
        check_float_tensor(name, w)
        if w.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (experts first), got shape {tuple(w.shape)}")
        check_same_device(name, w, "x", x)
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; they must match")
    experts, n1, width = gate_up.shape
    if width != x.shape[1] or experts < 1 or (gated and n1 % 2):
        what = "(experts, 2 * intermediate, hidden)" if gated else "(experts, intermediate, hidden)"
        raise ValueError(f"gate_up must have shape {what} with hidden {x.shape[1]} (x's) and at least one expert, "
                         f"as the layout reads it, got {tuple(gate_up.shape)}")
    intermediate = n1 // 2 if gated else n1
    if tuple(down.shape) != (experts, width, intermediate):
        raise ValueError(f"down must have shape {(experts, width, intermediate)} (experts, hidden, intermediate) "
                         f"as the layout reads it, got {tuple(down.shape)}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (experts, n1)), ("down_bias", down_bias,
                                                                              (experts, width))):
        if bias is None:
            continue
        check_float_tensor(name, bias)
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(bias.shape)}")
        check_same_device(name, bias, "x", x)
        if bias.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {bias.dtype} but x has {x.dtype}; they must match")


def _check_options(activation, gated, alpha, limit):
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be a bool, got {gated!r}")
    check_choice("activation", activation, GATED_ACTIVATIONS if gated else PLAIN_ACTIVATIONS)
    for name, value, positive in (("alpha", alpha, False), ("limit", limit, True)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            raise ValueError(f"{name} must be a finite{' positive' if positive else ''} float, got {value!r}")


def experts(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None, down_bias=None, *, activation="silu",
            gated=True, interleaved=False, transposed=False, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT,
            keep_hidden=False, norm=None, shared=None):
    """The routed experts' output sum_k top_k_weights[t, k] · expert_{top_k_index[t, k]}(x[t]), as
    transformers' experts implementations compute it (see remat.ops.experts for the formula).

    x: (T, h) float32, float16 or bfloat16 (float64 runs the reference). top_k_index: (T, K) int64 or
    int32 expert ids, 1 <= K <= 8; ids >= E are skipped (expert-parallel sentinels). top_k_weights:
    (T, K), any float dtype. gate_up: (E, 2I, h) gated or (E, I, h) non-gated (transformers'
    `gate_up_proj` or `up_proj`), down: (E, h, I) (`down_proj`), both in x's dtype; with
    transposed=True (E, h, N1) and (E, I, h), as `is_transposed` modules store them (read in place).
    gate_up_bias (E, N1), down_bias (E, h): optional. interleaved: gate and up as even and odd rows
    of gate_up (`is_concatenated=False`). activation: see the module docstring; alpha and limit
    are "swiglu_clamped"'s (gpt-oss's swiglu_alpha and swiglu_limit).
    keep_hidden: keep the pre-activation (T·K·N1 elements) for the backward instead of recomputing it.
    norm: a remat.specs.Norm applied to x first (the norm before the router and the experts): the
    experts read norm(x), and x with the norm's fp32 statistics is kept instead of norm(x). shared: a
    remat.ops.fused.SharedStatistics of that norm, when other fused ops apply it to the same x (the
    router's projection): the statistics are then kept once.
    Returns (T, h) in x's dtype. Under autocast x and the weights are cast to the autocast dtype and
    the result back to x's dtype, as the stock experts accumulate into zeros_like(x).
    """
    check_float_tensor("x", x)
    amp = autocast_dtype_for(x)
    if amp is not None:
        with torch.autocast(x.device.type, enabled=False):
            cast = cast_for_autocast(amp, x, gate_up, down, gate_up_bias, down_bias)
            out = experts(cast[0], top_k_index, top_k_weights, *cast[1:], activation=activation, gated=gated,
                          interleaved=interleaved, transposed=transposed, alpha=alpha, limit=limit,
                          keep_hidden=keep_hidden, norm=norm, shared=shared)
            return out.to(x.dtype)
    _check_routing(x, top_k_index, top_k_weights)
    _check_options(activation, gated, alpha, limit)
    for name, w in (("gate_up", gate_up), ("down", down)):
        check_float_tensor(name, w)
        if transposed and w.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (experts first), got shape {tuple(w.shape)}")
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    _check_weights(x, gate_up, down, gate_up_bias, down_bias, gated)
    _check_ids(top_k_index)
    options = (activation, gated, bool(interleaved and gated), float(alpha), float(limit), bool(keep_hidden))
    if norm is not None:
        return _normed(x, norm, shared, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, options)
    out, _order, _offsets, _hidden = experts_fwd(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                                                 down_bias, *options)
    return out


def _normed(x, norm, shared, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, options):
    """experts(norm(x), ...) on _NormedExperts, norm checked against x."""
    norm, norm_weight, norm_bias = norm_params(check_norm(norm), x)
    layout = norm_layout(norm)
    return sharing(shared, x, lambda x, slot: _NormedExperts.apply(
        x.contiguous(), norm_weight, norm_bias, layout, slot, top_k_index, top_k_weights, gate_up, down,
        gate_up_bias, down_bias, options))


class _NormedExperts(torch.autograd.Function):
    """experts(norm(x)) keeping x and the norm's fp32 statistics, not norm(x): the backward rebuilds
    norm(x) with the norm's forward kernel (the same kernel on the same x: what the forward read, bit
    for bit), runs the experts' backward on it and hands d norm(x) to the norm's backward.
    The router's index is not kept, as in the plain op: the order and offsets say all it said."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, layout, slot, top_k_index, top_k_weights, gate_up, down,
                gate_up_bias, down_bias, options):
        _backend.remember_backend(ctx)
        normed, stats = norm_forward(layout, x, norm_weight, norm_bias)
        stats = exchange(slot, stats)
        out, order, offsets, hidden = experts_fwd(normed, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                                                  down_bias, *options)
        ctx.save_for_backward(x, norm_weight, norm_bias, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                              order, offsets, hidden, *stats)
        ctx.layout, ctx.options = layout, options[:-1]
        return out

    @staticmethod
    @_backend.on_forward_backend
    def backward(ctx, dout):
        x, norm_weight, norm_bias, top_k_weights, gate_up, down, gate_up_bias, down_bias, order, offsets, hidden, \
            *stats = ctx.saved_tensors
        with _without_autocast(x):
            normed, _ = norm_forward(ctx.layout, x, norm_weight, norm_bias)
            d_normed, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias = experts_bwd(
                dout.contiguous(), normed, top_k_weights, gate_up, down, gate_up_bias, down_bias, order, offsets,
                hidden, *ctx.options)
            del normed
            dx, d_norm_weight, d_norm_bias, _ = norm_backward(ctx.layout, d_normed, x, norm_weight, norm_bias, stats,
                                                              False)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, d_norm_weight if need[1] else None,
                d_norm_bias if need[2] and norm_bias is not None else None, None, None, None,
                dweights if need[6] else None, dgate_up if need[7] else None, ddown if need[8] else None,
                dgate_up_bias if need[9] and gate_up_bias is not None else None,
                ddown_bias if need[10] and down_bias is not None else None, None)


# ---------------------------------------------------------------------------------------------
# The stock computation: transformers' eager experts loop, as its modules write it
# ---------------------------------------------------------------------------------------------


def stock_experts(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None, down_bias=None, *,
                  activation="silu", gated=True, interleaved=False, transposed=False, alpha=GPT_OSS_ALPHA,
                  limit=GPT_OSS_LIMIT):
    """transformers' eager experts forward (one expert at a time, index_add into zeros_like(x)), in
    the inputs' dtype, with experts() arguments: the tests' stock comparison."""
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    final = torch.zeros_like(x)
    experts_count = gate_up.shape[0]
    for e in range(experts_count):
        top_k_pos, token_idx = torch.where(top_k_index.T == e)
        if token_idx.numel() == 0:
            continue
        h = F.linear(x[token_idx], gate_up[e], gate_up_bias[e] if gate_up_bias is not None else None)
        a = _stock_activation(h, activation, gated, interleaved, alpha, limit)
        y = F.linear(a, down[e], down_bias[e] if down_bias is not None else None)
        y = y * top_k_weights[token_idx, top_k_pos, None]
        final = final.index_add(0, token_idx, y.to(final.dtype))
    return final


def _stock_activation(h, activation, gated, interleaved, alpha, limit):
    """act(h) as transformers' experts modules write it, in h's dtype."""
    plain = {"relu2": lambda v: torch.relu(v) ** 2, "relu": torch.relu, "silu": F.silu, "gelu": F.gelu,
             "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}
    if not gated:
        return plain[activation](h)
    gate, up = split_gate_up(h, interleaved)
    if activation == "swiglu_clamped":
        gate, up = gate.clamp(min=None, max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return plain[activation](gate) * up


def stock_batched_experts(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None, down_bias=None, *,
                          activation="silu", gated=True, interleaved=False, transposed=False, alpha=GPT_OSS_ALPHA,
                          limit=GPT_OSS_LIMIT):
    """transformers' "batched_mm" experts forward (each pair's weights gathered, one batched product per
    projection, sentinel pairs clamped and weighted 0, the sum over k in fp32), with experts() arguments:
    reads no value, so it also runs on meta and fake tensors (the validation table's stock)."""
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    experts_count = gate_up.shape[0]
    sentinel = ids >= experts_count
    ids = ids.clamp(0, experts_count - 1)
    rows = x.repeat_interleave(top_k, dim=0)
    h = torch.bmm(gate_up[ids], rows[:, :, None])[:, :, 0]
    if gate_up_bias is not None:
        h = h + gate_up_bias[ids]
    a = _stock_activation(h, activation, gated, interleaved, alpha, limit)
    y = torch.bmm(down[ids], a[:, :, None])[:, :, 0]
    if down_bias is not None:
        y = y + down_bias[ids]
    weights = top_k_weights.reshape(-1).masked_fill(sentinel, 0.0)
    return (y * weights[:, None]).view(tokens, top_k, y.shape[1]).sum(dim=1).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The family: remat::experts_fwd and remat::experts_bwd, and what the tooling needs
# ---------------------------------------------------------------------------------------------
_VARIANTS = (  # (activation, gated, interleaved, biases, keep_hidden)
    ("silu", True, False, False, False),
    ("swiglu_clamped", True, True, True, True),
    ("relu2", False, False, True, False),
)


def sample_routing(tokens, top_k, experts, device, sentinel=False):
    """top_k_index (tokens, top_k) of distinct ids per token, the last expert never chosen (an expert
    with no token) and, with sentinel, one id past the experts; computed from the shape alone (so on
    meta and fake tensors too)."""
    t = torch.arange(tokens, device=device)[:, None]
    k = torch.arange(top_k, device=device)[None, :]
    index = (t * 3 + k * 2) % max(experts - 1, 1)
    if sentinel and tokens:
        index = torch.where((t == tokens - 1) & (k == 0), experts, index)
    return index


def _samples(device):
    """7 tokens of width 37, intermediate 20, 5 experts of which one gets no token, top-3 with a
    sentinel id; each layout (concatenated, interleaved, non-gated), with and without biases, both policies."""
    tokens, width, inter, n_exp, top_k = 7, 37, 20, 5, 3
    x = torch.randn(tokens, width, device=device)
    index = sample_routing(tokens, top_k, n_exp, device, sentinel=True)
    weights = torch.rand(tokens, top_k, device=device)
    forward, backward = [], []
    for activation, gated, interleaved, biases, keep in _VARIANTS:
        n1 = 2 * inter if gated else inter
        gate_up = torch.randn(n_exp, n1, width, device=device) / width**0.5
        down = torch.randn(n_exp, width, inter, device=device) / inter**0.5
        gate_up_bias = torch.randn(n_exp, n1, device=device) if biases else None
        down_bias = torch.randn(n_exp, width, device=device) if biases else None
        options = (activation, gated, interleaved, GPT_OSS_ALPHA, 1.0)
        forward.append((*grad_leaves(x), index, *grad_leaves(weights, gate_up, down, gate_up_bias, down_bias), *options,
                        keep))
        _, order, offsets, hidden = experts_fwd_ref(x, index, weights, gate_up, down, gate_up_bias, down_bias,
                                                    *options, keep)
        backward.append((torch.randn(tokens, width, device=device), x, weights, gate_up, down, gate_up_bias,
                         down_bias, order, offsets, hidden, *options))
    return OpSamples(forward, backward)


_TOKENS, _WIDTH, _INTER, _EXPERTS, _TOP_K = 6, 24, 20, 5, 2  # the validation table's: no powers of two


def _call_args(t):
    index = sample_routing(t["x"].shape[0], _TOP_K, _EXPERTS, t["x"].device)
    return t["x"], index, t["top_k_weights"], t["gate_up"], t["down"]


FAMILY = OpFamily(
    name="experts",
    forward_ref=experts_fwd_ref,
    backward_ref=experts_bwd_ref,
    forward_fake=_fwd_fake,
    backward_fake=_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="experts",
    calls=(PublicCall("experts", {"x": (_TOKENS, _WIDTH), "top_k_weights": (_TOKENS, _TOP_K),
                                  "gate_up": (_EXPERTS, 2 * _INTER, _WIDTH), "down": (_EXPERTS, _WIDTH, _INTER)},
                      lambda t: experts(*_call_args(t)), lambda t: stock_batched_experts(*_call_args(t)),
                      inputs=("x", "top_k_weights")),),
    triton="experts",
    uses_tl_dot=True,
)
experts_fwd, experts_bwd = FAMILY.forward, FAMILY.backward
