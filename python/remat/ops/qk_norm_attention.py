"""q/k norms fused into remat's attention, the computation (convert/hf/head_norm.py finds the norms and
installs the modules that call it): the attention keeps the projections' outputs x_q, x_k (what the
norms read) and the norms' fp32 rstd instead of q and k, and rebuilds q = rope(q_norm(x_q)) and
k = rope(k_norm(x_k)) in its backward, bitwise as the model's forward made them.

- HeadNormFunction: a q or k RMSNorm as the stock module's operations, keeping x and rstd only;
- NormRopeAttention: remat's attention kernels (DenseCore: remat.attention's; VarlenCore:
  remat.attention_varlen's on the tokens of a padded or packed batch) on the q and k the model made,
  keeping x_q, x_k, v, o, lse and the rstds; its backward rebuilds q and k (rebuild), runs the
  attention backward, then the rope's transpose and the RMSNorm backward;
- own_views: q, k and v copied out of a fused projection's output they do not cover.

The norm and rope are PyTorch ops in the order of transformers' (apply_rotary_pos_emb), with their
transposes written out; the RMSNorm backward is remat's (its kernels; the differentiable reference
under create_graph=True).
"""

import collections
import dataclasses

import torch
from torch.autograd.function import once_differentiable

from .._backend import backward_is_differentiated
from .._validate import rows_with_unit_stride
from .attention import _attention_bwd_ref, _unit_last_stride, attention_bwd, attention_fwd
from .attention_varlen import _attention_varlen_bwd_ref, attention_varlen_bwd, attention_varlen_fwd
from .rms_norm import output_dtype, rms_norm_bwd, rms_norm_bwd_ref, rms_norm_output_ref, rms_norm_rstd_ref

# How a norm's output y becomes the attention's (batch, heads, seq, head_dim) before the rope:
# "bshd": y is (batch, seq, heads, head_dim) (Qwen3: the norm reads the projection viewed as heads);
# "flat": y is (batch, seq, heads * head_dim) (OLMo2: the norm spans every head);
# "bhsd": y is the attention's layout already (Gemma3: the norm reads the transposed view).
LAYOUTS = ("bshd", "flat", "bhsd")




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


def heads_shape(x, layout, heads):
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
# The head norm and the attention, as autograd Functions
# ---------------------------------------------------------------------------------------------


class HeadNormFunction(torch.autograd.Function):
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
    base = query._base
    if base is not None and key._base is base and value._base is base and \
            base.numel() <= query.numel() + key.numel() + value.numel():
        return tensors  # views covering one tensor (a fused qkv projection's output, as GPT-2's): kept as a whole
    bases = [t._base for t in tensors]
    covered = {}  # id of a base -> the elements of it q, k and v view
    for t, base in zip(tensors, bases):
        if base is not None:
            covered[id(base)] = covered.get(id(base), 0) + t.numel()
    if not covered:
        return tensors
    return tuple(t if base is None or base.numel() <= covered[id(base)]
                 else t.clone(memory_format=torch.contiguous_format) for t, base in zip(tensors, bases))



class DenseCore:
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


class VarlenCore(DenseCore):
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



class NormRopeAttention(torch.autograd.Function):
    """remat's attention (`core`: DenseCore or VarlenCore) over q = rope(q_norm(x_q)),
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
