"""q/k norms fused into remat's attention: the attention keeps the projections' outputs, not q and k.

Qwen3, OLMo2/3, Gemma3 and others normalise q and k (per head, or over all heads: OLMo2) between
their projections and the rotary embedding:

    q = rope(q_norm(q_proj(x)) as (batch, heads, seq, head_dim), cos, sin); k likewise; attention(q, k, v)

Stock, transformers' RMSNorm keeps an fp32 copy of its input and its normalised x, and the
attention keeps the post-rope q and k besides: about three times q's bytes more than a layer
without these norms. Swapping the norm for a cheaper one alone does not help, as the attention
keeps q and k anyway. So here the attention keeps the projection outputs (x_q, x_k: what the norms
read) and the norms' fp32 rstd (4 bytes a row), and rebuilds norm + rope in its backward.

Convert time (fuse_qk_norms, for a transformers module the structure probe saw):
- two children are RMSNorms rounding as one of remat's styles (checked bitwise), each reading a
  Linear-like child's output through views only, their outputs read by functions only (the
  transpose, the rotary embedding) and not returned;
- a replay of each such module (on its own weights and the probe's arguments, in their dtype; on
  meta, once per kind of module, on a CPU copy with random weights) checks bitwise that
  rope(norm(x)) rebuilt here, with the position_embeddings the module was handed, is the query and
  the key its forward hands the attention interface; that replay also tells which norm is q's,
  which k's, and how each norm's output becomes (batch, heads, seq, head_dim). A layer whose forward
  takes another path (AFMoE's global layers: no rope) fails it and keeps its norms stock, with why;
  the norms fuse in the replay's dtype only (another runs them stock, with why);
- the norms become _RematHeadNorm (their forward: the stock sequence of operations, bitwise, as an
  autograd Function keeping x and rstd only), and the module gets a forward pre-hook (capturing its
  position_embeddings and whether a cache holds past keys) and a forward hook (closing the call).

Call time: each norm records (x, its version, rstd) in the module's open call; remat's attention
function (interface.attention_forward) asks fused_attention, which checks the call cheaply (both
norms ran in this call, unchanged since, shapes and dtypes as the rebuild makes them, no past keys,
grad enabled, no autocast) and runs _NormRopeAttention: its forward runs remat's attention kernel
(remat.attention's, or remat.attention_varlen's on the tokens of a padded or packed batch) on the q
and k the model made (bitwise what the backward rebuilds), keeps x_q, x_k, v, o, lse and the rstds;
its backward rebuilds q and k (the norm and rope as PyTorch ops in the backward, not inside the
kernel's loads), runs the attention backward, then the rope's transpose and the RMSNorm backward
(dx, dweight). Any other call (a cache with past keys, a padded batch attending both ways,
autocast, a norm that ran stock) uses the q and k it is handed, whose graph (the norms' own
Function, the stock rope) gives the gradients, with the reason recorded (remat.fallback_counts).
Under torch.compile the norms run their stock forward and nothing is fused.
"""

import collections
import copy
import dataclasses
import inspect

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ... import _zero3 as zero3
from ..._backend import backward_is_differentiated
from ..._guards import decided, fallback, from_transformers, hook_reason, tensor_reason
from ..._linears import widths
from ..._validate import autocast_dtype_for, rows_with_unit_stride
from ...ops.attention import _attention_bwd_ref, _unit_last_stride, attention_bwd, attention_fwd, checked_call
from ...ops.attention_varlen import _attention_varlen_bwd_ref, attention_varlen_bwd, attention_varlen_fwd
from ...ops.rms_norm import output_dtype, rms_norm_bwd, rms_norm_bwd_ref, rms_norm_output_ref, rms_norm_rstd_ref
from ...saved import saved_bytes
from ..swap import is_converted, join, with_class
from . import structure as structure_probe
from .modules import _between_reason, _RematModule, remat_class

# How a norm's output y becomes the attention's (batch, heads, seq, head_dim) before the rope:
# "bshd": y is (batch, seq, heads, head_dim) (Qwen3: the norm reads the projection viewed as heads);
# "flat": y is (batch, seq, heads * head_dim) (OLMo2: the norm spans every head);
# "bhsd": y is the attention's layout already (Gemma3: the norm reads the transposed view).
LAYOUTS = ("bshd", "flat", "bhsd")

# Functions that pass a projection's output on to a norm unchanged in value (views of it).
_VIEWS = frozenset({"view", "reshape", "transpose", "unflatten", "contiguous", "__getitem__"})

_PROBE_NAME = "remat_qk_probe"  # the attention implementation of the convert-time replay


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """What the rebuild needs of one norm besides its tensors: its rounding style, eps, layout."""

    style: str
    eps: float
    layout: str


# ---------------------------------------------------------------------------------------------
# The norm, the rope and their transposes (PyTorch ops; the rebuild runs in the backward)
# ---------------------------------------------------------------------------------------------


def _norm_forward(x, weight, eps, style):
    """(y of x's shape, fp32 rstd a row): the stock RMSNorm's operations, in its order (bitwise)."""
    rows = rows_with_unit_stride(x, x.shape[-1])
    rstd = rms_norm_rstd_ref(rows, eps)
    return _norm_output(x, weight, rstd, style), rstd


def _norm_output(x, weight, rstd, style):
    """y = norm(x) from the rstd kept: bitwise the forward's y."""
    return rms_norm_output_ref(rows_with_unit_stride(x, x.shape[-1]), weight, rstd, style).view(x.shape)


def _norm_backward(dy, x, weight, rstd, eps, style):
    """(dx in x's shape, dweight) by remat's RMSNorm backward (its kernels; the differentiable
    reference under create_graph=True, as remat.rms_norm does)."""
    width = x.shape[-1]
    rows, dy_rows = rows_with_unit_stride(x, width), rows_with_unit_stride(dy, width)
    if backward_is_differentiated():
        dx, dw, _ = rms_norm_bwd_ref(dy_rows, rows, weight, rms_norm_rstd_ref(rows, eps), style, False)
    else:
        dx, dw, _ = rms_norm_bwd(dy_rows, rows, weight, rstd, style, False)
    return dx.view(x.shape), dw


def _as_heads(y, layout, heads):
    """The norm's output `y` as (batch, heads, seq, head_dim), as the model's forward lays it out."""
    if layout == "bshd":
        return y.transpose(1, 2)
    if layout == "flat":
        return y.view(*y.shape[:-1], heads, y.shape[-1] // heads).transpose(1, 2)
    return y


def _heads_shape(x, layout, heads):
    """The shape _as_heads gives for an input of x's shape (without computing anything), or None."""
    if layout == "bshd" and x.dim() == 4:
        return (x.shape[0], x.shape[2], x.shape[1], x.shape[3])
    if layout == "flat" and x.dim() == 3 and heads > 0 and x.shape[-1] % heads == 0:
        return (x.shape[0], heads, x.shape[1], x.shape[-1] // heads)
    return tuple(x.shape) if layout == "bhsd" and x.dim() == 4 else None


def _from_heads(g, layout, shape):
    """The transpose of _as_heads: a (batch, heads, seq, head_dim) gradient in the norm output's shape."""
    if layout == "bshd":
        return g.transpose(1, 2)
    if layout == "flat":
        return g.transpose(1, 2).reshape(shape)
    return g


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _rope(t, cos, sin, dtype):
    """transformers' apply_rotary_pos_emb on one tensor (cos and sin (batch, seq, head_dim)), in its
    order of operations, cast to `dtype` (the query's: OLMo2 casts back, Qwen3 keeps the promotion)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return ((t * cos) + (_rotate_half(t) * sin)).to(dtype)


def _rope_backward(g, cos, sin, dtype):
    """The gradient of _rope's input (dtype: its input's) from its output's gradient g, as autograd
    takes it: t * cos and rotate_half(t) * sin each in the promoted dtype, cast back, then summed;
    rotate_half's transpose maps halves (a, b) to (b, -a)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    g = g.to(torch.promote_types(dtype, cos.dtype))
    through_cos, through_sin = (g * cos).to(dtype), (g * sin).to(dtype)
    half = through_sin.shape[-1] // 2
    return through_cos + torch.cat((through_sin[..., half:], -through_sin[..., :half]), dim=-1)


def rebuild(x, weight, rstd, spec, heads, cos, sin, dtype):
    """rope(norm(x)) as (batch, heads, seq, head_dim) in `dtype`: the q or k the model's forward made."""
    return _rope(_as_heads(_norm_output(x, weight, rstd, spec.style), spec.layout, heads), cos, sin, dtype)


def _rebuilt_backward(g, x, weight, rstd, spec, cos, sin):
    """(dx, dweight) from the gradient g of rebuild's output."""
    y_dtype = output_dtype(spec.style, x.dtype, weight)
    dy = _from_heads(_rope_backward(g, cos, sin, y_dtype), spec.layout, x.shape)
    return _norm_backward(dy, x, weight, rstd, spec.eps, spec.style)


# ---------------------------------------------------------------------------------------------
# The head norm: the stock operations as a Function that keeps x and rstd
# ---------------------------------------------------------------------------------------------


class _HeadNormFunction(torch.autograd.Function):
    """(y, rstd) of the RMSNorm; keeps x (the projection output's view, which the fused attention
    keeps too: one storage) and the fp32 rstd, never an fp32 copy of x nor the normalised x."""

    @staticmethod
    def forward(ctx, x, weight, eps, style):
        y, rstd = _norm_forward(x, weight, eps, style)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps, ctx.style = eps, style
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _norm_backward(dy, x, weight, rstd, ctx.eps, ctx.style)
        return dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None, None


def _eps(norm):
    eps = norm.__dict__.get("eps")
    return eps if eps is not None else getattr(norm, "eps", getattr(norm, "variance_epsilon", None))


class _RematHeadNorm(_RematModule):
    """A q or k norm (a transformers RMSNorm class, still an instance of it: same weight, eps and
    state_dict keys) whose attention keeps its input instead of q or k: its forward computes the
    stock module's operations bitwise (remat_style) as a Function keeping x and rstd, and records
    them in the attention module's open call for remat's attention function (fused_attention)."""

    remat_prefix = "RematHead"
    remat_style: str

    def forward(self, hidden_states):
        if torch.compiler.is_compiling():
            return self.remat_stock.forward(self, hidden_states)
        reason = decided(self, [self], lambda: hook_reason(self, allow=zero3.is_hook) or
                         tensor_reason("weight", self.weight))
        checked = self.__dict__.get("remat_qk_dtype")
        if reason is None and hidden_states.dtype != checked:
            reason = f"its input is {hidden_states.dtype}, not the {checked} its convert-time check ran in"
        if reason is not None:
            self._remat_fallback(reason)
            return self.remat_stock.forward(self, hidden_states)
        y, rstd = _HeadNormFunction.apply(hidden_states, self.weight, _eps(self), self.remat_style)
        call = self.__dict__.get("remat_qk_call")
        if call is not None:
            call.record(self.__dict__["remat_qk_role"], hidden_states, rstd)
        return y

    def extra_repr(self):
        return f"{super().extra_repr()}, fused into its attention (style {self.remat_style!r})"


# ---------------------------------------------------------------------------------------------
# The attention module's call: opened by its pre-hook, filled by the norms, read by the attention
# ---------------------------------------------------------------------------------------------


class _Call:
    """What one forward of an attention module with fused q/k norms recorded for its attention call."""

    __slots__ = ("rotary", "reason", "records", "used")

    def __init__(self, rotary, reason):
        self.rotary, self.reason, self.records, self.used = rotary, reason, {}, False

    def record(self, role, x, rstd):
        if role in self.records:
            self.reason = f"its {role} norm ran twice in one call"
        self.records[role] = (x, x._version, rstd)


def _open_call(module, args, kwargs):
    """Forward pre-hook of an attention module with fused q/k norms: opens the call record."""
    if torch.compiler.is_compiling():
        return None
    rotary = kwargs.get("position_embeddings")
    index = module.__dict__.get("remat_qk_rotary_index")
    if rotary is None and index is not None and index < len(args):
        rotary = args[index]
    call = _Call(rotary, _cache_reason(module, args, kwargs))
    module.__dict__["remat_qk_call"] = call
    norms = [module._modules.get(name) for name in module.__dict__.get("remat_qk_norms", ())]
    for norm in filter(None, norms):
        norm.__dict__["remat_qk_call"] = call
    # ZeRO-3: the attention's backward rebuilds q and k with the norms' weights; lent to it before its own
    # pre-forward hook (registered later than this one) gathers its parameters, then in its backward
    zero3.lend(list(filter(None, norms)), [module])
    return None


def _close_call(module, args, output):
    """Forward hook (always called): the call record is dropped, and with it its tensors."""
    module.__dict__.pop("remat_qk_call", None)
    for name in module.__dict__.get("remat_qk_norms", ()):
        norm = module._modules.get(name)
        if norm is not None:
            norm.__dict__.pop("remat_qk_call", None)
    return None


# Neither hook reads nor changes the module's hidden states: a norm fused into the module's
# projections (modules.Handoff) stays fused across them.
_open_call.remat_reads_no_hidden_states = _close_call.remat_reads_no_hidden_states = True


def _cache_reason(module, args, kwargs):
    """Why the keys this call hands the attention may not be this call's own: a cache holding past
    keys for this layer (an empty one, as transformers makes in training, gives them unchanged)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            continue
        length = getattr(value, "get_seq_length", None)
        if callable(length) and length(getattr(module, "layer_idx", 0) or 0) > 0:
            return "a cache holds past keys"
    return None


def fused_attention(module, query, key, value, causal, scaling, features, varlen=None):
    """o of this attention call with its q/k norms fused (_NormRopeAttention): (batch, heads, seq,
    head_dim), or with `varlen` (packed sequences or padding: VarlenTokens) the (tokens, heads,
    head_dim) of remat.attention_varlen, `value` given as its tokens. None where the caller runs
    remat's attention on the query and key it was handed (no fused norms, no grad, or a reason,
    recorded). features: (window_left, window_right, softcap, dropout_p)."""
    call = module.__dict__.get("remat_qk_call")
    if call is None or call.used or not torch.is_grad_enabled():
        return None
    call.used = True
    reason = call.reason or _call_reason(module, call, query, key, value)
    if reason is not None:
        fallback(module, f"q/k norms not fused: {reason}", where=_where(module),
                 runs="remat's attention on the q and k of its stock rope")
        return None
    (x_q, _, rstd_q), (x_k, _, rstd_k) = call.records["q"], call.records["k"]
    x_q, x_k, value = own_views(x_q, x_k, value)  # each keeps its own part of a fused projection's output
    q_norm, k_norm = (module._modules[name] for name in module.__dict__["remat_qk_norms"])
    cos, sin = call.rotary
    window_left, window_right, softcap, dropout_p = features
    scale, op_features = checked_call(query, causal, False, scaling, window_left, window_right, softcap, None,
                                      dropout_p)
    core = _DenseCore(causal, scale, op_features) if varlen is None else _VarlenCore(varlen, causal, scale,
                                                                                      op_features)
    specs = (_spec(q_norm), _spec(k_norm))
    return _NormRopeAttention.apply(query.detach(), key.detach(), x_q, x_k, value, q_norm.weight, k_norm.weight,
                                    rstd_q, rstd_k, cos, sin, specs, core)


# The tokens remat.attention_varlen reads of a (batch, heads, seq, head_dim) q and k: the flat
# (batch x seq) indices of the kept ones (None: all, packed sequences), the cu_seqlens and longest
# sequence of the queries and keys.
VarlenTokens = collections.namedtuple("VarlenTokens", "indices cu_q cu_k max_q max_k")


def own_views(query, key, value):
    """q, k and v, each a copy of itself where it is a view of a larger tensor that the three views of
    it do not cover: a fused qkv projection's output whose other parts were copied (the rotary
    embedding copies q and k: Phi-3, GPT-NeoX; a cache being filled copies k and v: GPT-2 in training,
    whose use_cache defaults to True). The attention keeps q, k and v for its backward, and a view
    keeps the whole projection output alive with it; its copy keeps its own part only. No copy
    without grad (nothing is kept) or while torch.compile traces (the graph's views are its own)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return query, key, value
    tensors = (query, key, value)
    covered = collections.Counter()  # id of a base -> the elements of it q, k and v view
    for t in tensors:
        if t._base is not None:
            covered[id(t._base)] += t.numel()
    return tuple(t if t._base is None or t._base.numel() <= covered[id(t._base)]
                 else t.clone(memory_format=torch.contiguous_format) for t in tensors)


class _DenseCore:
    """remat.attention's kernels on (batch, heads, seq, head_dim) q, k and v."""

    def __init__(self, causal, scale, features):
        self.causal, self.scale, self.features = causal, scale, features

    def tokens(self, t):
        return t

    def from_tokens(self, g, shape):
        return g

    def forward(self, q, k, v):
        return attention_fwd(_unit_last_stride(q), _unit_last_stride(k), v, self.causal, self.scale, *self.features)

    def backward(self, do, q, k, v, o, lse):
        backward = _attention_bwd_ref if backward_is_differentiated() else attention_bwd
        return backward(_unit_last_stride(do), _unit_last_stride(q), _unit_last_stride(k), v, o, lse, self.causal,
                        self.scale, *self.features)


class _VarlenCore(_DenseCore):
    """remat.attention_varlen's kernels on the tokens of q and k (VarlenTokens); v given as tokens."""

    def __init__(self, varlen, causal, scale, features):
        super().__init__(causal, scale, features)
        self.varlen = varlen

    def tokens(self, t):
        flat = t.transpose(1, 2).flatten(0, 1)
        return flat if self.varlen.indices is None else flat.index_select(0, self.varlen.indices)

    def from_tokens(self, g, shape):
        batch, heads, seq, head_dim = shape
        if self.varlen.indices is not None:  # the tokens left out (padding) get no gradient, as in stock
            g = g.new_zeros(batch * seq, heads, head_dim).index_copy(0, self.varlen.indices, g)
        return g.view(batch, seq, heads, head_dim).transpose(1, 2)

    def forward(self, q, k, v):
        t = self.varlen
        return attention_varlen_fwd(_unit_last_stride(self.tokens(q)), _unit_last_stride(self.tokens(k)), v, t.cu_q,
                                    t.cu_k, t.max_q, t.max_k, self.causal, self.scale, *self.features)

    def backward(self, do, q, k, v, o, lse):
        t = self.varlen
        backward = _attention_varlen_bwd_ref if backward_is_differentiated() else attention_varlen_bwd
        dq, dk, dv = backward(_unit_last_stride(do), _unit_last_stride(self.tokens(q)),
                              _unit_last_stride(self.tokens(k)), v, o, lse, t.cu_q, t.cu_k, t.max_q, t.max_k,
                              self.causal, self.scale, *self.features)
        return self.from_tokens(dq, q.shape), self.from_tokens(dk, k.shape), dv


def _spec(norm):
    return NormSpec(norm.remat_style, _eps(norm), norm.__dict__["remat_qk_layout"])


def _where(module):
    path = module.__dict__.get("remat_attention_path")
    return f"{path} ({type(module).__name__})" if path else None


def not_fused(module, reason):
    """Record, for a call with fused q/k norms that no fused path computes, why (grad enabled)."""
    call = module.__dict__.get("remat_qk_call")
    if call is not None and not call.used and torch.is_grad_enabled():
        call.used = True
        fallback(module, f"q/k norms not fused: {reason}", where=_where(module),
                 runs="remat's attention on the q and k of its stock rope")


def _call_reason(module, call, query, key, value):
    """Why this call's query and key may not be the rope(norm(x)) its norms recorded, or None."""
    if set(call.records) != {"q", "k"}:
        missing = " and ".join(r for r in ("q", "k") if r not in call.records)
        return f"its {missing} norm did not run remat's forward in this call"
    rotary = call.rotary
    if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2 and all(isinstance(t, torch.Tensor)
                                                                         for t in rotary)):
        return "no (cos, sin) position_embeddings handed to the module"
    if any(t.requires_grad for t in rotary):
        return "its rotary tables require grad"
    if autocast_dtype_for(query) is not None:
        return "autocast is on"
    if not (query.dtype == key.dtype == value.dtype):
        return "q, k and v differ in dtype"
    for role, handed in (("q", query), ("k", key)):
        x, version, _ = call.records[role]
        norm = module._modules[module.__dict__["remat_qk_norms"][role == "k"]]
        if x._version != version:
            return f"the {role} norm's input was modified in place"
        if _heads_shape(x, norm.__dict__["remat_qk_layout"], handed.shape[1]) != tuple(handed.shape):
            return f"{role} is not the {role} norm's output in the layout checked at convert time"
    return None


class _NormRopeAttention(torch.autograd.Function):
    """remat's attention (`core`: _DenseCore or _VarlenCore) over q = rope(q_norm(x_q)),
    k = rope(k_norm(x_k)), keeping x_q, x_k, v, o, lse and the norms' rstds. The forward's kernel
    reads the q and k the model made (which the backward's rebuild equals bitwise: checked at
    convert time); they are handed in detached, so that their graph (the stock rope) is freed with
    them. The core holds the few-byte rest (the cu_seqlens, a dropout seed)."""

    @staticmethod
    def forward(ctx, query, key, x_q, x_k, value, w_q, w_k, rstd_q, rstd_k, cos, sin, specs, core):
        value = _unit_last_stride(value)
        o, lse = core.forward(query, key, value)
        ctx.save_for_backward(x_q, x_k, value, o, lse, w_q, w_k, rstd_q, rstd_k, cos, sin)
        ctx.specs, ctx.core = specs, core
        ctx.heads, ctx.dtype = (query.shape[1], key.shape[1]), query.dtype
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        x_q, x_k, value, o, lse, w_q, w_k, rstd_q, rstd_k, cos, sin = ctx.saved_tensors
        (q_spec, k_spec), (heads, kv_heads) = ctx.specs, ctx.heads
        q = rebuild(x_q, w_q, rstd_q, q_spec, heads, cos, sin, ctx.dtype)
        k = rebuild(x_k, w_k, rstd_k, k_spec, kv_heads, cos, sin, ctx.dtype)
        dq, dk, dv = ctx.core.backward(do, q, k, value, o, lse)
        dx_q, dw_q = _rebuilt_backward(dq, x_q, w_q, rstd_q, q_spec, cos, sin)
        dx_k, dw_k = _rebuilt_backward(dk, x_k, w_k, rstd_k, k_spec, cos, sin)
        needs = ctx.needs_input_grad
        return (None, None, dx_q if needs[2] else None, dx_k if needs[3] else None, dv if needs[4] else None,
                dw_q if needs[5] else None, dw_k if needs[6] else None, *([None] * 6))


# ---------------------------------------------------------------------------------------------
# Convert time: found by structure, checked by a replay
# ---------------------------------------------------------------------------------------------


def fuse_qk_norms(attention, structure, options, path, report, verdicts):
    """Fuse the q/k norms of the transformers module `attention` (any module the probe saw whose
    forward feeds two RMSNorms from its projections and hands their outputs on through functions
    only) into its attention calls; the names of the norms handled (fused, or reported as not).
    Each module is replayed on its own weights (a layer's forward may take another path than the
    next one's: AFMoE's global layers apply no rotary embedding); on meta, where nothing can be
    computed, on a CPU copy once per kind of module (verdicts: {kind: verdict}, one conversion's)."""
    # transformers' output recorders (output_router_logits, output_attentions) read what the attention
    # module returns, which the fusion leaves as it is
    if not options.wants("attention") or not from_transformers(type(attention)) or _between_reason(attention):
        return set()
    frame = structure.frame(attention)
    if frame is None or frame.hidden_states() is None:
        return set()
    candidates = _candidates(structure, frame, attention)
    if len(candidates) != 2:
        return set()
    reason = None
    if "forward" in vars(attention):
        reason = "its forward is replaced on the instance"
    hooked = {name: hook_reason(attention._modules[name]) for name in candidates}
    reason = reason or next((f"{name} {why}" for name, why in hooked.items() if why), None)
    styles = {name: structure_probe.rms_style(attention._modules[name]) for name in candidates}
    reason = reason or next((f"{name}: {why}" for name, (style, why) in styles.items() if style is None), None)
    styles = {n: s for n, (s, _) in styles.items()}
    if reason is None:
        if frame.hidden_states().is_meta:
            kind = _kind(attention, candidates, frame)
            if kind not in verdicts:
                verdicts[kind] = _replay_verdict(attention, frame, styles)
            roles, reason = verdicts[kind]
        else:
            roles, reason = _replay_verdict(attention, frame, styles)
    if reason is not None:
        for name in candidates:
            report.add(join(path, name), attention._modules[name], "skipped", f"q/k norm not fused: {reason}")
        return set(candidates)
    _install(attention, roles, styles, frame.hidden_states().dtype, path, report)
    return set(candidates)


def _candidates(structure, frame, attention):
    """The names of the norm children whose input is a Linear-like child's output (through views)
    and whose output only functions read, and the forward does not return."""
    names = []
    for name, child in attention._modules.items():
        if child is None or is_converted(child) or not structure_probe.is_norm(child) or type(child) is nn.LayerNorm:
            continue
        node = structure_probe.norm_node(frame, name)
        if node is None or not _from_projection(frame, attention, node.inputs):
            continue
        uses, returned = frame.uses(node.outputs[0])
        if not returned and uses and all(u.kind == "function" for u in uses):
            names.append(name)
    return names


def _from_projection(frame, module, inputs):
    """Whether the one tensor in `inputs` is a Linear-like child's output, or a view of one."""
    if len(inputs) != 1:
        return False
    tensor_id = inputs[0]
    for node in reversed(frame.nodes):
        if tensor_id not in node.outputs:
            continue
        if node.kind == "module":
            child = module._modules.get(node.name)
            return child is not None and widths(_stock(child)) is not None
        if node.name in _VIEWS and node.inputs:
            tensor_id = node.inputs[0]
            continue
        return False
    return False


def _stock(module):
    """A converted module's stock self (a projection with the layer's norm fused in is a Linear)."""
    return module.remat_revert() if is_converted(module) else module


def _kind(attention, candidates, frame):
    """What a replay's verdict on meta depends on: the classes, the norms' widths, the shapes and
    dtypes of the arguments the probe called the module with, and the module's plain attributes
    (AFMoE's is_local_attention, a sliding window) but its layer index (which picks its cache)."""
    norms = tuple((n, type(attention._modules[n]), tuple(attention._modules[n].weight.shape)) for n in candidates)
    args = tuple((tuple(t.shape), t.dtype) for t in structure_probe._tensors((frame.args, frame.kwargs)))
    plain = tuple(sorted((name, value) for name, value in vars(attention).items()
                         if not name.startswith(("_", "remat_")) and name != "layer_idx"
                         and isinstance(value, (bool, int, float, str, type(None)))))
    return type(attention), norms, args, plain


def _replay_verdict(attention, frame, styles):
    """(roles {"q": (name, layout), "k": (name, layout)}, None) when a replay of `attention` with its
    norms fused hands the attention interface exactly rebuild()'s q and k (bitwise, in the dtype of
    the probe's hidden states: the norms fuse in that dtype only); else (None, why not)."""
    try:
        return _replay(attention, frame, styles)
    except Exception as error:  # noqa: BLE001 - a forward this replay cannot call: not fused
        return None, f"its convert-time replay failed ({type(error).__name__}: {error})"


def _replay(attention, frame, styles):
    """One replay (see _replay_verdict): on the module's own weights and the probe's arguments, or on
    meta on a CPU copy with random weights and arguments."""
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE_NAME, _capture)
    dtype = frame.hidden_states().dtype
    on_meta = frame.hidden_states().is_meta
    twin = _cpu_twin(attention, dtype) if on_meta else _shallow_twin(attention)
    twin.config = copy.deepcopy(attention.config)
    twin.config._attn_implementation = _PROBE_NAME
    _swap_norms(twin, {name: (name, styles[name], "bhsd", dtype) for name in styles})  # (the layout: found below)
    _hook(twin, tuple(styles), _rotary_index(attention))
    args, kwargs = _materialised((frame.args, frame.kwargs), dtype) if on_meta else (frame.args, frame.kwargs)
    with torch.no_grad(), structure_probe._eval(twin):
        twin(*args, **kwargs)
    captured = twin.__dict__.pop("remat_qk_captured", None)
    if captured is None:
        return None, "its forward did not call the attention interface"
    query, key, call = captured
    if call is None or set(call.records) != set(styles) or call.rotary is None:
        return None, "its norms or position_embeddings were not seen in the call of the attention interface"
    roles = {}
    for role, handed in (("q", query), ("k", key)):
        taken = {name for name, _ in roles.values()}
        match = next(((name, layout) for name in styles for layout in LAYOUTS
                      if name not in taken and _rebuilds(call, twin._modules[name], layout, handed)), None)
        if match is None:
            return None, (f"the {role} the attention is handed is not rope(norm(x)) as remat rebuilds it (no rotary "
                          f"embedding, one other than rotate_half's over the whole head, or another rounding)")
        roles[role] = match
    return roles, None


def _shallow_twin(module):
    """`module` with its own children dict and hooks (the same children, parameters and buffers; a
    converted child as its stock module), for a replay that changes neither."""
    twin = copy.copy(module)
    twin._modules = {name: _stock(child) if child is not None else None for name, child in module._modules.items()}
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
        setattr(twin, name, collections.OrderedDict())
    return twin


def _rebuilds(call, norm, layout, handed):
    """Whether rebuild() of the (replay's) `norm`'s recorded input, laid out as `layout`, is `handed`
    bitwise."""
    x, _, rstd = call.records[norm.__dict__["remat_qk_role"]]
    if _heads_shape(x, layout, handed.shape[1]) != tuple(handed.shape):
        return False
    cos, sin = call.rotary
    rebuilt = rebuild(x, norm.weight, rstd, NormSpec(norm.remat_style, _eps(norm), layout), handed.shape[1], cos, sin,
                      handed.dtype)
    return rebuilt.dtype == handed.dtype and torch.equal(rebuilt, handed)


def _capture(module, query, key, value, attention_mask, **kwargs):
    """The replay's attention function: keeps the query, key and the call record; returns zeros."""
    module.__dict__["remat_qk_captured"] = (query, key, module.__dict__.get("remat_qk_call"))
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def _cpu_twin(module, dtype):
    """A copy of `module` on the CPU in `dtype`, its parameters and buffers random near 1 (seeded),
    made without copying its (perhaps large, perhaps meta) tensors."""
    memo = {}
    for tensor in (*module.parameters(), *module.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else empty
    memo[id(getattr(module, "config", None))] = None  # set by the caller
    twin = _stock_children(copy.deepcopy(module, memo)).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tensor in (*twin.parameters(), *twin.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
    return twin.to(dtype)


def _stock_children(module):
    """`module` with every remat module below it back to its stock class (the replay checks the
    module's own forward: a projection a norm is fused into computes the stock Linear there)."""
    for name, child in list(module._modules.items()):
        if child is not None:
            module._modules[name] = _stock_children(_stock(child))
    return module


def _materialised(value, dtype):
    """`value` (nested tuples, lists, dicts) with each tensor a CPU one: floating ones random in
    `dtype` (seeded), others as they are, or ones on meta."""
    generator = torch.Generator().manual_seed(8)

    def convert(item):
        if isinstance(item, torch.Tensor):
            if item.is_floating_point():
                return torch.randn(item.shape, generator=generator).to(dtype)
            return torch.ones(item.shape, dtype=item.dtype) if item.is_meta else item.cpu()
        if isinstance(item, tuple):
            return tuple(convert(i) for i in item)
        if isinstance(item, list):
            return [convert(i) for i in item]
        if isinstance(item, dict):
            return {k: convert(i) for k, i in item.items()}
        return item

    return convert(value)


def _rotary_index(attention):
    """The position of position_embeddings among the forward's positional arguments, or None."""
    try:
        names = list(inspect.signature(attention.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("position_embeddings") if "position_embeddings" in names else None


def _swap_norms(attention, fused):
    """Swap the norms `fused` ({name: (role, style, layout, the input dtype checked)}) of `attention`
    to _RematHeadNorm."""
    for name, (role, style, layout, dtype) in fused.items():
        norm = attention._modules[name]
        new = with_class(norm, remat_class(_RematHeadNorm, type(norm), remat_style=style))
        new.__dict__.update(remat_qk_role=role, remat_qk_layout=layout, remat_qk_dtype=dtype)
        attention._modules[name] = new


def _hook(attention, names, rotary_index):
    """The attention's call record: its norms' names by role order (q's, k's) and the hooks."""
    attention.__dict__["remat_qk_norms"] = names
    attention.__dict__["remat_qk_rotary_index"] = rotary_index
    attention.register_forward_pre_hook(_open_call, with_kwargs=True)
    attention.register_forward_hook(_close_call, always_call=True)


def _install(attention, roles, styles, dtype, path, report):
    (q_name, q_layout), (k_name, k_layout) = roles["q"], roles["k"]
    _swap_norms(attention, {q_name: ("q", styles[q_name], q_layout, dtype),
                            k_name: ("k", styles[k_name], k_layout, dtype)})
    for name in (q_name, k_name):
        attention._modules[name].__dict__["remat_path"] = join(path, name)
    _hook(attention, (q_name, k_name), _rotary_index(attention))
    for role, name in (("q", q_name), ("k", k_name)):
        norm = attention._modules[name]
        report.add(join(path, name), norm, f"swapped to {type(norm).__name__}",
                   f"{role} norm fused into remat's attention: it keeps {name}'s input and a fp32 rstd a row, "
                   f"not {role} after the rope nor an fp32 copy; norm and rope rebuilt in the backward",
                   _saving(attention, norm))


def _saving(attention, norm):
    """saves() of a fused norm's row: bytes per token the stock norm keeps beyond its input and its
    rstd (its fp32 copy of x, its normalised x), where the attention's parameters train."""
    width = norm.weight.shape[0]
    per_token = {}

    def saves():
        if not any(p.requires_grad for p in attention.parameters()):
            return 0
        dtype = norm.weight.dtype
        if dtype not in per_token:
            per_token[dtype] = _stock_norm_bytes(norm, width, dtype)
        return per_token[dtype] * _rows_per_token(attention, norm, width)

    return saves


def _rows_per_token(attention, norm, width):
    """How many norm rows a token has: one per head for a per-head norm (its width a head's), else one."""
    role = norm.__dict__["remat_qk_role"]
    heads = _heads_of(attention, role)
    return heads if heads and width * heads == _projection_width(attention, role) else 1


def _heads_of(attention, role):
    config = getattr(attention, "config", None)
    name = "num_attention_heads" if role == "q" else "num_key_value_heads"
    value = getattr(config, name, None)
    return value if isinstance(value, int) else None


def _projection_width(attention, role):
    config = getattr(attention, "config", None)
    head_dim = getattr(attention, "head_dim", None) or getattr(config, "head_dim", None)
    heads = _heads_of(attention, role)
    return head_dim * heads if isinstance(head_dim, int) and heads else None


def _stock_norm_bytes(norm, width, dtype):
    """Bytes per row the stock module's forward saves but one fp32 rstd, counted (saved-tensor hooks)
    on a CPU copy: its input where it keeps that itself (fp32), an fp32 copy of it (else), its
    normalised x. The fused attention keeps the input in place of the post-rope q or k, as many bytes."""
    twin = _cpu_twin(norm, dtype)
    twin.__class__ = norm.remat_stock

    def kept(rows):
        x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
        return saved_bytes(lambda: twin(x), exclude=list(twin.parameters()))

    return (kept(8) - kept(4)) // 4 - 4  # per row (a per-call constant, Gemma's 1 + w, drops out)


# ---------------------------------------------------------------------------------------------
# Revert
# ---------------------------------------------------------------------------------------------


def unhook(module):
    """Remove the hooks and call record fuse_qk_norms gave the attention `module` (remat.revert; its
    norms go back to their stock classes by their own remat_revert)."""
    if module.__dict__.pop("remat_qk_norms", None) is None:
        return
    module.__dict__.pop("remat_qk_rotary_index", None)
    module.__dict__.pop("remat_qk_call", None)
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, hook in hooks.items() if hook in (_open_call, _close_call)]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):
                getattr(module, extra, {}).pop(key, None)


def unfuse(model, report, why):
    """Give every attention of `model` whose q/k norms fuse_qk_norms fused its stock norms back, their
    report rows "skipped" with `why` (remat's attention function, which the fusion needs, is not the
    model's)."""
    from ..report import ReportRow

    paths = {}
    for module in model.modules():
        names = module.__dict__.get("remat_qk_norms")
        if names is None:
            continue
        unhook(module)
        for name in names:
            norm = module._modules[name]
            paths[norm.__dict__.get("remat_path")] = type(norm).__name__, norm.remat_stock.__name__
            module._modules[name] = norm.remat_revert()
    for i, row in enumerate(report):
        fused, stock = paths.get(row.path, (None, None))
        if row.type == fused:
            report[i] = ReportRow(row.path, stock, "skipped", f"q/k norm not fused: {why}")
