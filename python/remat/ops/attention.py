"""Attention: reference, custom ops (kernel, fake, autograd), public function.

softmax(scale * q k^T) v over (batch, heads, seq, head_dim) tensors, like
torch.nn.functional.scaled_dot_product_attention, FlashAttention-style: autograd keeps q, k, v,
the output o and one fp32 log-sum-exp per query row; the backward recomputes the probabilities
block by block and never materialises a seqlen_q x seqlen_k matrix.

Conventions (shared by the reference, the Triton kernels and the fallback):
- causal masks are aligned to the bottom-right corner when seqlen_q != seqlen_k
  (FlashAttention >= 2.1): query i sees key j iff j <= i + seqlen_k - seqlen_q. A query row
  that sees no key (seqlen_q > seqlen_k) gets output 0, lse -inf and zero gradients.
- GQA/MQA: k and v may have fewer heads h_kv than q (h_kv dividing h); query head i uses
  key/value head i // (h // h_kv).
- lse is the natural log, fp32 (float64 for float64 input to the reference), and is not
  differentiable (its gradient is taken as zero).

Backends: CUDA tensors run the Triton kernels for backends "auto" and "triton"; backend "cuda"
runs the CUDA extension's own kernels (csrc/attention_kernels.cuh) on what they take (see
cuda_kernel_takes: half or bfloat16, head dims that are a multiple of 8 up to 256, any window,
softcapping, ALiBi or dropout, a GPU of compute capability 8.0 or newer) and the Triton kernels,
with a one-time warning, on the rest. Both draw the same dropout mask (dropout_keep_mask). The
CUDA kernels' backward runs in one pass, adding dQ by fp32 atomics as FlashAttention 2 and
PyTorch's flash backend do (so dQ's last bits vary from run to run), unless
torch.use_deterministic_algorithms(True): then a separate dQ pass, bitwise reproducible, at 7
matrix products a score instead of 5. The Triton kernels' backward is always deterministic. CPU
tensors run the Triton kernel under TRITON_INTERPRET=1, else the reference. Head dims outside
HEAD_DIMS run the reference on CPU; on CUDA, those and GPUs Triton cannot target (compute
capability < 8.0) fall back to torch.nn.functional.scaled_dot_product_attention with a one-time
warning (to the reference when a window, softcapping, ALiBi or dropout is asked for: it computes
each as the kernels do, dropout with the kernels' own mask).

Block sizes on a GPU are autotuned: the first call per (head dim, causal, dtype, GPU, length
class) times a few candidate configurations and keeps the fastest, remembered in
attention-autotune.json in $REMAT_CACHE_DIR (default $XDG_CACHE_HOME/remat or ~/.cache/remat).
REMAT_AUTOTUNE=0 uses the fixed table instead (no timing, the same blocks on every GPU of a
kind, so results are bitwise reproducible across machines). Under the interpreter one small
fixed configuration runs.
"""

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _backend
from .._numerics import math_dtype
from .._validate import (
    autocast_dtype_for,
    cast_for_autocast,
    check_float_tensor,
    check_same_device,
    check_self_attention_input,
    integer,
)
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves

HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the Triton kernels' head dims (see triton_kernels/attention.py)

# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch with an explicit softmax, in fp32 (float64 when given float64).
# ---------------------------------------------------------------------------------------------



def _visible_mask(seqlen_q, seqlen_k, device, window_left=-1, window_right=0):
    """(seqlen_q, seqlen_k) bool, True where query i may see key j: i + Sk - Sq - window_left <= j <=
    i + Sk - Sq + window_right, -1 meaning unbounded. The defaults give the causal mask (bottom-right aligned)."""
    distance = (torch.arange(seqlen_k, device=device)[None, :] - torch.arange(seqlen_q, device=device)[:, None]
                - (seqlen_k - seqlen_q))  # j - (i + Sk - Sq): how far right of row i's diagonal key j lies
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= distance >= -window_left
    if window_right >= 0:
        visible &= distance <= window_right
    return visible


def _expand_kv(t, heads):
    """k or v with its heads repeated to `heads` (GQA: each key/value head serves a group)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _alibi_bias(alibi_slopes, seqlen_q, seqlen_k, dtype):
    """-slope * |i + Sk - Sq - j|, broadcastable to (B, H, Sq, Sk), for slopes (H,) or (B, H)."""
    diagonal = torch.arange(seqlen_q, device=alibi_slopes.device)[:, None] + (seqlen_k - seqlen_q)
    distance = (diagonal - torch.arange(seqlen_k, device=alibi_slopes.device)[None, :]).abs().to(dtype)
    return -alibi_slopes.to(dtype)[..., None, None] * distance


_UINT32 = 0xFFFFFFFF
_PHILOX_KEYS = (0x9E3779B9, 0xBB67AE85)  # Philox-4x32's key increments, as in triton.language.random
_PHILOX_ROUNDS = (0xD2511F53, 0xCD9E8D57)  # its round multipliers


def _mul_hi_lo(constant, x):
    """(high, low) 32-bit words of constant * x for uint32 values in int64 tensors, without overflowing int64."""
    x_hi, x_lo = x >> 16, x & 0xFFFF
    lo_part, hi_part = constant * x_lo, constant * x_hi  # each below 2^48
    high = (hi_part + (lo_part >> 16)) >> 16
    low = (lo_part + ((hi_part & 0xFFFF) << 16)) & _UINT32
    return high, low


def _philox(seed, c0, c1, c2, c3, rounds=10):
    """The four output words of Philox-4x32 (Triton's tl.philox) with key `seed` (a Python int) and
    counters c0..c3 (int64 tensors of uint32 values)."""
    seed &= 2**64 - 1
    k0, k1 = seed & _UINT32, seed >> 32
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUNDS[1], c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUNDS[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEYS[0]) & _UINT32, (k1 + _PHILOX_KEYS[1]) & _UINT32
    return c0, c1, c2, c3


def dropout_keep_mask(seed, batch, heads, seqlen_q, seqlen_k, dropout_p, device=None, first_batch=0):
    """(batch, heads, seqlen_q, seqlen_k) bool: where the kernels' dropout keeps a probability for
    seed (the (1,) int64 tensor the ops take, or an int). The kernels' _dropout_kept in PyTorch: one
    Philox-4x32-10 call per group of positions {q, q + 8} x {k, k + 8} (q and k with bit 3 clear),
    for counter (k, q, batch * heads + head, 0); (query i, key j) takes word 2 (i / 8 % 2) + j / 8 % 2,
    kept when its top 31 bits are at least dropout_p * 2^31. The groups are those a thread's
    tensor-core accumulators hold in the CUDA kernels, queries along the rows or the columns: one
    call serves four scores. first_batch: the batch index of the first one (the sequence index of
    packed sequences, whose positions restart at 0 in each)."""
    seed = int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)
    keys = torch.arange(seqlen_k, device=device)[None, None, :]
    queries = torch.arange(seqlen_q, device=device)[None, :, None]
    slices = (torch.arange(first_batch * heads, (first_batch + batch) * heads, device=device) & _UINT32)[:, None, None]
    words = _philox(seed, keys - (keys & 8), queries - (queries & 8), slices, torch.zeros_like(keys))
    word = 2 * ((queries >> 3) & 1) + ((keys >> 3) & 1)
    bits = torch.where(word < 2, torch.where(word == 0, words[0], words[1]),
                       torch.where(word == 2, words[2], words[3]))
    threshold = min(int(dropout_p * 2**31), 2**31 - 1)  # as the kernels' dropout_threshold
    return ((bits >> 1) >= threshold).view(batch, heads, seqlen_q, seqlen_k)


def _dropped(p, dropout_p, dropout_seed, first_batch=0):
    """p with dropout applied as the kernels do (kept entries scaled by 1 / (1 - dropout_p)); p's
    batch index 0 is first_batch's (see dropout_keep_mask)."""
    if dropout_p == 0:
        return p
    batch, heads, seqlen_q, seqlen_k = p.shape
    kept = dropout_keep_mask(dropout_seed, batch, heads, seqlen_q, seqlen_k, dropout_p, p.device, first_batch)
    return torch.where(kept, p / (1 - dropout_p), 0.0)


def _scores(q, k, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    """The scaled scores in the math dtype, softcapped, with ALiBi, -inf where masked: (B, H, Sq, Sk)."""
    dtype = math_dtype(q)
    s = (q.to(dtype) @ _expand_kv(k, q.shape[1]).to(dtype).transpose(-1, -2)) * softmax_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + _alibi_bias(alibi_slopes, q.shape[2], k.shape[2], dtype)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    visible = _visible_mask(seqlen_q, seqlen_k, q.device, window_left, 0 if causal else window_right)
    return s.masked_fill(~visible, float("-inf"))


def _probabilities(q, k, causal, softmax_scale, *features):
    """(p, lse) in the math dtype: p (B, H, Sq, Sk) with zero rows where nothing is visible.
    features: window_left, window_right, softcap, alibi_slopes (see attention)."""
    s = _scores(q, k, causal, softmax_scale, *features)
    lse = torch.logsumexp(s, dim=-1)
    # A fully masked row has lse = -inf; subtracting 0 there keeps exp(-inf) = 0 instead of NaN. A row
    # with a +inf score keeps lse = +inf, and NaN (inf - inf), as float64 SDPA and the kernels give.
    p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse).unsqueeze(-1))
    return p, lse


def attention_ref(q, k, v, causal=False, softmax_scale=None, window_left=-1, window_right=-1, softcap=0.0,
                  alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_first_batch=0):
    """(o, lse) by an explicit softmax; differentiable, materialises (B, H, Sq, Sk).

    o in q's dtype, lse in fp32 (float64 for float64 input). Used by the tests (in float64) and
    as the CPU fallback without the interpreter. The features as in attention (window_size split
    into window_left and window_right); dropout with the kernels' mask for dropout_seed (q's batch
    0 being batch dropout_first_batch of the mask, see dropout_keep_mask).
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    p, lse = _probabilities(q, k, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    o = _dropped(p, dropout_p, dropout_seed, dropout_first_batch) @ _expand_kv(v, q.shape[1]).to(p.dtype)
    return o.to(q.dtype), lse


def new_output(q):
    """An empty o for q (B, H, Sq, D), laid out in memory as (B, Sq, H, D), as every backend returns it.

    That is the layout the output projection wants: o.transpose(1, 2).reshape(B, Sq, H * D) is
    then a view, so the projection keeps the same storage that attention keeps, not a copy.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    return q.new_empty((batch, seqlen_q, heads, head_dim)).transpose(1, 2)


def _attention_fwd_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, window_left: int = -1,
                       window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                       dropout_p: float = 0.0, dropout_seed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(o, lse): o (B, H, Sq, D) in q's dtype, laid out as (B, Sq, H, D); lse (B, H, Sq) fp32 natural log."""
    o, lse = attention_ref(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                           dropout_p, dropout_seed)
    return new_output(q).copy_(o), lse.to(torch.float32).contiguous()


def _group_sum(t, kv_heads):
    """(B, H, S, D) -> (B, H_kv, S, D): the sum over the query heads of each group."""
    b, h, s, d = t.shape
    return t.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _attention_bwd_ref(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, softmax_scale: float,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0, dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_fwd, recomputing the probabilities from q and k, by the same
    derivation as the kernels (see triton_kernels/attention.py)."""
    return attention_grads_ref(do, q, k, v, o, causal, softmax_scale, window_left, window_right, softcap,
                               alibi_slopes, dropout_p, dropout_seed)


def attention_grads_ref(do, q, k, v, o, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                        alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_first_batch=0):
    """(dq, dk, dv) of attention_ref's o, by the kernels' derivation; dropout_first_batch as there."""
    dtype = math_dtype(q)
    heads, kv_heads = q.shape[1], k.shape[1]
    p, _ = _probabilities(q, k, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    do_f = do.to(dtype)
    v_f = _expand_kv(v, heads).to(dtype)
    dv = _dropped(p, dropout_p, dropout_seed, dropout_first_batch).transpose(-1, -2) @ do_f
    dp = _dropped(do_f @ v_f.transpose(-1, -2), dropout_p, dropout_seed, dropout_first_batch)  # through the same mask
    delta = (do_f * o.to(dtype)).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    if softcap > 0:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
        capped = (q.to(dtype) @ _expand_kv(k, heads).to(dtype).transpose(-1, -2)) * (softmax_scale / softcap)
        ds = ds * (1 - torch.tanh(capped) ** 2)
    dq = (ds @ _expand_kv(k, heads).to(dtype)) * softmax_scale
    dk = (ds.transpose(-1, -2) @ q.to(dtype)) * softmax_scale
    return dq.to(q.dtype), _group_sum(dk, kv_heads).to(k.dtype), _group_sum(dv, kv_heads).to(v.dtype)


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd (the ops themselves are declared at the end of the file)
# ---------------------------------------------------------------------------------------------


def _attention_fwd_fake(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                        alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    batch, heads, seqlen_q, _ = q.shape
    return new_output(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def _attention_bwd_fake(do, q, k, v, o, lse, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                        alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed = inputs
    o, lse = output
    # The slopes (H or B x H floats) and the dropout seed (8 bytes) are saved with the rest: a few
    # bytes, and saved tensors keep working under torch.compile and activation checkpointing. The
    # dropout mask is not: the backward regenerates it from the seed.
    ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, dropout_seed)
    ctx.scalars = causal, softmax_scale, window_left, window_right, softcap
    ctx.dropout_p = dropout_p
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, alibi_slopes, dropout_seed = ctx.saved_tensors
    if do.stride(-1) != 1:
        do = do.contiguous()  # the kernels read rows with unit stride
    # Under create_graph=True the reference's formula, which a second backward can differentiate:
    # it recomputes the probabilities from q and k, and o, a differentiable output, carries its
    # own dependence on q, k and v.
    backward = _attention_bwd_ref if _backend.backward_is_differentiated() else attention_bwd
    dq, dk, dv = backward(do, q, k, v, o, lse, *ctx.scalars, alibi_slopes, ctx.dropout_p, dropout_seed)
    return dq, dk, dv, None, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Fallback to PyTorch's scaled_dot_product_attention (CUDA tensors the kernels do not cover)
# ---------------------------------------------------------------------------------------------
_warned = set()


SDPA_FALLBACK = "torch.nn.functional.scaled_dot_product_attention (correct, but not remat's memory layout)"
REFERENCE_FALLBACK = ("remat's PyTorch reference (correct, but it materialises every seqlen_q x seqlen_k score "
                      "matrix)")


def _warn_fallback_once(reason, function="remat.attention", fallback=SDPA_FALLBACK):
    """Says once per (function, reason, fallback) that FUNCTION runs FALLBACK instead of the kernels."""
    if (function, reason, fallback) not in _warned:
        _warned.add((function, reason, fallback))
        warnings.warn(f"{function}: {reason}; falling back to {fallback}", stacklevel=3)


def _ampere_or_newer(device_index: int) -> bool:
    """Compute capability >= 8.0, which both kernels need: Triton's tl.dot, and the CUDA kernels'
    bf16 mma.sync and cp.async."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


# A constant to torch.compile (no graph break, no guard). Only CUDA tensors ask, so only where CUDA is
# available: elsewhere the decorator's import of torch._dynamo (seconds) is not paid at `import remat`.
if torch.cuda.is_available():
    _ampere_or_newer = torch.compiler.assume_constant_result(_ampere_or_newer)


def _device_index(t):
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _fallback_reason(q, k, v, op_args=None, family=None):
    """Why CUDA tensors q, k, v cannot run the kernels (None when they can). op_args: the whole
    forward call of FAMILY (attention's by default), which under backend "cuda" the CUDA kernels
    may take whatever Triton's limits.

    Size is never a reason: the kernels index in int64 and use a 1-D grid (2^31 - 1 programs),
    so any batch, head count, length or stride that fits in GPU memory runs them.
    """
    if q.device.type != "cuda":
        return None  # CPU: the interpreter or the reference handles everything
    if q.shape[-1] not in HEAD_DIMS:
        reason = f"head dim {q.shape[-1]} is not one of the kernel's {HEAD_DIMS}"
    elif not _ampere_or_newer(_device_index(q)):
        reason = "the GPU's compute capability is below 8.0, which the Triton kernels need"
    else:
        return None
    # Asked only when Triton cannot: most calls never look at the backend here.
    return None if op_args is not None and _runs_cuda_kernels(op_args, family or FAMILY) else reason


def _runs_cuda_kernels(op_args, family):
    """Whether FAMILY's forward op on op_args runs the CUDA extension's kernels (backend "cuda",
    and a call they take)."""
    chosen = _backend.choose(family.name, op_args[0].device, kernels=family.kernels)
    return chosen == "cuda" and family.cuda_takes(*op_args)


def _fallback(q, k, v, causal, softmax_scale, return_lse, features):
    """SDPA for plain and causal attention; with a window, softcapping, ALiBi or dropout the
    differentiable reference (SDPA has no softcap nor the kernels' dropout mask; the reference
    computes every feature as the kernels do). features: as attention_fwd's arguments after softmax_scale."""
    if features == _NO_FEATURES:
        return _sdpa_fallback(q, k, v, causal, softmax_scale, return_lse)
    o, lse = attention_ref(q, k, v, causal, softmax_scale, *features)
    return (o, lse.detach().to(torch.float32)) if return_lse else o


def _sdpa_fallback(q, k, v, causal, softmax_scale, return_lse):
    heads, seqlen_q, seqlen_k = q.shape[1], q.shape[2], k.shape[2]
    k_full, v_full = _expand_kv(k, heads), _expand_kv(v, heads)
    if not causal:
        o = F.scaled_dot_product_attention(q, k_full, v_full, scale=softmax_scale)
    elif seqlen_q == seqlen_k:
        o = F.scaled_dot_product_attention(q, k_full, v_full, is_causal=True, scale=softmax_scale)
    else:
        # SDPA's is_causal is top-left aligned; give it the bottom-right mask explicitly. Rows
        # that see no key would be NaN there: they attend everything instead (a finite result)
        # and are zeroed after, so they give output 0 and zero gradients, as the kernels do.
        visible = _visible_mask(seqlen_q, seqlen_k, q.device)
        seen = visible.any(dim=1)
        mask = visible | ~seen[:, None]
        o = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=softmax_scale)
        o = o * seen[:, None].to(o.dtype)
    if not return_lse:
        return o
    with torch.no_grad():
        _, lse = _probabilities(q, k, causal, softmax_scale)  # materialises s x s: fallback only
    return o, lse.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        check_same_device(name, t, "q", q)
    batch, heads, _, head_dim = q.shape
    if head_dim < 1:
        raise ValueError(f"q must have head_dim >= 1, got shape {tuple(q.shape)}")
    if heads < 1:
        raise ValueError(f"q has no heads: it must be (batch, heads >= 1, seq, head_dim), got shape {tuple(q.shape)}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k must have shape ({batch}, kv_heads, seqlen_k, {head_dim}) to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    kv_heads = k.shape[1]
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"k and v must have a number of heads dividing q's {heads}, got {kv_heads}")


def _unit_last_stride(t):
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


_NO_FEATURES = (-1, -1, 0.0, None)  # (window_left, window_right, softcap, alibi_slopes): plain attention


def _check_window_size(window_size):
    """(left, right) from window_size: a pair of ints (or integer-like scalars) >= -1."""
    pair = tuple(map(integer, window_size)) if isinstance(window_size, (tuple, list)) else ()
    if len(pair) != 2 or None in pair:
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    if any(w < -1 for w in pair):
        raise ValueError(f"window_size must have values >= -1 (-1: unbounded), got {pair}")
    return pair


def _check_softcap(softcap):
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0: no softcapping), got {softcap!r}")
    return float(softcap)


def _check_alibi_slopes(alibi_slopes, q, batch, heads, batch_is="batch"):
    """alibi_slopes: None, or fp32 (heads,) or (batch, heads) on q's device (batch_is: what batch counts)."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must have dtype torch.float32, got {alibi_slopes.dtype}")
    check_same_device("alibi_slopes", alibi_slopes, "q", q)
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (heads, or {batch_is} and "
                         f"heads of q), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes must not require grad: attention gives no gradient for the slopes "
                         "(as FlashAttention); pass alibi_slopes.detach()")


def _check_dropout_p(dropout_p):
    if (isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not math.isfinite(dropout_p)
            or not 0 <= dropout_p < 1):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _dropout_seed(device):
    """A (1,) int64 seed drawn from torch's default generator of `device` (advancing it, as torch's
    own dropout does): torch.manual_seed reproduces it, checkpointing's saved RNG state redraws it,
    and under torch.compile it is a random op of the graph, not a constant baked into it."""
    return torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64, device=device)


def checked_call(q, causal, return_lse, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p):
    """(softmax_scale as a float, the ops' feature arguments after softmax_scale) of a call of
    attention or attention_varlen, its flags checked; with dropout, the seed drawn (see _dropout_seed)."""
    _check_causal(causal)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    _check_softmax_scale(softmax_scale)
    return _scale_for(q, softmax_scale), _with_dropout((window_left, window_right, softcap, alibi_slopes), dropout_p,
                                                       q.device)


def _check_causal(causal):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")


def _check_softmax_scale(softmax_scale):
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")


def _scale_for(q, softmax_scale):
    """softmax_scale (checked) as a float, 1 / sqrt(head_dim) for None."""
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _with_dropout(features, dropout_p, device):
    """The ops' feature arguments with dropout's (its probability and a fresh seed) where there is dropout."""
    return features + (dropout_p, _dropout_seed(device)) if dropout_p > 0 else features


def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, attn_mask=None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, dropout_p=0.0):
    """softmax(softmax_scale * q k^T) v, like F.scaled_dot_product_attention, FlashAttention-style.

    q: (batch, heads, seqlen_q, head_dim); k, v: (batch, kv_heads, seqlen_k, head_dim) with
    kv_heads dividing heads (GQA/MQA). float32, float16 or bfloat16, all the same; any strides
    (a last dim of stride != 1 is copied). causal: bottom-right aligned when seqlen_q !=
    seqlen_k. softmax_scale: default 1/sqrt(head_dim). Returns o (batch, heads, seqlen_q,
    head_dim), and with return_lse=True also the fp32 natural-log log-sum-exp per query row
    (batch, heads, seqlen_q), -inf for rows that see no key (not differentiable). attn_mask: None
    only, for code written for scaled_dot_product_attention: the kernels mask causally or by a window.

    As FlashAttention's flash_attn_func:
    - window_size=(left, right): a sliding window, -1 unbounded; query i sees key j when
      i + Sk - Sq - left <= j <= i + Sk - Sq + right. With causal=True, right is 0.
    - softcap: logit softcapping, s -> softcap * tanh(s / softcap) on the scaled scores; 0 is off.
    - alibi_slopes: fp32 (heads,) or (batch, heads); adds -slope * |i + Sk - Sq - j| to the
      (softcapped) scaled scores. Not differentiable.
    - dropout_p: dropout on the probabilities before P V, kept ones scaled by 1 / (1 - dropout_p).
      The mask is never stored: a counter-based generator (Philox) draws it from a seed taken from
      torch's generator of q's device at the call, and the backward regenerates it. So
      torch.manual_seed before two calls gives bitwise-identical outputs and gradients (under
      backend "cuda", the gradients with torch.use_deterministic_algorithms(True): see the
      module's docstring), and activation checkpointing reproduces the forward. Pass 0 in evaluation.
    Key blocks wholly outside the window are skipped: a window costs in proportion to its width.

    Autograd saves q, k, v, o and the lse (4 bytes per query row and head), and the ALiBi slopes.
    A double backward works: a backward with create_graph=True runs the differentiable reference
    instead of the kernel, which materialises (batch, heads, seqlen_q, seqlen_k) as PyTorch's math
    backend does.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask must be None: remat.attention masks causally (causal=True) or by a sliding "
                         "window (window_size) only; for other masks call "
                         "torch.nn.functional.scaled_dot_product_attention")
    dtype = autocast_dtype_for(q)
    if dtype is not None:  # as scaled_dot_product_attention: computed in the autocast dtype (the slopes stay fp32)
        with torch.autocast(q.device.type, enabled=False):
            return attention(*cast_for_autocast(dtype, q, k, v), causal, softmax_scale, return_lse,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    _check_qkv(q, k, v)
    window_left, window_right = _check_window_size(window_size)
    softcap = _check_softcap(softcap)
    _check_alibi_slopes(alibi_slopes, q, *q.shape[:2])
    dropout_p = _check_dropout_p(dropout_p)
    softmax_scale, features = checked_call(q, causal, return_lse, softmax_scale, window_left, window_right, softcap,
                                           alibi_slopes, dropout_p)
    return _attention_of_checked(q, k, v, causal, softmax_scale, return_lse, features)


def _attention_of_checked(q, k, v, causal, softmax_scale, return_lse, features):
    """attention() of checked arguments outside autocast: the kernels, or the fallback where they cannot run."""
    reason = _fallback_reason(q, k, v, (q, k, v, causal, softmax_scale, *features))
    if reason is not None:
        _warn_fallback_once(reason, fallback=SDPA_FALLBACK if features == _NO_FEATURES else REFERENCE_FALLBACK)
        return _fallback(q, k, v, causal, softmax_scale, return_lse, features)
    o, lse = attention_fwd(_unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), causal, softmax_scale,
                           *features)
    return (o, lse) if return_lse else o


class AttentionFlags:
    """remat.attention's flags for calls that repeat them (an attention module's causality, softmax scale,
    softcap and dropout, the same at each call), checked once, as attention() checks them.

    flags(q, k, v, window_size) is attention(q, k, v, causal, softmax_scale, window_size=window_size,
    softcap=softcap, dropout_p=dropout_p), window_size a pair of ints >= -1 that the caller made (not
    checked). q, k and v are checked as attention() checks them, unless they are like the last ones that
    passed (shapes, dtypes, devices); under autocast the call is attention()'s own.
    """

    __slots__ = ("causal", "softmax_scale", "softcap", "dropout_p", "_like")

    def __init__(self, causal, softmax_scale, softcap, dropout_p):
        _check_causal(causal)
        _check_softmax_scale(softmax_scale)
        self.causal, self.softmax_scale = causal, softmax_scale
        self.softcap, self.dropout_p = _check_softcap(softcap), _check_dropout_p(dropout_p)
        self._like = None

    def __call__(self, q, k, v, window_size):
        if autocast_dtype_for(q) is not None:
            return attention(q, k, v, self.causal, self.softmax_scale, window_size=window_size, softcap=self.softcap,
                             dropout_p=self.dropout_p)
        like = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device) \
            if isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) else None
        if like is None or like != self._like:
            _check_qkv(q, k, v)
            self._like = like
        return _attention_of_checked(q, k, v, self.causal, _scale_for(q, self.softmax_scale), False,
                                     _with_dropout((*window_size, self.softcap, None), self.dropout_p, q.device))

    def __reduce__(self):  # a copy or a pickle checks its first q, k and v afresh
        return AttentionFlags, (self.causal, self.softmax_scale, self.softcap, self.dropout_p)


# ---------------------------------------------------------------------------------------------
# Multi-head self-attention block (what remat.nn.MultiheadSelfAttention calls)
# ---------------------------------------------------------------------------------------------


def multihead_self_attention(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads,
                             num_kv_heads, causal=False, dropout_p=0.0):
    """out_proj(attention(split_heads(in_proj(x)))) for x (batch, seq, embed_dim); dropout_p as attention's.

    in_proj_weight: ((num_heads + 2 * num_kv_heads) * head_dim, embed_dim), the rows of q, then
    k, then v (torch.nn.MultiheadAttention's packing when num_kv_heads == num_heads).
    """
    check_self_attention_input(x, in_proj_weight)
    batch, seq, _ = x.shape
    head_dim = out_proj_weight.shape[1] // num_heads
    qkv = F.linear(x, in_proj_weight, in_proj_bias)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    # (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim): a strided view, no copy.
    q = q.unflatten(-1, (num_heads, head_dim)).transpose(1, 2)
    k = k.unflatten(-1, (num_kv_heads, head_dim)).transpose(1, 2)
    v = v.unflatten(-1, (num_kv_heads, head_dim)).transpose(1, 2)
    o = attention(q, k, v, causal=causal, dropout_p=dropout_p)
    return F.linear(o.transpose(1, 2).reshape(batch, seq, num_heads * head_dim), out_proj_weight, out_proj_bias)


# ---------------------------------------------------------------------------------------------
# The family: remat::attention_fwd and remat::attention_bwd, and what the tooling needs
# ---------------------------------------------------------------------------------------------


def _samples(device):
    """GQA (2 query heads on 1 key/value head), seqlen_q 9 != seqlen_k 12 (masked tails, the causal
    mask off the diagonal), causal and not, with and without the window, softcap and ALiBi; the
    forward's inputs require grad (so opcheck checks its autograd too), the backward's do not. On a
    GPU every other variant is bfloat16, which the CUDA extension's kernels take (their ops are then
    checked on the same samples)."""
    q = torch.randn(1, 2, 9, 32, device=device)
    k, v = torch.randn(1, 1, 12, 32, device=device), torch.randn(1, 1, 12, 32, device=device)
    forward, backward = [], []
    # Plain, causal; a causal window with per-head ALiBi; a two-sided window with softcapping and
    # per-batch ALiBi; causal with dropout.
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    variants = [(False, ()), (True, ()), (True, (4, -1, 0.0, torch.rand(2, device=device))),
                (False, (3, 5, 2.0, torch.rand(1, 2, device=device))), (True, (-1, -1, 0.0, None, 0.3, seed))]
    for index, (causal, features) in enumerate(variants):
        qkv = [t.to(sample_dtype(device, index)) for t in (q, k, v)]
        forward.append((*grad_leaves(*qkv), causal, 0.25, *features))
        o, lse = _attention_fwd_ref(*qkv, causal, 0.25, *features)
        backward.append((torch.randn_like(o), *qkv, o, lse, causal, 0.25, *features))
    return OpSamples(forward, backward)


def sample_dtype(device, index):
    """The dtype of sample variant INDEX: bfloat16 for every other one on a GPU, else float32."""
    return torch.bfloat16 if device.type == "cuda" and index % 2 == 0 else torch.float32


CUDA_KERNEL_MAX_HEAD_DIM = 256


def cuda_kernel_takes(*args):
    """Whether the CUDA extension's kernels run a call of attention_fwd or attention_bwd (or of
    attention_varlen_fwd / _bwd, whose arguments after causal are the same) with these arguments:
    on a GPU of compute capability >= 8.0 (tensor-core mma, cp.async), and what cuda_kernel_computes."""
    first = args[0]
    return first.device.type == "cuda" and _ampere_or_newer(_device_index(first)) and cuda_kernel_computes(*args)


def cuda_kernel_computes(*args):
    """Whether the CUDA kernels compute attention_fwd's or attention_bwd's arguments: the first
    tensor (q or do) half or bfloat16 with a head dim that is a multiple of 8 up to 256. Every
    score option (causal, window, softcapping, ALiBi, dropout) they compute as the Triton kernels do."""
    first = args[0]
    head_dim = first.shape[-1]
    return (first.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and 0 < head_dim <= CUDA_KERNEL_MAX_HEAD_DIM)


def _stock_attention(t):
    """F.scaled_dot_product_attention with remat's causal mask (bottom-right aligned)."""
    q, k, v = t["q"], t["k"], t["v"]
    mask = _visible_mask(q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


FAMILY = OpFamily(
    name="attention",
    forward_ref=_attention_fwd_ref,
    backward_ref=_attention_bwd_ref,
    forward_fake=_attention_fwd_fake,
    backward_fake=_attention_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="attention",
    calls=(PublicCall("attention", {"q": (2, 4, 5, 32), "k": (2, 2, 7, 32), "v": (2, 2, 7, 32)},
                      lambda t: attention(t["q"], t["k"], t["v"], causal=True), _stock_attention,
                      inputs=("q", "k", "v")),),
    triton="attention",
    # Head dims outside HEAD_DIMS run the reference (the first tensor, q or do, ends in the head dim).
    triton_takes=lambda first, *_: first.shape[-1] in HEAD_DIMS,
    cuda=True,
    cuda_takes=cuda_kernel_takes,
    cuda_tools=("remat_C::attention_launch_plan",),
    uses_tl_dot=True,
)
attention_fwd, attention_bwd = FAMILY.forward, FAMILY.backward
