"""Attention over packed variable-length sequences: reference, custom ops, public function.

remat.attention_varlen is remat.attention for a batch of sequences of different lengths packed
one after another without padding, in the layout of FlashAttention's flash_attn_varlen_func:
q (total_q, heads, head_dim) and k, v (total_k, kv_heads, head_dim), sequence b's rows being
cu_seqlens[b]:cu_seqlens[b + 1] (int32 cumulative lengths starting at 0). Each sequence attends
only to itself, with every convention of remat.attention applied per sequence (causal masks
bottom-right aligned to that sequence's lengths, GQA, windows, softcapping, ALiBi, dropout). The
Triton kernels are remat.attention's, with the sequence bounds read per program; autograd keeps q,
k, v, o, the fp32 lse (heads, total_q) and the two cu_seqlens, and the backward recomputes the
probabilities. Empty sequences are allowed; key blocks past a sequence's end are never visited.
Under backend "cuda" the CUDA extension's kernels run packed sequences too (remat.attention's
cuda_kernel_takes says which calls).
"""

import math

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from .. import _backend
from .._numerics import math_dtype
from .._validate import autocast_dtype_for, cast_for_autocast, check_float_tensor, check_same_device, integer
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves
from .attention import (
    HEAD_DIMS,
    REFERENCE_FALLBACK,
    _check_alibi_slopes,
    _check_dropout_p,
    _check_softcap,
    _check_window_size,
    _fallback_reason,
    _unit_last_stride,
    _visible_mask,
    _warn_fallback_once,
    attention_grads_ref,
    attention_ref,
    checked_call,
    cuda_kernel_takes,
    sample_dtype,
)

# ---------------------------------------------------------------------------------------------
# Reference: remat.attention's reference on each sequence, in its math dtype (float64 for float64)
# ---------------------------------------------------------------------------------------------


def _bounds(cu_seqlens_q, cu_seqlens_k):
    """(q start, q end, k start, k end) of each sequence (reads the cu_seqlens: a synchronisation)."""
    q, k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return list(zip(q[:-1], q[1:], k[:-1], k[1:]))


def _sequence(t, start, end):
    """Rows start:end of a packed (total, H, D) tensor as remat.attention takes one: (1, H, end - start, D)."""
    return t[start:end].transpose(0, 1).unsqueeze(0)


def _packed(t):
    """(1, H, L, D) -> (L, H, D): back to the packed layout."""
    return t[0].transpose(0, 1)


def _slopes_of(alibi_slopes, index):
    """The ALiBi slopes of sequence `index`: (H,) shared slopes, or row `index` of (B, H) ones, as (1, H)."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[index:index + 1]


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, window_left=-1,
                         window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    """(o, lse): o (total_q, H, D) in q's dtype, lse (H, total_q) in the math dtype; differentiable.

    remat.ops.attention.attention_ref on each sequence (materialising its Sq x Sk scores), dropout
    with the kernels' mask for sequence b's batch index b.
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    # Empty first pieces: the shapes and dtypes of the result when there is no sequence at all.
    outputs, lses = [q.new_empty((0, *q.shape[1:]))], [q.new_empty((q.shape[1], 0), dtype=math_dtype(q))]
    for index, (q0, q1, k0, k1) in enumerate(_bounds(cu_seqlens_q, cu_seqlens_k)):
        o, lse = attention_ref(_sequence(q, q0, q1), _sequence(k, k0, k1), _sequence(v, k0, k1), causal,
                               softmax_scale, window_left, window_right, softcap, _slopes_of(alibi_slopes, index),
                               dropout_p, dropout_seed, dropout_first_batch=index)
        outputs.append(_packed(o))
        lses.append(lse[0])
    return torch.cat(outputs), torch.cat(lses, dim=1)


def _attention_varlen_fwd_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                              max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                              window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                              alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                              dropout_seed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(o, lse): o (total_q, H, D) contiguous in q's dtype; lse (H, total_q) fp32 natural log."""
    o, lse = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window_left,
                                  window_right, softcap, alibi_slopes, dropout_p, dropout_seed)
    return o.contiguous(), lse.to(torch.float32).contiguous()


def _attention_varlen_bwd_ref(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_varlen_fwd: remat.attention's reference backward on each sequence."""
    grads = [[t.new_empty((0, *t.shape[1:]))] for t in (q, k, v)]
    for index, (q0, q1, k0, k1) in enumerate(_bounds(cu_seqlens_q, cu_seqlens_k)):
        dq, dk, dv = attention_grads_ref(
            _sequence(do, q0, q1), _sequence(q, q0, q1), _sequence(k, k0, k1), _sequence(v, k0, k1),
            _sequence(o, q0, q1), causal, softmax_scale, window_left, window_right, softcap,
            _slopes_of(alibi_slopes, index), dropout_p, dropout_seed, dropout_first_batch=index)
        for collected, grad in zip(grads, (dq, dk, dv)):
            collected.append(_packed(grad))
    return tuple(torch.cat(collected) for collected in grads)


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd
# ---------------------------------------------------------------------------------------------


def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                               window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                               dropout_seed=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _attention_varlen_bwd_fake(do, q, k, v, o, lse, *_):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
     window_right, softcap, alibi_slopes, dropout_p, dropout_seed) = inputs
    o, lse = output
    # As remat.attention's: the slopes and the seed are a few bytes; so are the cu_seqlens (4 bytes
    # per sequence). The dropout mask is regenerated in the backward.
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
    ctx.scalars = max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap
    ctx.dropout_p = dropout_p
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed = ctx.saved_tensors
    if do.stride(-1) != 1:
        do = do.contiguous()  # the kernels read rows with unit stride
    # Under create_graph=True the reference's differentiable formula, as remat.attention's backward.
    backward = _attention_varlen_bwd_ref if _backend.backward_is_differentiated() else attention_varlen_bwd
    dq, dk, dv = backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.scalars, alibi_slopes, ctx.dropout_p,
                          dropout_seed)
    return (dq, dk, dv) + (None,) * 12


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def _check_packed_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        check_same_device(name, t, "q", q)
    heads, head_dim = q.shape[1:]
    if head_dim < 1:
        raise ValueError(f"q must have head_dim >= 1, got shape {tuple(q.shape)}")
    if heads < 1:
        raise ValueError(f"q has no heads: it must be (total_tokens, heads >= 1, head_dim), got shape "
                         f"{tuple(q.shape)}")
    if k.shape[2] != head_dim:
        raise ValueError(f"k must have shape (total_k, kv_heads, {head_dim}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[1] < 1 or heads % k.shape[1] != 0:
        raise ValueError(f"k and v must have a number of heads dividing q's {heads}, got {k.shape[1]}")


def _check_cu_seqlens(name, cu_seqlens, q):
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (as FlashAttention's), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (batch + 1,), got shape {tuple(cu_seqlens.shape)}")
    check_same_device(name, cu_seqlens, "q", q)


def _check_max_seqlen(name, value):
    length = integer(value)
    if length is None or length < 0:
        raise ValueError(f"{name} must be an int >= 0 (the longest sequence), got {value!r}")
    return length


def _readable(t):
    """Whether t's values may be read here: not while tracing (torch.compile, fake or meta tensors)."""
    return not (torch.compiler.is_compiling() or isinstance(t, FakeTensor) or t.device.type == "meta")


def _check_sequences(name, cu_seqlens, total, max_seqlen, max_name):
    """cu_seqlens starts at 0, never decreases, ends at `total`, and no sequence exceeds max_seqlen
    (the kernels' grid covers max_seqlen rows per sequence: a longer one would lose rows silently)."""
    values = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if values[0] != 0 or any(length < 0 for length in lengths) or values[-1] != total:
        raise ValueError(f"{name} must start at 0, never decrease and end at {total} (the rows of its tensor), "
                         f"got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} must be at least the longest sequence of {name}, {max(lengths)}, "
                         f"got {max_seqlen}")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                     softmax_scale=None, return_lse=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     dropout_p=0.0):
    """remat.attention over packed variable-length sequences, as FlashAttention's flash_attn_varlen_func.

    q: (total_q, heads, head_dim); k, v: (total_k, kv_heads, head_dim), kv_heads dividing heads.
    cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), the cumulative sequence lengths (0 first, the
    total last; empty sequences allowed): sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of
    q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v, and attends to nothing else.
    max_seqlen_q, max_seqlen_k: ints at least the longest sequence's length (they size the grid).
    Returns o (total_q, heads, head_dim), and with return_lse=True the fp32 log-sum-exp (heads,
    total_q) too. causal, softmax_scale, window_size, softcap and dropout_p as remat.attention's,
    per sequence (causal bottom-right aligned to each sequence's two lengths); alibi_slopes fp32
    (heads,) or (batch, heads), batch counting the sequences.

    The cu_seqlens are checked against the totals and max_seqlen once per call, outside
    torch.compile (reading them synchronises with the GPU; FlashAttention does not check).
    """
    dtype = autocast_dtype_for(q)
    if dtype is not None:  # as remat.attention: computed in the autocast dtype
        with torch.autocast(q.device.type, enabled=False):
            return attention_varlen(*cast_for_autocast(dtype, q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, return_lse, window_size, softcap,
                                    alibi_slopes, dropout_p)
    _check_packed_qkv(q, k, v)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have cu_seqlens_q's shape {tuple(cu_seqlens_q.shape)} (one entry per "
                         f"sequence and one more), got {tuple(cu_seqlens_k.shape)}")
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if _readable(cu_seqlens_q):
        _check_sequences("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        _check_sequences("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    window_left, window_right = _check_window_size(window_size)
    softcap = _check_softcap(softcap)
    _check_alibi_slopes(alibi_slopes, q, cu_seqlens_q.shape[0] - 1, q.shape[1], batch_is="sequences")
    dropout_p = _check_dropout_p(dropout_p)
    softmax_scale, features = checked_call(q, causal, return_lse, softmax_scale, window_left, window_right, softcap,
                                           alibi_slopes, dropout_p)
    op_args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, *features)
    reason = _fallback_reason(q, k, v, op_args, FAMILY)
    if reason is not None:  # the differentiable reference, sequence by sequence
        _warn_fallback_once(reason, "remat.attention_varlen", REFERENCE_FALLBACK)
        o, lse = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, *features)
        return (o, lse.detach().to(torch.float32)) if return_lse else o
    o, lse = attention_varlen_fwd(_unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), cu_seqlens_q,
                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, *features)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# The family: remat::attention_varlen_fwd and remat::attention_varlen_bwd
# ---------------------------------------------------------------------------------------------


def cu_seqlens_of(lengths, device=None):
    """The int32 cumulative lengths (0 first) of sequences of `lengths`."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])


def _samples(device):
    """Three sequences (query lengths 3, 0, 6; key lengths 5, 2, 9: an empty one, one whose queries
    outnumber nothing, seqlen_q != seqlen_k), GQA (2 query heads on 1), causal and not, with and
    without a window, softcapping, ALiBi per sequence and dropout; on a GPU every other variant in
    bfloat16 (see remat.ops.attention's samples)."""
    cu_q, cu_k = cu_seqlens_of([3, 0, 6], device), cu_seqlens_of([5, 2, 9], device)
    q = torch.randn(9, 2, 32, device=device)
    k, v = torch.randn(16, 1, 32, device=device), torch.randn(16, 1, 32, device=device)
    seed = torch.tensor([4321], dtype=torch.int64, device=device)
    variants = [(False, ()), (True, ()), (True, (4, -1, 0.0, torch.rand(3, 2, device=device))),
                (False, (3, 5, 2.0, torch.rand(2, device=device))), (True, (-1, -1, 0.0, None, 0.3, seed))]
    forward, backward = [], []
    for index, (causal, features) in enumerate(variants):
        qkv = [t.to(sample_dtype(device, index)) for t in (q, k, v)]
        forward.append((*grad_leaves(*qkv), cu_q, cu_k, 6, 9, causal, 0.25, *features))
        o, lse = _attention_varlen_fwd_ref(*qkv, cu_q, cu_k, 6, 9, causal, 0.25, *features)
        backward.append((torch.randn_like(o), *qkv, o, lse, cu_q, cu_k, 6, 9, causal, 0.25, *features))
    return OpSamples(forward, backward)


def _split(total, first):
    """Lengths of three sequences over `total` rows: `first` (at most total), an empty one, the rest."""
    head = min(first, total)
    return [head, 0, total - head]


def _ours(t):
    """The public call on the validation table's tensors: q split 3 / 0 / rest, k and v 4 / 0 / rest, causal."""
    q, k = t["q"], t["k"]
    lengths_q, lengths_k = _split(q.shape[0], 3), _split(k.shape[0], 4)
    return attention_varlen(q, k, t["v"], cu_seqlens_of(lengths_q, q.device), cu_seqlens_of(lengths_k, q.device),
                            max(lengths_q), max(lengths_k), causal=True)


def _stock(t):
    """The same in stock PyTorch: scaled_dot_product_attention on each sequence (remat's causal mask)."""
    q, k, v = t["q"], t["k"], t["v"]
    outputs, q0, k0 = [], 0, 0
    for length_q, length_k in zip(_split(q.shape[0], 3), _split(k.shape[0], 4)):
        qs, ks, vs = (_sequence(x, start, start + n) for x, start, n in
                      ((q, q0, length_q), (k, k0, length_k), (v, k0, length_k)))
        mask = _visible_mask(length_q, length_k, q.device)
        outputs.append(_packed(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                                enable_gqa=True)))
        q0, k0 = q0 + length_q, k0 + length_k
    return torch.cat(outputs)


FAMILY = OpFamily(
    name="attention_varlen",
    forward_ref=_attention_varlen_fwd_ref,
    backward_ref=_attention_varlen_bwd_ref,
    forward_fake=_attention_varlen_fwd_fake,
    backward_fake=_attention_varlen_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="attention_varlen",
    calls=(PublicCall("attention_varlen", {"q": (7, 4, 32), "k": (9, 2, 32), "v": (9, 2, 32)}, _ours, _stock,
                      inputs=("q", "k", "v")),),
    triton="attention",
    triton_launchers=("attention_varlen_fwd", "attention_varlen_bwd"),
    # Head dims outside HEAD_DIMS run the reference (the first tensor, q or do, ends in the head dim).
    triton_takes=lambda first, *_: first.shape[-1] in HEAD_DIMS,
    # Backend "cuda": the CUDA extension's kernels (csrc/attention_kernels.cuh, packed), which take
    # what they take for remat.attention (half types, head dims to 256).
    cuda=True,
    cuda_takes=cuda_kernel_takes,
    uses_tl_dot=True,
)
attention_varlen_fwd, attention_varlen_bwd = FAMILY.forward, FAMILY.backward
