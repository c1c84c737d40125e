"""Fused attention (FlashAttention-2 style) in Triton; the backward recomputes the probabilities.

The forward keeps only what is cheap to store: q, k, v (the caller's), the output o, and per
query row the fp32 log-sum-exp of the scaled scores (4 bytes a row). The backward rebuilds the
probabilities P = exp(S - lse) block by block from q, k and the lse in the same kernels that
compute the gradients: nothing of size seqlen_q x seqlen_k is ever written to memory.

Layout of this file, top to bottom:
  1. configuration: block sizes, warps and stages per (kernel, head dim, dtype): a fixed table
     and autotuning candidates, timed on first use per (head dim, causal, dtype, GPU, length class)
  2. forward kernel: online softmax over key/value blocks, writes o and the lse
  3. backward kernels: delta = rowsum(dO * O); dK/dV (one program per key block, looping over
     query blocks and the query heads of its group); dQ (one program per query block, looping
     over key blocks). No atomics: every output element is written by exactly one program.
  4. launchers: attention_fwd, attention_bwd
  5. aot_cases(): every launch configuration above, for the ahead-of-time compile test

Tensor contract:
  q (B, H, Sq, D); k, v (B, H_kv, Sk, D) with H_kv dividing H (GQA/MQA; query head h reads
  key/value head h // (H // H_kv)); any strides as long as the last dim has stride 1.
  o (B, H, Sq, D) in q's dtype, laid out as (B, Sq, H, D); lse (B, H, Sq) contiguous fp32,
  NATURAL log: lse[i] = log(sum_j exp(scale * q_i . k_j)) over the keys row i may see, -inf for
  a row that sees no key (causal with Sq > Sk), whose output is 0 and whose gradients are 0.
  dq, dk, dv contiguous, in the dtype and shape of q, k, v.

Conventions:
  - Inside the kernels scores are in base 2: qk_scale = softmax_scale * log2(e), so exp is exp2.
  - Causal masking is aligned to the bottom-right corner (FlashAttention >= 2.1): query i sees
    key j iff j <= i + (Sk - Sq). With Sq == Sk this is the usual lower triangle.
  - Masked scores are set to a large finite negative (-1e30), never -inf, so the running
    maximum of a row that has seen no key yet stays finite and no inf - inf can occur; the
    probabilities of masked entries are then zeroed explicitly.
  - Masks only where they change something: each loop runs in two ranges, the tiles entirely
    visible (no bounds checks, no selects) and the tiles on the causal diagonal or at a ragged
    end (masked); see _key_ranges and _query_ranges. Causal query blocks run heaviest first.
  - Offsets are int64 wherever they grow with the problem, and the grid is 1-D: any batch,
    head count, sequence length and row stride that fits in memory (see section 2).
  - The head dim is padded to the next power of two (80 and 96 -> 128) with masked loads.
  - fp16/bf16: tl.dot on the inputs with fp32 accumulation; P and dS are rounded to the input
    dtype before their matmuls (as FlashAttention does). fp32: tl.dot with
    input_precision="ieee" (full fp32, no tf32), so fp32 results match an fp32 reference.

Features, each a constexpr so that the plain kernels compile to what they were without them
(FlashAttention's meanings; see _score_options):
  - WINDOW: a sliding window, key j seen by query i iff i + Sk - Sq - left <= j <= i + Sk - Sq +
    right; causal is folded in (right = 0). Key (query) blocks wholly outside it are skipped, those
    on its edges masked, those inside unmasked.
  - SOFTCAP: s -> c tanh(s / c) on the scaled scores; the backward multiplies dS by 1 - tanh^2.
  - ALIBI: -slope * |i + Sk - Sq - j| added to the (capped) scaled scores, slopes per head or per
    (batch, head); it has no gradient.
  - DROPOUT: on the probabilities before P V (the normaliser sums them undropped), kept ones
    scaled by 1 / (1 - p). The mask is a function of (seed, batch * H + head, query, key) by
    Philox (_dropout_kept), drawn again in the backward for dV and dP: never stored.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _autotune
from ._common import TYPE_NAMES, cdiv, next_power_of_2, on_input_device, unit_last_stride

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)

# Head dims the kernels are compiled and tested for (checked by the op layer; others fall back).
HEAD_DIMS = (32, 64, 80, 96, 128, 256)

# ---------------------------------------------------------------------------------------------
# 1. Configuration
# ---------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and padded head dim, for fp16/bf16 on
# sm_80/sm_90. BLOCK_M is the query block, BLOCK_N the key block. Causal and non-causal share
# an entry (the causal loops are shorter, not different); bf16 and fp16 share one (same sizes).
# Chosen so that nothing spills on sm_80 or sm_90 (tests/package/test_triton_aot.py compiles them all):
#   fwd:  a (BLOCK_M, D) fp32 accumulator and the q tile stay in registers across the loop.
#   dkdv: k, v tiles and two (BLOCK_N, D) fp32 accumulators stay in registers; query blocks
#         stream past, so BLOCK_M is the small one.
#   dq:   q, dO tiles and a (BLOCK_M, D) fp32 accumulator stay; key blocks stream past.
# These are the fixed configurations (REMAT_AUTOTUNE=0) and the first autotuning candidates.
_HALF_CONFIGS = {
    "fwd": {32: (128, 64, 4, 3), 64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)},
    "dkdv": {32: (32, 128, 4, 3), 64: (32, 128, 8, 3), 128: (32, 64, 8, 2), 256: (16, 64, 8, 2)},
    "dq": {32: (128, 32, 4, 3), 64: (128, 32, 4, 3), 128: (64, 32, 4, 2), 256: (64, 32, 8, 2)},
}
# fp32 tiles take twice the registers and shared memory of half ones: smaller blocks. With
# FMA-lowered (ieee) dots, ptxas puts 8-120 bytes on the stack for some fp32 tiles, at times far
# below the register limit, and which ones changes with small code changes (the split into
# masked and unmasked loops moved it): every entry here and among the candidates below is
# checked to compile without, causal or not, on both archs (REMAT_AOT_FULL=1).
_FP32_CONFIGS = {
    "fwd": {32: (32, 32, 4, 2), 64: (32, 32, 4, 2), 128: (16, 16, 8, 1), 256: (16, 32, 8, 1)},
    "dkdv": {32: (16, 32, 4, 2), 64: (16, 32, 4, 2), 128: (16, 32, 8, 1), 256: (16, 16, 8, 1)},
    "dq": {32: (32, 16, 4, 2), 64: (32, 16, 4, 2), 128: (16, 16, 8, 1), 256: (16, 32, 8, 1)},
}
# ... and with a window, softcapping or ALiBi at head dims 32 and 64, the only fp32 configuration:
# the extra live values (positions, tanh) put 8-24 bytes on the stack in several of the tiles above
# (the fwd and dK/dV table entries among them) on sm_80 or sm_90; these three compile without,
# for every variant of AOT_FEATURES but dropout's (below) on both archs at head dim 64 (32's
# tiles are narrower).
_FP32_FEATURE_CONFIGS = {"fwd": (32, 32, 8, 2), "dkdv": (16, 16, 4, 2), "dq": (16, 32, 4, 2)}
_FP32_FEATURE_HEAD_DIMS = (32, 64)
# With dropout, these instead, the first being the fixed one: Philox's rounds on every score (with
# a window and ALiBi besides, the most live values) put 8-392 bytes on the stack in most of the
# tiles above and in every Hopper-only one. Each compiles without, on sm_80 and sm_90, for both
# dropout variants of AOT_FEATURES at both shapes (REMAT_AOT_FULL=1 REMAT_AOT_ONLY=dropout); the
# padded 128 at head dims 80, 96 and 128. One exception, for want of a better one: fp32 dK/dV at
# the padded 128 (of 7 tiles tried, each puts 8-500 bytes on the stack in some case; these two 8
# bytes on sm_80, (16, 16, 4, 2) at head dim 128 with dropout alone, (16, 16, 8, 1) at 80 and 96).
# The mask drawn once per group of four scores (one Philox call, four words) moved the spills:
# the half d128 dK/dV and dQ, the fp32 dQ and the half d64 dQ candidates were chosen again then.
_DROPOUT_CONFIGS = {
    "half": {
        "fwd": {32: [(64, 64, 4, 4)], 64: [(128, 64, 8, 3), (64, 64, 4, 3)], 128: [(64, 64, 8, 3), (64, 32, 4, 2)],
                256: [(64, 32, 8, 2)]},
        "dkdv": {32: [(32, 64, 4, 3), (64, 128, 8, 3)], 64: [(32, 128, 8, 3), (32, 64, 4, 3)],
                 128: [(16, 64, 8, 2), (32, 32, 8, 2)], 256: [(16, 32, 8, 2), (16, 16, 4, 2), (16, 16, 8, 1)]},
        "dq": {32: [(128, 32, 8, 3), (128, 64, 8, 3)], 64: [(128, 32, 8, 3)],
               128: [(64, 32, 8, 2), (32, 32, 4, 2)], 256: [(32, 32, 8, 2), (16, 32, 4, 2), (16, 16, 4, 2)]},
    },
    "fp32": {
        "fwd": {32: [(32, 32, 8, 2)], 64: [(32, 32, 8, 2)], 128: [(16, 32, 8, 1)],
                256: [(16, 32, 8, 1), (16, 16, 4, 1)]},
        "dkdv": {32: [(16, 16, 4, 2)], 64: [(16, 16, 4, 2)], 128: [(16, 16, 4, 2), (16, 16, 8, 1)],
                 256: [(16, 16, 8, 2)]},
        "dq": {32: [(32, 16, 4, 2)], 64: [(32, 16, 4, 2), (16, 32, 4, 1), (16, 16, 4, 2), (32, 16, 8, 2)],
               128: [(16, 16, 4, 2)], 256: [(16, 16, 4, 2)]},
    },
}
# Further autotuning candidates, timed after the table entry on first use per key (see
# _select_config); the table entry wins ties, so tuning can only pick something faster. Every
# one compiles without spills on sm_80 and sm_90 (tests/package/test_triton_aot.py). They vary the tile
# shape, warps and pipeline depth around the table entry within that register budget.
_HALF_CANDIDATES = {
    "fwd": {32: [(128, 128, 8, 3), (64, 64, 4, 4)], 64: [(64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3)],
            128: [(64, 64, 8, 3), (64, 32, 4, 2)], 256: [(64, 64, 8, 2), (32, 64, 4, 2)]},
    "dkdv": {32: [(64, 128, 8, 3), (32, 64, 4, 3)], 64: [(32, 64, 4, 3)],
             128: [(16, 64, 4, 2), (64, 64, 8, 2)], 256: [(16, 32, 4, 2)]},
    "dq": {32: [(64, 64, 4, 3), (128, 64, 8, 3)], 64: [(64, 64, 4, 3), (128, 64, 8, 2)],
           128: [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3)], 256: [(32, 32, 4, 2)]},
}
# Hopper (sm_90) only, by exact head dim: its warpgroup MMA keeps larger tiles in registers than
# sm_80's mma does, and issues them as wide instructions (the d128 backward tables' 16- and
# 32-wide key/query blocks give skinny HGMMA.64x16x16 / 64x32x16; 64 x 128 and 128 x 128 tiles
# give 64x64x16 and 64x128x16 ones). Every one compiles without spills on sm_90 at both shapes
# of aot_cases() (several spill on sm_80; the 128 x 128 forward tile is FlashAttention-3's).
# Head dims 80 and 96, padded to 128, have fewer: the masked head-dim columns cost registers, and
# the 128 x 128 tiles spill there. They are timed after the candidates above.
_HOPPER_HALF_CANDIDATES = {
    "fwd": {64: [(128, 64, 4, 3)], 128: [(128, 128, 8, 3), (128, 128, 8, 2)]},
    "dkdv": {64: [(64, 128, 8, 3)], 80: [(32, 128, 8, 2)], 96: [(32, 128, 8, 2)], 128: [(32, 128, 8, 2)]},
    "dq": {64: [(128, 64, 8, 3), (128, 128, 8, 2)], 80: [(128, 64, 8, 2)], 96: [(128, 64, 8, 2)],
           128: [(128, 64, 8, 2), (128, 128, 8, 2)]},
}
# ... and for non-causal attention only: with the causal dK/dV kernel's masked diagonal steps this
# tile spills (48 bytes of stack on sm_90).
_HOPPER_HALF_NONCAUSAL_CANDIDATES = {"fwd": {}, "dkdv": {128: [(64, 128, 8, 2)]}, "dq": {}}
_FP32_CANDIDATES = {
    "fwd": {32: [(32, 64, 4, 2)], 64: [(32, 32, 4, 3)],
            128: [(16, 16, 4, 2)], 256: [(16, 16, 4, 1), (16, 16, 8, 1), (16, 16, 4, 2)]},
    "dkdv": {32: [(32, 32, 4, 2)], 64: [(16, 32, 4, 1)],
             128: [(16, 16, 4, 1)], 256: [(16, 16, 8, 2)]},
    "dq": {32: [(64, 16, 4, 2), (32, 32, 4, 2)], 64: [(32, 32, 4, 2)],
           128: [(16, 16, 4, 1), (16, 32, 8, 1)], 256: [(16, 16, 4, 2)]},
}
# Under the Triton interpreter (CPU tensors) one small configuration: fast, and sequence lengths
# of a few dozen already span several blocks, so the loops and tail masks are exercised.
_INTERPRETER_CONFIG = (16, 16, 4, 1)
# Backward preprocess (delta = rowsum(dO * O)): rows per program, and warps. Not tuned: a
# memory-bound row reduction, a small share of the backward.
_PRE_BLOCK_M, _PRE_WARPS = 64, 8  # 8 warps: o and dO tiles of 64 x 256 fp32 fit without spilling
_PRE_BLOCK_M_INTERPRETER = 16
KINDS = ("fwd", "dkdv", "dq")


def padded_head_dim(head_dim: int) -> int:
    """The power-of-two tile width a head dim runs at (80 and 96 run padded to 128)."""
    return max(16, next_power_of_2(head_dim))


def candidates(kind, head_dim, dtype, hopper=False, causal=None, features=False, dropout=False):
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) configurations of kernel `kind` ("fwd",
    "dkdv", "dq") on a GPU, the fixed-table one first; hopper: on sm_90, with its own extras;
    causal: those of causal (True) or non-causal (False) attention, None for either; features:
    those of the kernels with a window, softcapping, ALiBi or dropout (dropout: with dropout)."""
    half = dtype != torch.float32
    d_pad = padded_head_dim(head_dim)
    if dropout:
        return list(_DROPOUT_CONFIGS["half" if half else "fp32"][kind][d_pad])
    if features and not half and d_pad in _FP32_FEATURE_HEAD_DIMS:
        return [_FP32_FEATURE_CONFIGS[kind]]
    table = (_HALF_CONFIGS if half else _FP32_CONFIGS)[kind][d_pad]
    extra = (_HALF_CANDIDATES if half else _FP32_CANDIDATES)[kind][d_pad]
    if hopper and half:
        extra = extra + _HOPPER_HALF_CANDIDATES[kind].get(head_dim, [])
        if not causal:
            extra = extra + _HOPPER_HALF_NONCAUSAL_CANDIDATES[kind].get(head_dim, [])
    return list(dict.fromkeys([table] + extra))


# Autotuning: the best configuration depends on the kernel, the head dim, causal or not, the
# dtype, the GPU, the Triton version (its code generation) and, more weakly, the sequence
# length (short ones leave SMs idle with large blocks): one key per power-of-two length class,
# clamped so that short sequences share one class and long ones another.
_SEQLEN_CLASSES = (256, 16384)
# A candidate that fails to compile or to run on this GPU (shared memory above its limit, a compiler
# error, a failed launch) is skipped and recorded when tuning: the others are timed.
_TUNER = _autotune.Tuner("attention-autotune.json", skip_errors=(Exception,))


def seqlen_class(seqlen_q, seqlen_k):
    low, high = _SEQLEN_CLASSES
    return min(max(next_power_of_2(max(seqlen_q, seqlen_k)), low), high)


def tuning_key(kind, head_dim, causal, dtype, gpu, seqlen_q, seqlen_k, variant=None):
    """The cache key of one tuning decision. gpu: name and compute capability (_gpu_signature).
    variant: the kernel variant's name in place of "causal" / "full" (a window, softcapping, ALiBi)."""
    name = variant or ("causal" if causal else "full")
    return "|".join([kind, f"d{head_dim}", name, str(dtype).replace("torch.", ""), gpu,
                     f"s{seqlen_class(seqlen_q, seqlen_k)}", f"triton-{triton.__version__}"])


@functools.cache
def _gpu_signature_of(index):
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"


def _gpu_signature(device):
    return _gpu_signature_of(device.index if device.index is not None else torch.cuda.current_device())


def _may_time(sample):
    """False while tracing (torch.compile, fake tensors) or capturing a CUDA graph: no kernel may
    run then, so the table entry (or an already tuned one) is used."""
    from torch._subclasses.fake_tensor import FakeTensor

    if torch.compiler.is_compiling() or isinstance(sample, FakeTensor):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _config_for(kind, head_dim, dtype, causal, seqlen_q, seqlen_k, device, may_time, run, variant=None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of kernel `kind`: the interpreter's on CPU, the
    table entry with REMAT_AUTOTUNE=0, else the tuned one (timing run(config) on first use).
    variant: as in tuning_key (None: plain attention; else the kernels with features, see candidates)."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    parts = set((variant or "").split("+")) - {"", "causal", "full", "varlen"}  # the score features
    features = dict(features=bool(parts), dropout="dropout" in parts)
    if not _autotune.enabled():
        return candidates(kind, head_dim, dtype, **features)[0]
    gpu = _gpu_signature(device)
    options = candidates(kind, head_dim, dtype, hopper=gpu.endswith(" sm_90"), causal=causal, **features)
    key = tuning_key(kind, head_dim, causal, dtype, gpu, seqlen_q, seqlen_k, variant)
    return _TUNER.best(key, options, run, may_time=may_time)


def _select_config(kind, q, k, scores, run):
    # A windowed kernel has masked steps on both edges, as the causal one has on its diagonal:
    # it takes the causal candidates (the non-causal-only tile spills with masked steps).
    return _config_for(kind, q.shape[-1], q.dtype, scores.CAUSAL or scores.WINDOW, scores.seqlen_q, scores.seqlen_k,
                       q.device, _may_time(q), run, scores.variant)


# ---------------------------------------------------------------------------------------------
# 2. Forward
# ---------------------------------------------------------------------------------------------
# Indexing, shared by every kernel below:
#   - A 1-D grid: program p handles block p % num_blocks of the (batch, head) slice
#     p // num_blocks. Grid axis 0 takes up to 2^31 - 1 programs where axes 1 and 2 stop at
#     65535, so no batch or head count is too large; the block index varies fastest, so
#     programs running side by side share one head's keys and values in L2.
#   - Every offset that grows with the problem is int64: the base of a (batch, head) slice
#     (batch * stride_b + head * stride_h) and every row offset (row * stride_s: with a long
#     sequence or a large row stride it passes 2^31 elements although each factor fits in
#     int32). Only the head-dim column offsets (< 256) stay int32. Row offsets are formed from
#     the absolute row index inside each loop iteration: on sm_80 this used fewer registers
#     than int64 pointers carried across iterations or a per-block int64 base (which spilled).
@triton.jit
def _program_coords(num_blocks, heads):
    # (block, batch, head) of this program: block int32, batch and head int64 (they multiply
    # strides). heads is the number of heads the grid enumerates (H, or H_kv for dK/dV).
    pid = tl.program_id(0)
    slice_index = pid // num_blocks
    block = pid - slice_index * num_blocks
    batch = slice_index // heads
    head = slice_index - batch * heads
    return block, batch.to(tl.int64), head.to(tl.int64)


@triton.jit
def _heaviest_first(block, num_blocks):
    # Causal query blocks in reverse: the last ones see the most keys. Started first, the long
    # programs do not end up as a tail running on a few SMs after the short ones have finished.
    return num_blocks - 1 - block


@triton.jit
def _tile_ptrs(Base, rows, stride_rows, offs_d):
    # Pointers to the (len(rows), len(offs_d)) tile at rows `rows` of Base, row offsets in int64.
    return Base + rows.to(tl.int64)[:, None] * stride_rows + offs_d[None, :]


@triton.jit
def _tile_ptrs_t(Base, rows, stride_rows, offs_d):
    # The same tile, transposed: (len(offs_d), len(rows)).
    return Base + offs_d[:, None] + rows.to(tl.int64)[None, :] * stride_rows


@triton.jit
def _tile_mask(rows, num_rows, offs_d, HEAD_DIM: tl.constexpr):
    # The elements of that tile that exist: row below num_rows, column below the head dim (the
    # column test is constant-folded when the head dim is a power of two).
    return (rows[:, None] < num_rows) & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def _dot(a, b, IEEE_FP32: tl.constexpr):
    # fp32 operands: full-precision products (tl.dot's default for fp32 is tf32 on a GPU, which
    # would make fp32 attention as inexact as bf16's mantissa). Half operands ignore this.
    if IEEE_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right, CAUSAL: tl.constexpr,
             WINDOW: tl.constexpr):
    # (len(rows), len(cols)) mask of the (query, key) pairs that take part: both in range and,
    # when causal, key j at most i + (Sk - Sq) (bottom-right aligned); with a window, j within
    # [i + (Sk - Sq) - window_left, i + (Sk - Sq) + window_right] (the launcher folds causal into
    # window_right = 0 and passes CAUSAL=False then).
    ok = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q))
    if WINDOW:
        diagonal = rows[:, None] + (seqlen_k - seqlen_q)
        ok = ok & (cols[None, :] >= diagonal - window_left) & (cols[None, :] <= diagonal + window_right)
    return ok


@triton.jit
def _tanh(x):
    # tanh to a few fp32 ulps (no tanh in every Triton version's core language). From exp2 as
    # (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1], for |x| >= 1/4, where 1 - e >= 0.39 cancels
    # little; below, where it would (the softcapped scores of c = 50 are mostly there), its Taylor
    # series to x^9, whose next term is below 1e-8 relative.
    magnitude = tl.abs(x)
    e = tl.exp2(magnitude * -2.8853900817779268)  # exp(-2|x|): -2 * log2(e)
    large = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(magnitude < 0.25, small, tl.where(x < 0, -large, large))


@triton.jit
def _modified_scores(s, q_pos, k_pos, qk_scale, softcap_in, softcap_out, alibi_slope, seqlen_q, seqlen_k,
                     SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    # (scores, t) for raw scores s = q . k at query positions q_pos and key positions k_pos (both
    # broadcast to s's shape): scores in base 2 after logit softcapping, c * tanh(scale * s / c)
    # (softcap_in = scale / c, softcap_out = c * log2(e)), then the ALiBi bias
    # -slope * |i + Sk - Sq - j| (alibi_slope in base 2). t = tanh(scale * s / c), which the
    # backward needs for the cap's derivative scale * (1 - t^2); s itself without softcapping.
    if SOFTCAP:
        t = _tanh(s * softcap_in)
        scores = t * softcap_out
    else:
        t = s
        scores = s * qk_scale
    if ALIBI:
        distance = tl.abs(q_pos + (seqlen_k - seqlen_q) - k_pos).to(tl.float32)
        scores = scores - alibi_slope * distance
    return scores, t


@triton.jit
def _load_alibi_slope(Alibi, batch, head, stride_ab, ALIBI: tl.constexpr):
    # The ALiBi slope of (batch, head) in base 2 (stride_ab is 0 for slopes shared by the batch);
    # 0 without ALiBi (never used then).
    if ALIBI:
        return tl.load(Alibi + batch * stride_ab + head) * 1.4426950408889634
    else:
        return 0.0


@triton.jit
def _dropout_kept(seed, slice_index, q_pos, k_pos, dropout_threshold):
    # Whether dropout keeps the probability of (query q_pos, key k_pos) in (batch, head) slice
    # slice_index (= batch * H + head): Philox-4x32-10 with key `seed` and counter (key position,
    # query position, slice, 0), the positions' bit 3 cleared, gives the group {q, q + 8} x
    # {k, k + 8} four words; (q, k) takes word 2 (q / 8 % 2) + k / 8 % 2, kept when its top 31 bits
    # are at least dropout_threshold (p * 2^31). A function of the positions alone, so the
    # backward regenerates the forward's mask in any tile shape (remat.ops.attention.dropout_keep_mask
    # computes the same in PyTorch; the CUDA kernels one call per group).
    zero = (q_pos + k_pos) * 0
    c0, c1, c2, c3 = tl.philox(seed, (k_pos - (k_pos & 8) + zero).to(tl.uint32, bitcast=True),
                               (q_pos - (q_pos & 8) + zero).to(tl.uint32, bitcast=True),
                               (zero + slice_index.to(tl.int32)).to(tl.uint32, bitcast=True),
                               zero.to(tl.uint32, bitcast=True))
    k_high = ((k_pos + zero) & 8) != 0
    bits = tl.where(((q_pos + zero) & 8) != 0, tl.where(k_high, c3, c2), tl.where(k_high, c1, c0))
    return (bits >> 1).to(tl.int32, bitcast=True) >= dropout_threshold


@triton.jit
def _load_seed(Seed, DROPOUT: tl.constexpr):
    # The dropout seed (one int64); 0 without dropout (never used then).
    if DROPOUT:
        return tl.load(Seed)
    else:
        return 0


@triton.jit
def _sequence(CuSeqlens, index):
    # (first row, length) of sequence `index` of a packed (varlen) tensor: cu_seqlens[index] (int64,
    # it multiplies a row stride) and cu_seqlens[index + 1] - cu_seqlens[index].
    start = tl.load(CuSeqlens + index)
    return start.to(tl.int64), tl.load(CuSeqlens + index + 1) - start


@triton.jit
def _clamped_ranges(start, full_lo, full_hi, end):
    # Orders the four block boundaries of a windowed loop so that start <= full_lo <= full_hi <=
    # end: masked [start, full_lo), unmasked [full_lo, full_hi), masked [full_hi, end). start,
    # full_lo and full_hi stay multiples of the block size or become end (the ranges after are empty).
    start = tl.minimum(start, end)
    full_lo = tl.minimum(tl.maximum(full_lo, start), end)
    full_hi = tl.maximum(tl.minimum(full_hi, end), full_lo)
    return start, full_lo, full_hi, end


@triton.jit
def _window_key_ranges(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # (start, full_lo, full_hi, end) over the keys for the query rows [start_m, start_m + BLOCK_M)
    # with a window: key blocks below start or from end on are seen by no row (skipped), those in
    # [full_lo, full_hi) by every existing row (unmasked), the rest in part (masked).
    diagonal = seqlen_k - seqlen_q
    last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    end = tl.minimum(seqlen_k, tl.maximum(0, last_row + diagonal + window_right + 1))
    start = (tl.maximum(0, start_m + diagonal - window_left) // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(0, last_row + diagonal - window_left), BLOCK_N) * BLOCK_N
    full_hi = (tl.minimum(seqlen_k, tl.maximum(0, start_m + diagonal + window_right + 1)) // BLOCK_N) * BLOCK_N
    return _clamped_ranges(start, full_lo, full_hi, end)


@triton.jit
def _window_query_ranges(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    # The same over the query rows for the keys [start_n, start_n + BLOCK_N): row i sees key j iff
    # j - (Sk - Sq) - window_right <= i <= j - (Sk - Sq) + window_left.
    diagonal = seqlen_k - seqlen_q
    last_col = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    end = tl.minimum(seqlen_q, tl.maximum(0, last_col - diagonal + window_left + 1))
    start = (tl.maximum(0, start_n - diagonal - window_right) // BLOCK_M) * BLOCK_M
    full_lo = tl.cdiv(tl.maximum(0, last_col - diagonal - window_right), BLOCK_M) * BLOCK_M
    full_hi = (tl.minimum(seqlen_q, tl.maximum(0, start_n - diagonal + window_left + 1)) // BLOCK_M) * BLOCK_M
    return _clamped_ranges(start, full_lo, full_hi, end)


@triton.jit
def _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    # (full_end, end) for the query rows [start_m, start_m + BLOCK_M): key blocks starting below
    # full_end (a multiple of BLOCK_N) are entirely visible to every row of the block that exists
    # (all keys in range and, when causal, left of every row's diagonal): no mask needed. end is
    # one past the last key any of these rows may see; blocks in [full_end, end) need the mask.
    # Rows past seqlen_q do not restrict full_end: nothing of theirs is stored.
    end = seqlen_k
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        # Row i sees keys j <= i + (Sk - Sq): the first row of the block sees the fewest.
        end = tl.minimum(seqlen_k, tl.maximum(0, start_m + BLOCK_M + seqlen_k - seqlen_q))
        first_row_end = tl.maximum(0, start_m + 1 + seqlen_k - seqlen_q)
        full_end = tl.minimum(full_end, (first_row_end // BLOCK_N) * BLOCK_N)
    return full_end, end


@triton.jit
def _fwd_step(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, rows, cols, offs_d, seqlen_q, seqlen_k, qk_scale,
              window_left, window_right, softcap_in, softcap_out, alibi_slope, seed, slice_index, dropout_threshold,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
              ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE_FP32: tl.constexpr, MASKED: tl.constexpr):
    # One key block of the online softmax: returns the updated (acc, l_i, m_i). Unmasked blocks
    # (every key in range and visible to every row) load without the key bounds, skip both
    # selects, and fold the scale into the exponent's argument (one FMA per score), which
    # needs qk_scale >= 0 for max(s) * qk_scale to be the row maximum (the launcher ensures it).
    # With softcapping or ALiBi the scores are formed explicitly first (_modified_scores).
    if MASKED:
        kv_mask = _tile_mask(cols, seqlen_k, offs_d, HEAD_DIM)
    else:  # every key in range: only the head-dim padding is masked
        kv_mask = (offs_d < HEAD_DIM)[None, :]
    kt = tl.load(_tile_ptrs_t(K, cols, stride_kn, offs_d), mask=tl.trans(kv_mask), other=0.0)
    s = _dot(q, kt, IEEE_FP32)
    if SOFTCAP or ALIBI:
        s, _ = _modified_scores(s, rows[:, None], cols[None, :], qk_scale, softcap_in, softcap_out, alibi_slope,
                                seqlen_q, seqlen_k, SOFTCAP, ALIBI)
        if MASKED:
            visible = _visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, WINDOW)
            s = tl.where(visible, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        if MASKED:  # zeroed explicitly (see the plain masked case below)
            p = tl.where(visible, p, 0.0)
    elif MASKED:
        visible = _visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, WINDOW)
        s = tl.where(visible, s * qk_scale, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Zeroed explicitly: in a row with no visible key yet, m_new is -1e30 too and
        # exp2(s - m_new) would be 1 for the masked entries.
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:  # after the normaliser: dropout acts on the probabilities (1 / (1 - p) applied at the end)
        p = tl.where(_dropout_kept(seed, slice_index, rows[:, None], cols[None, :], dropout_threshold), p, 0.0)
    v = tl.load(_tile_ptrs(V, cols, stride_vn, offs_d), mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_FP32)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_kernel(
    Q,  # (B, H, Sq, D) strides stride_qb, stride_qh, stride_qm, 1
    K,  # (B, H_kv, Sk, D) strides stride_kb, stride_kh, stride_kn, 1
    V,  # (B, H_kv, Sk, D) strides stride_vb, stride_vh, stride_vn, 1
    O,  # (B, H, Sq, D) output, strides stride_ob, stride_oh, stride_om, 1
    LSE,  # (B, H, Sq) fp32 output (natural log), strides stride_lb, stride_lh, 1
    Alibi,  # (B, H) fp32 ALiBi slopes, strides stride_ab (0 when shared by the batch), 1; read if ALIBI
    Seed,  # (1,) int64 dropout seed; read if DROPOUT
    CuSeqlensQ,  # (B + 1,) int32: where each sequence's query rows start and end; read if VARLEN
    CuSeqlensK,  # (B + 1,) int32: the same for the keys; read if VARLEN
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    stride_ab,
    heads,  # H
    seqlen_q,  # Sq (VARLEN: the longest query sequence)
    seqlen_k,  # Sk (VARLEN: the longest key sequence)
    qk_scale,  # softmax_scale * log2(e)
    window_left,  # keys left of the diagonal a row sees (used if WINDOW)
    window_right,  # keys right of the diagonal a row sees (used if WINDOW)
    softcap_in,  # softmax_scale / softcap (used if SOFTCAP)
    softcap_out,  # softcap * log2(e) (used if SOFTCAP)
    dropout_threshold,  # dropout_p * 2^31 (used if DROPOUT)
    dropout_scale,  # 1 / (1 - dropout_p) (used if DROPOUT)
    GROUP: tl.constexpr,  # H // H_kv: query heads per key/value head
    HEAD_DIM: tl.constexpr,  # D
    D_PAD: tl.constexpr,  # next power of two >= D
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,  # a sliding window (causal folded in); CAUSAL is False then
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences: batch b's rows are cu_seqlens[b] <= row < cu_seqlens[b + 1]
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
):
    # Grid (cdiv(Sq, BLOCK_M) * H * B,): one query block of one head per program.
    block, batch, head = _program_coords(tl.cdiv(seqlen_q, BLOCK_M), heads)
    if VARLEN:  # this sequence's rows and lengths; the grid covers the longest, shorter ones end early
        start_q, seqlen_q = _sequence(CuSeqlensQ, batch)
        start_k, seqlen_k = _sequence(CuSeqlensK, batch)
        if block * BLOCK_M >= seqlen_q:
            return
        Q += start_q * stride_qm
        O += start_q * stride_om
        K += start_k * stride_kn
        V += start_k * stride_vn
        LSE += start_q
    alibi_slope = _load_alibi_slope(Alibi, batch, head, stride_ab, ALIBI)
    seed = _load_seed(Seed, DROPOUT)
    slice_index = batch * heads + head
    if CAUSAL:
        block = _heaviest_first(block, tl.cdiv(seqlen_q, BLOCK_M))
    start_m = block * BLOCK_M
    kv_head = head // GROUP
    Q += batch * stride_qb + head * stride_qh
    O += batch * stride_ob + head * stride_oh
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh
    LSE += batch * stride_lb + head * stride_lh

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    q_mask = _tile_mask(rows, seqlen_q, offs_d, HEAD_DIM)
    q = tl.load(_tile_ptrs(Q, rows, stride_qm, offs_d), mask=q_mask, other=0.0)

    # Online softmax state, base 2: m_i the running max of the scaled scores, l_i the running sum
    # of exp2(s - m_i), acc the running sum of exp2(s - m_i) * v.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    # Key blocks [full_start, full_end) are visible to every row of this block: no mask at all
    # there. Blocks [full_end, end_n) straddle the causal diagonal or the end of the keys: masked.
    # Causal: blocks right of the diagonal are skipped entirely (a row block whose rows see no
    # key at all runs zero iterations). A window also skips the blocks left of it and masks the
    # blocks [first_n, full_start) on its left edge; without one full_start is 0.
    if WINDOW:
        first_n, full_start, full_end, end_n = _window_key_ranges(start_m, seqlen_q, seqlen_k, window_left,
                                                                  window_right, BLOCK_M, BLOCK_N)
        for start_n in range(first_n, full_start, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, rows, start_n + offs_n, offs_d,
                                      seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in,
                                      softcap_out, alibi_slope, seed, slice_index, dropout_threshold, HEAD_DIM, CAUSAL,
                                      WINDOW, SOFTCAP, ALIBI, DROPOUT, IEEE_FP32, True)
    else:
        full_start = 0
        full_end, end_n = _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(full_start, full_end, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, rows, start_n + offs_n, offs_d,
                                  seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in, softcap_out,
                                  alibi_slope, seed, slice_index, dropout_threshold, HEAD_DIM, CAUSAL, WINDOW, SOFTCAP,
                                  ALIBI, DROPOUT, IEEE_FP32, False)
    for start_n in range(full_end, end_n, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, rows, start_n + offs_n, offs_d,
                                  seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in, softcap_out,
                                  alibi_slope, seed, slice_index, dropout_threshold, HEAD_DIM, CAUSAL, WINDOW, SOFTCAP,
                                  ALIBI, DROPOUT, IEEE_FP32, True)

    # A row that saw no key (l_i == 0) gets o = 0 and lse = -inf (log of an empty sum).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    if DROPOUT:
        o = o * dropout_scale
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(_tile_ptrs(O, rows, stride_om, offs_d), o.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + rows, lse, mask=rows < seqlen_q)


# ---------------------------------------------------------------------------------------------
# 3. Backward
# ---------------------------------------------------------------------------------------------
# Gradient derivation, per head, with c = softmax_scale, S = c * Q K^T, P = softmax_rows(S),
# O = P V and dO the incoming gradient:
#
#   dV = P^T dO                                  (O is linear in V)
#   dP = dO V^T
#   dS_ij = sum_k dP_ik * dP_ik/dS_ij = P_ij * (dP_ij - sum_k P_ik dP_ik)   (softmax Jacobian)
#         = P_ij * (dP_ij - delta_i),   delta_i = sum_k P_ik (dO_i . V_k) = dO_i . O_i
#   dQ = c * dS K,    dK = c * dS^T Q
#
# delta is a cheap row reduction of dO * O (preprocess kernel), so neither dP nor P is needed as
# a whole: each (query block, key block) tile recomputes P_ij = exp(S_ij - lse_i) from q, k and
# the forward's lse (exactly the normalised probabilities, no second max pass), then dP and dS
# for that tile only. Masked pairs get P = 0 and therefore dS = 0.
#
# Two kernels so that every output has one writer (deterministic, no atomics):
#   dK/dV: a program owns a key block of one key/value head; it loops over the query heads of
#          the GROUP sharing that key/value head (GQA: their contributions sum here, in a fixed
#          order) and, for each, over the query blocks that can see its keys.
#   dQ:    a program owns a query block of one query head and loops over the visible key blocks.
# The dQ kernel recomputes S and dP a second time: the price of no atomics.
@triton.jit
def _attn_bwd_preprocess_kernel(
    O,  # (B, H, Sq, D) forward output, strides stride_ob, stride_oh, stride_om, 1
    DO,  # (B, H, Sq, D) gradient of o, strides stride_dob, stride_doh, stride_dom, 1
    Delta,  # (B, H, Sq) fp32 output, strides stride_lb, stride_lh, 1
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    heads,  # H
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # Grid (cdiv(Sq, BLOCK_M) * H * B,). delta_i = sum_d dO_id * O_id in fp32.
    block, batch, head = _program_coords(tl.cdiv(seqlen_q, BLOCK_M), heads)
    O += batch * stride_ob + head * stride_oh
    DO += batch * stride_dob + head * stride_doh
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask = _tile_mask(rows, seqlen_q, offs_d, HEAD_DIM)
    o = tl.load(_tile_ptrs(O, rows, stride_om, offs_d), mask=mask, other=0.0).to(tl.float32)
    do = tl.load(_tile_ptrs(DO, rows, stride_dom, offs_d), mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + batch * stride_lb + head * stride_lh + rows, tl.sum(o * do, 1), mask=rows < seqlen_q)


@triton.jit
def _load_lse_base2(LSE, rows, seqlen_q):
    # The forward's natural-log lse in base 2. A row that sees no key has lse = -inf; it becomes 0
    # here (its probabilities are all masked to 0 anyway) so no inf enters the arithmetic.
    lse = tl.load(LSE + rows, mask=rows < seqlen_q, other=0.0)
    return tl.where(lse > -1.0e30, lse * 1.4426950408889634, 0.0)


@triton.jit
def _load_query_rows(Q, DO, LSE, Delta, rows, stride_qm, stride_dom, offs_d, seqlen_q, HEAD_DIM: tl.constexpr):
    # The query side of the backward at rows `rows` of one head: q, dO, the lse in base 2 and
    # delta. Rows past seqlen_q read as zeros, which contribute exactly 0 to every gradient.
    mask = _tile_mask(rows, seqlen_q, offs_d, HEAD_DIM)
    q = tl.load(_tile_ptrs(Q, rows, stride_qm, offs_d), mask=mask, other=0.0)
    do = tl.load(_tile_ptrs(DO, rows, stride_dom, offs_d), mask=mask, other=0.0)
    lse = _load_lse_base2(LSE, rows, seqlen_q)
    delta = tl.load(Delta + rows, mask=rows < seqlen_q, other=0.0)
    return q, do, lse, delta


@triton.jit
def _query_ranges(start_n, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    # (first, full) for the keys [start_n, start_n + BLOCK_N): query blocks from first (a
    # multiple of BLOCK_M) on may see some of these keys; from full (also a multiple, >= first)
    # on, every row sees all of them. Not causal: every block, all unmasked.
    first = 0
    full = 0
    if CAUSAL:
        # Row i sees key j iff i >= j - (Sk - Sq): the block's first key is seen from row
        # start_n - (Sk - Sq) on, its last from row start_n + BLOCK_N - 1 - (Sk - Sq) on.
        first = (tl.maximum(0, start_n - (seqlen_k - seqlen_q)) // BLOCK_M) * BLOCK_M
        full = tl.cdiv(tl.maximum(0, start_n + BLOCK_N - 1 - (seqlen_k - seqlen_q)), BLOCK_M) * BLOCK_M
        full = tl.minimum(full, tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M)
    return first, full


@triton.jit
def _dkdv_step(dk, dv, k, v, Qh, DOh, LSEh, Deltah, stride_qm, stride_dom, rows, cols, offs_d, seqlen_q, seqlen_k,
               qk_scale, window_left, window_right, softcap_in, softcap_out, alibi_slope, seed, slice_index,
               dropout_threshold, dropout_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE_FP32: tl.constexpr,
               MASKED: tl.constexpr):
    # One query block's contribution to dK and dV of a key block: returns the updated (dk, dv).
    q, do, lse, delta = _load_query_rows(Qh, DOh, LSEh, Deltah, rows, stride_qm, stride_dom, offs_d, seqlen_q,
                                         HEAD_DIM)
    # P^T recomputed: (BLOCK_N, BLOCK_M).
    st = _dot(k, tl.trans(q), IEEE_FP32)
    if SOFTCAP or ALIBI:
        st, tt = _modified_scores(st, rows[None, :], cols[:, None], qk_scale, softcap_in, softcap_out, alibi_slope,
                                  seqlen_q, seqlen_k, SOFTCAP, ALIBI)
        pt = tl.exp2(st - lse[None, :])
    else:
        pt = tl.exp2(st * qk_scale - lse[None, :])
    if MASKED:
        visible_t = tl.trans(_visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, WINDOW))
        pt = tl.where(visible_t, pt, 0.0)
    if DROPOUT:  # the forward's mask, regenerated: dV from the dropped P, dP through the same mask
        kept_t = _dropout_kept(seed, slice_index, rows[None, :], cols[:, None], dropout_threshold)
        dv += _dot(tl.where(kept_t, pt * dropout_scale, 0.0).to(do.dtype), do, IEEE_FP32)
        dpt = tl.where(kept_t, _dot(v, tl.trans(do), IEEE_FP32) * dropout_scale, 0.0)
    else:  # in this order: dP computed after the dV update (the other order spills a Hopper tile)
        dv += _dot(pt.to(do.dtype), do, IEEE_FP32)
        dpt = _dot(v, tl.trans(do), IEEE_FP32)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh^2
        dst = dst * (1.0 - tt * tt)
    dk += _dot(dst.to(q.dtype), q, IEEE_FP32)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, rows, cols, offs_d, seqlen_q, seqlen_k, qk_scale,
             window_left, window_right, softcap_in, softcap_out, alibi_slope, seed, slice_index, dropout_threshold,
             dropout_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE_FP32: tl.constexpr,
             MASKED: tl.constexpr):
    # One key block's contribution to dQ of a query block: returns the updated dq. Unmasked
    # blocks load without the key bounds (all keys in range) and skip the select.
    if MASKED:
        kv_mask = _tile_mask(cols, seqlen_k, offs_d, HEAD_DIM)
    else:  # every key in range: only the head-dim padding is masked
        kv_mask = (offs_d < HEAD_DIM)[None, :]
    k = tl.load(_tile_ptrs(K, cols, stride_kn, offs_d), mask=kv_mask, other=0.0)
    v = tl.load(_tile_ptrs(V, cols, stride_vn, offs_d), mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), IEEE_FP32)
    if SOFTCAP or ALIBI:
        s, t = _modified_scores(s, rows[:, None], cols[None, :], qk_scale, softcap_in, softcap_out, alibi_slope,
                                seqlen_q, seqlen_k, SOFTCAP, ALIBI)
        p = tl.exp2(s - lse[:, None])
    else:
        p = tl.exp2(s * qk_scale - lse[:, None])
    if MASKED:
        # Keys past seqlen_k must get P = 0: their zero scores would give exp2(-lse) otherwise.
        visible = _visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, WINDOW)
        p = tl.where(visible, p, 0.0)
    dp = _dot(do, tl.trans(v), IEEE_FP32)
    if DROPOUT:  # through the forward's mask, as in _dkdv_step
        kept = _dropout_kept(seed, slice_index, rows[:, None], cols[None, :], dropout_threshold)
        dp = tl.where(kept, dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:  # through the cap, as in _dkdv_step
        ds = ds * (1.0 - t * t)
    return dq + _dot(ds.to(k.dtype), k, IEEE_FP32)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,  # (B, H, Sq, D) strides stride_qb, stride_qh, stride_qm, 1
    K,  # (B, H_kv, Sk, D) strides stride_kb, stride_kh, stride_kn, 1
    V,  # (B, H_kv, Sk, D) strides stride_vb, stride_vh, stride_vn, 1
    DO,  # (B, H, Sq, D) strides stride_dob, stride_doh, stride_dom, 1
    LSE,  # (B, H, Sq) fp32, natural log, strides stride_lb, stride_lh, 1
    Delta,  # (B, H, Sq) fp32, same strides as LSE
    DK,  # (B, H_kv, Sk, D) output, strides stride_dkb, stride_dkh, stride_dkn, 1
    DV,  # (B, H_kv, Sk, D) output, strides stride_dvb, stride_dvh, stride_dvn, 1
    Alibi,  # (B, H) fp32 ALiBi slopes, as in the forward
    Seed,  # (1,) int64 dropout seed, as in the forward
    CuSeqlensQ, CuSeqlensK,  # as in the forward
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_ab,
    kv_heads,  # H_kv
    seqlen_q,
    seqlen_k,
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    window_left, window_right, softcap_in, softcap_out, dropout_threshold, dropout_scale,  # as in the forward
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per step
    BLOCK_N: tl.constexpr,  # keys per program
):
    # Grid (cdiv(Sk, BLOCK_N) * H_kv * B,). Works on transposed tiles (keys x queries) so that the
    # accumulations dV += P^T dO and dK += dS^T Q are plain (BLOCK_N, BLOCK_M) x (BLOCK_M, D) dots.
    block, batch, kv_head = _program_coords(tl.cdiv(seqlen_k, BLOCK_N), kv_heads)
    if VARLEN:  # as in the forward, by key blocks
        start_q, seqlen_q = _sequence(CuSeqlensQ, batch)
        start_k, seqlen_k = _sequence(CuSeqlensK, batch)
        if block * BLOCK_N >= seqlen_k:
            return
        Q += start_q * stride_qm
        DO += start_q * stride_dom
        LSE += start_q
        Delta += start_q
        K += start_k * stride_kn
        V += start_k * stride_vn
        DK += start_k * stride_dkn
        DV += start_k * stride_dvn
    start_n = block * BLOCK_N
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh
    seed = _load_seed(Seed, DROPOUT)
    DK += batch * stride_dkb + kv_head * stride_dkh
    DV += batch * stride_dvb + kv_head * stride_dvh

    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    kv_mask = _tile_mask(cols, seqlen_k, offs_d, HEAD_DIM)
    k = tl.load(_tile_ptrs(K, cols, stride_kn, offs_d), mask=kv_mask, other=0.0)
    v = tl.load(_tile_ptrs(V, cols, stride_vn, offs_d), mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)

    # Query blocks [first, full) straddle the causal diagonal: masked. From full on every query
    # row sees every key of this block (unmasked; the query tail past seqlen_q is loaded as
    # zeros, which add exactly 0 to dK and dV). Keys past seqlen_k in this block are computed
    # but never stored. A window ends the unmasked blocks at full_end, masks those on its far
    # edge [full_end, end_m) and skips the rest; without one full_end is seqlen_q.
    if WINDOW:
        first, full, full_end, end_m = _window_query_ranges(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                            BLOCK_M, BLOCK_N)
    else:
        first, full = _query_ranges(start_n, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
        full_end = seqlen_q
    for g in range(GROUP):
        head = kv_head * GROUP + g
        Qh = Q + batch * stride_qb + head * stride_qh
        DOh = DO + batch * stride_dob + head * stride_doh
        LSEh = LSE + batch * stride_lb + head * stride_lh
        Deltah = Delta + batch * stride_lb + head * stride_lh
        alibi_slope = _load_alibi_slope(Alibi, batch, head, stride_ab, ALIBI)
        slice_index = batch * (kv_heads * GROUP) + head
        for start_m in range(first, full, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, Qh, DOh, LSEh, Deltah, stride_qm, stride_dom, start_m + offs_m, cols,
                                offs_d, seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in,
                                softcap_out, alibi_slope, seed, slice_index, dropout_threshold, dropout_scale,
                                HEAD_DIM, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT, IEEE_FP32, True)
        for start_m in range(full, full_end, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, Qh, DOh, LSEh, Deltah, stride_qm, stride_dom, start_m + offs_m, cols,
                                offs_d, seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in,
                                softcap_out, alibi_slope, seed, slice_index, dropout_threshold, dropout_scale,
                                HEAD_DIM, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT, IEEE_FP32, False)
        if WINDOW:
            for start_m in range(full_end, end_m, BLOCK_M):
                dk, dv = _dkdv_step(dk, dv, k, v, Qh, DOh, LSEh, Deltah, stride_qm, stride_dom, start_m + offs_m,
                                    cols, offs_d, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                                    softcap_in, softcap_out, alibi_slope, seed, slice_index, dropout_threshold,
                                    dropout_scale, HEAD_DIM, CAUSAL, WINDOW, SOFTCAP, ALIBI, DROPOUT, IEEE_FP32, True)

    dk *= softmax_scale
    tl.store(_tile_ptrs(DK, cols, stride_dkn, offs_d), dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(_tile_ptrs(DV, cols, stride_dvn, offs_d), dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    Q,  # (B, H, Sq, D) strides stride_qb, stride_qh, stride_qm, 1
    K,  # (B, H_kv, Sk, D) strides stride_kb, stride_kh, stride_kn, 1
    V,  # (B, H_kv, Sk, D) strides stride_vb, stride_vh, stride_vn, 1
    DO,  # (B, H, Sq, D) strides stride_dob, stride_doh, stride_dom, 1
    LSE,  # (B, H, Sq) fp32, natural log, strides stride_lb, stride_lh, 1
    Delta,  # (B, H, Sq) fp32, same strides as LSE
    DQ,  # (B, H, Sq, D) output, strides stride_dqb, stride_dqh, stride_dqm, 1
    Alibi,  # (B, H) fp32 ALiBi slopes, as in the forward
    Seed,  # (1,) int64 dropout seed, as in the forward
    CuSeqlensQ, CuSeqlensK,  # as in the forward
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqm,
    stride_ab,
    heads,  # H
    seqlen_q,
    seqlen_k,
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    window_left, window_right, softcap_in, softcap_out, dropout_threshold, dropout_scale,  # as in the forward
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
):
    # Grid (cdiv(Sq, BLOCK_M) * H * B,).
    block, batch, head = _program_coords(tl.cdiv(seqlen_q, BLOCK_M), heads)
    if VARLEN:  # as in the forward
        start_q, seqlen_q = _sequence(CuSeqlensQ, batch)
        start_k, seqlen_k = _sequence(CuSeqlensK, batch)
        if block * BLOCK_M >= seqlen_q:
            return
        Q += start_q * stride_qm
        DO += start_q * stride_dom
        DQ += start_q * stride_dqm
        LSE += start_q
        Delta += start_q
        K += start_k * stride_kn
        V += start_k * stride_vn
    alibi_slope = _load_alibi_slope(Alibi, batch, head, stride_ab, ALIBI)
    seed = _load_seed(Seed, DROPOUT)
    slice_index = batch * heads + head
    if CAUSAL:
        block = _heaviest_first(block, tl.cdiv(seqlen_q, BLOCK_M))
    start_m = block * BLOCK_M
    kv_head = head // GROUP
    Q += batch * stride_qb + head * stride_qh
    DO += batch * stride_dob + head * stride_doh
    DQ += batch * stride_dqb + head * stride_dqh
    LSE += batch * stride_lb + head * stride_lh
    Delta += batch * stride_lb + head * stride_lh
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    q, do, lse, delta = _load_query_rows(Q, DO, LSE, Delta, rows, stride_qm, stride_dom, offs_d, seqlen_q, HEAD_DIM)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    # As in the forward: key blocks in [full_start, full_end) unmasked, the diagonal, the key tail
    # and a window's left edge masked.
    if WINDOW:
        first_n, full_start, full_end, end_n = _window_key_ranges(start_m, seqlen_q, seqlen_k, window_left,
                                                                  window_right, BLOCK_M, BLOCK_N)
        for start_n in range(first_n, full_start, BLOCK_N):
            dq = _dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, rows, start_n + offs_n, offs_d,
                          seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in, softcap_out,
                          alibi_slope, seed, slice_index, dropout_threshold, dropout_scale, HEAD_DIM, CAUSAL, WINDOW,
                          SOFTCAP, ALIBI, DROPOUT, IEEE_FP32, True)
    else:
        full_start = 0
        full_end, end_n = _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(full_start, full_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, rows, start_n + offs_n, offs_d,
                      seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in, softcap_out,
                      alibi_slope, seed, slice_index, dropout_threshold, dropout_scale, HEAD_DIM, CAUSAL, WINDOW,
                      SOFTCAP, ALIBI, DROPOUT, IEEE_FP32, False)
    for start_n in range(full_end, end_n, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, rows, start_n + offs_n, offs_d,
                      seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_in, softcap_out,
                      alibi_slope, seed, slice_index, dropout_threshold, dropout_scale, HEAD_DIM, CAUSAL, WINDOW,
                      SOFTCAP, ALIBI, DROPOUT, IEEE_FP32, True)

    dq *= softmax_scale
    tl.store(_tile_ptrs(DQ, rows, stride_dqm, offs_d), dq.to(DQ.dtype.element_ty),
             mask=_tile_mask(rows, seqlen_q, offs_d, HEAD_DIM))


# ---------------------------------------------------------------------------------------------
# 4. Launchers
# ---------------------------------------------------------------------------------------------
# Each kernel launch takes its configuration last, so autotuning can time the same call with
# each candidate. The timed runs write the launcher's own fresh outputs (never the caller's
# tensors; the inputs are only read), and the final launch rewrites every element of them.
class _ScoreOptions(NamedTuple):
    """How the scores and probabilities are masked and modified, and where each sequence's rows are,
    as the kernels take it (see _score_options)."""

    CAUSAL: bool  # the plain causal mask (False when a window carries it)
    WINDOW: bool
    SOFTCAP: bool
    ALIBI: bool
    DROPOUT: bool
    window_left: int
    window_right: int
    softcap_in: float
    softcap_out: float
    dropout_threshold: int
    dropout_scale: float
    alibi: torch.Tensor  # (B, H) view of the slopes; the lse when there are none (never read then)
    seed: torch.Tensor  # (1,) int64 dropout seed; the lse without dropout (never read then)
    variant: str | None  # the tuning key's name for the kernel variant (None: plain causal or full)
    # Packed (varlen) sequences: cu_seqlens of the queries and keys (int32, batch + 1); the lse when
    # dense (never read then). batch, seqlen_q, seqlen_k size the grid: the sequences and the longest.
    VARLEN: bool
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    batch: int
    seqlen_q: int
    seqlen_k: int

    def pointers(self):
        return self.alibi, self.seed, self.cu_seqlens_q, self.cu_seqlens_k

    def strides(self, t, dims=3):
        """t's (batch, head, row) strides (first `dims`) as the kernels take them: a packed tensor,
        viewed as (1, H, total, D), has one batch whose sequences cu_seqlens locates (stride 0)."""
        strides = t.stride()[:dims]
        return (0, *strides[1:]) if self.VARLEN else strides

    def runtime_args(self):
        return (self.window_left, self.window_right, self.softcap_in, self.softcap_out, self.dropout_threshold,
                self.dropout_scale)

    def constexprs(self):
        return dict(CAUSAL=self.CAUSAL, WINDOW=self.WINDOW, SOFTCAP=self.SOFTCAP, ALIBI=self.ALIBI,
                    DROPOUT=self.DROPOUT, VARLEN=self.VARLEN)


def dropout_threshold(dropout_p):
    """The kernels keep a probability when 31 random bits are at least this: p * 2^31."""
    return min(int(dropout_p * 2**31), 2**31 - 1)


def _score_options(q, k, lse, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                   dropout_p=0.0, dropout_seed=None, sequences=None):
    """The kernels' arguments for causal masking, a sliding window (window_left, window_right:
    keys a query row sees left and right of its diagonal, -1 unbounded), logit softcapping
    (softcap > 0), ALiBi slopes ((H,) or (B, H) fp32, or None), dropout (dropout_p > 0 with
    dropout_seed, a (1,) int64 tensor) and packed sequences: sequences = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) for q and k viewed as (1, H, total, D), else None.

    Causal is a window bound window_right = 0: with a left bound as well it runs as a window.
    Unbounded sides of a window become Sq + Sk, past every key any row could see (the bounds
    stay small integers however large the caller's are)."""
    if sequences is None:
        cu_seqlens_q = cu_seqlens_k = lse
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[2], k.shape[2]
    else:
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k = sequences
        batch = cu_seqlens_q.shape[0] - 1
    unbounded = q.shape[2] + k.shape[2]
    left = unbounded if window_left < 0 else min(window_left, unbounded)
    right = 0 if causal else (unbounded if window_right < 0 else min(window_right, unbounded))
    window = window_left >= 0 or (window_right >= 0 and not causal)
    alibi = lse
    if alibi_slopes is not None:
        alibi = alibi_slopes.to(torch.float32).contiguous().expand(batch, q.shape[1])
    capped = softcap > 0
    dropout = dropout_p > 0
    features = (("window", window), ("causal", causal and not window), ("softcap", capped),
                ("alibi", alibi_slopes is not None), ("dropout", dropout))
    variant = "+".join(name for name, on in features if on)
    if sequences is not None:
        variant = f"{variant or 'full'}+varlen"
    return _ScoreOptions(
        CAUSAL=bool(causal) and not window, WINDOW=window, SOFTCAP=capped, ALIBI=alibi_slopes is not None,
        DROPOUT=dropout, window_left=left if window else 0, window_right=right if window else 0,
        softcap_in=softmax_scale / softcap if capped else 0.0, softcap_out=softcap * LOG2E if capped else 0.0,
        dropout_threshold=dropout_threshold(dropout_p) if dropout else 0,
        dropout_scale=1.0 / (1.0 - dropout_p) if dropout else 1.0,
        alibi=alibi, seed=dropout_seed if dropout else lse,
        variant=variant if sequences is not None or any(on for name, on in features if name != "causal") else None,
        VARLEN=sequences is not None, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, batch=batch,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k,
    )


def _common_constexprs(q, k, scores):
    head_dim = q.shape[-1]
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=padded_head_dim(head_dim),
        IEEE_FP32=q.dtype == torch.float32,
        **scores.constexprs(),
    )


def _launch_fwd(q, k, v, o, lse, scores, softmax_scale, config):
    block_m, block_n, warps, stages = config
    heads = q.shape[1]
    _attn_fwd_kernel[(cdiv(scores.seqlen_q, block_m) * heads * scores.batch,)](
        q, k, v, o, lse, *scores.pointers(),
        *scores.strides(q), *scores.strides(k), *scores.strides(v), *scores.strides(o), *scores.strides(lse, 2),
        scores.alibi.stride(0), heads, scores.seqlen_q, scores.seqlen_k, softmax_scale * LOG2E, *scores.runtime_args(),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        **_common_constexprs(q, k, scores),
    )


@on_input_device
def attention_fwd(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                  dropout_p=0.0, dropout_seed=None):
    """(o, lse): o (B, H, Sq, D) in q's dtype laid out as (B, Sq, H, D), lse (B, H, Sq) fp32 natural log.
    window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed: see _score_options."""
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    # o is laid out as (B, Sq, H, D), the contract of remat.ops.attention.attention_fwd.
    o = q.new_empty((batch, seqlen_q, heads, head_dim)).transpose(1, 2)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if seqlen_k == 0:  # no key at all: every row sees an empty set
        return o.zero_(), lse.fill_(float("-inf"))
    _forward(q, k, v, o, lse, causal, softmax_scale,
             (window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed))
    return o, lse


def _forward(q, k, v, o, lse, causal, softmax_scale, features, sequences=None):
    """Writes o and lse: the forward kernel on (B, H, S, D) tensors (packed ones viewed so, with
    sequences as _score_options takes them). features: window_left ... dropout_seed, as attention_fwd's."""
    if softmax_scale < 0:
        # The forward's unmasked steps take the row maximum of the unscaled scores, which needs
        # a non-negative scale: c q k^T = |c| q (-k)^T. (A copy of k, for this odd case only.)
        k, softmax_scale = -k, -softmax_scale
    scores = _score_options(q, k, lse, causal, softmax_scale, *features, sequences=sequences)
    launch = functools.partial(_launch_fwd, q, k, v, o, lse, scores, softmax_scale)
    launch(_select_config("fwd", q, k, scores, launch))


def _packed_rows(t):
    """A packed (total, H, D) tensor as the kernels take it: a (1, H, total, D) view."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _no_rows_or_keys(rows, keys, max_seqlen_q, max_seqlen_k):
    """True when a packed problem has nothing for the kernels: no query row or no key at all."""
    return rows.numel() == 0 or keys.numel() == 0 or max_seqlen_q == 0 or max_seqlen_k == 0


@on_input_device
def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                         window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                         dropout_seed=None):
    """(o, lse) of packed sequences: q (total_q, H, D), k and v (total_k, H_kv, D), sequence b's rows
    cu_seqlens[b]:cu_seqlens[b + 1] (int32) of each, at most max_seqlen rows long. o (total_q, H, D)
    contiguous in q's dtype, lse (H, total_q) fp32 natural log (-inf and o = 0 for a row that sees
    no key). The features as attention_fwd's, per sequence (ALiBi slopes (B, H): per sequence)."""
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if _no_rows_or_keys(o, k, max_seqlen_q, max_seqlen_k):
        return o.zero_(), lse.fill_(float("-inf"))
    _forward(_packed_rows(q), _packed_rows(k), _packed_rows(v), _packed_rows(o), lse.unsqueeze(0), causal,
             softmax_scale, (window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed),
             (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return o, lse


def _launch_dkdv(q, k, v, do, lse, delta, dk, dv, scores, softmax_scale, config):
    block_m, block_n, warps, stages = config
    kv_heads = k.shape[1]
    _attn_bwd_dkdv_kernel[(cdiv(scores.seqlen_k, block_n) * kv_heads * scores.batch,)](
        q, k, v, do, lse, delta, dk, dv, *scores.pointers(),
        *scores.strides(q), *scores.strides(k), *scores.strides(v), *scores.strides(do), *scores.strides(lse, 2),
        *scores.strides(dk), *scores.strides(dv), scores.alibi.stride(0),
        kv_heads, scores.seqlen_q, scores.seqlen_k, softmax_scale * LOG2E, softmax_scale, *scores.runtime_args(),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        **_common_constexprs(q, k, scores),
    )


def _launch_dq(q, k, v, do, lse, delta, dq, scores, softmax_scale, config):
    block_m, block_n, warps, stages = config
    heads = q.shape[1]
    _attn_bwd_dq_kernel[(cdiv(scores.seqlen_q, block_m) * heads * scores.batch,)](
        q, k, v, do, lse, delta, dq, *scores.pointers(),
        *scores.strides(q), *scores.strides(k), *scores.strides(v), *scores.strides(do), *scores.strides(lse, 2),
        *scores.strides(dq), scores.alibi.stride(0),
        heads, scores.seqlen_q, scores.seqlen_k, softmax_scale * LOG2E, softmax_scale, *scores.runtime_args(),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        **_common_constexprs(q, k, scores),
    )


def _launch_preprocess(o, do, delta, block_m):
    batch, heads, seqlen_q, head_dim = o.shape
    _attn_bwd_preprocess_kernel[(cdiv(seqlen_q, block_m) * heads * batch,)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], *delta.stride()[:2], heads, seqlen_q,
        HEAD_DIM=head_dim, D_PAD=padded_head_dim(head_dim), BLOCK_M=block_m, num_warps=_PRE_WARPS,
    )


@on_input_device
def attention_bwd(do, q, k, v, o, lse, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                  alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    """(dq, dk, dv), contiguous, in the shapes and dtypes of q, k, v."""
    do, q, k, v, o = (unit_last_stride(t) for t in (do, q, k, v, o))
    lse = lse.contiguous()
    batch, heads, seqlen_q, head_dim = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0:
        # Sq == 0 (no query: k and v get no gradient) or Sk == 0 (o was 0: q gets none).
        return dq.zero_(), dk.zero_(), dv.zero_()

    _backward(do, q, k, v, o, lse, dq, dk, dv, causal, softmax_scale,
              (window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed))
    return dq, dk, dv


def _backward(do, q, k, v, o, lse, dq, dk, dv, causal, softmax_scale, features, sequences=None):
    """Writes dq, dk and dv: the backward kernels on (B, H, S, D) tensors, as _forward."""
    delta = torch.empty_like(lse)
    # The row reduction runs on every row alike, packed or not (it needs no sequence bounds).
    _launch_preprocess(o, do, delta, _PRE_BLOCK_M if q.device.type == "cuda" else _PRE_BLOCK_M_INTERPRETER)
    scores = _score_options(q, k, lse, causal, softmax_scale, *features, sequences=sequences)
    launch = functools.partial(_launch_dkdv, q, k, v, do, lse, delta, dk, dv, scores, softmax_scale)
    launch(_select_config("dkdv", q, k, scores, launch))
    launch = functools.partial(_launch_dq, q, k, v, do, lse, delta, dq, scores, softmax_scale)
    launch(_select_config("dq", q, k, scores, launch))


@on_input_device
def attention_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                         dropout_p=0.0, dropout_seed=None):
    """(dq, dk, dv) of attention_varlen_fwd, contiguous, in the shapes and dtypes of q, k, v."""
    do, q, k, v, o = (unit_last_stride(t) for t in (do, q, k, v, o))
    lse = lse.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if _no_rows_or_keys(dq, dk, max_seqlen_q, max_seqlen_k):
        return dq.zero_(), dk.zero_(), dv.zero_()
    _backward(*(_packed_rows(t) for t in (do, q, k, v, o)), lse.unsqueeze(0),
              *(_packed_rows(t) for t in (dq, dk, dv)), causal, softmax_scale,
              (window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed),
              (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# 5. Ahead-of-time compile cases
# ---------------------------------------------------------------------------------------------
# Each case calls a launcher above on CPU tensors; tests/_helpers/triton_aot.py compiles the kernel it
# launches for a GPU, specialised by Triton on the real arguments. Two shapes: "div16", whose
# head count, sequence lengths and strides are multiples of 16 (the variant the benchmarks and
# most training runs launch), and "ragged", whose head count and lengths are not.
# (heads, seqlen) per shape. GQA group sizes are constexprs too; production launches any, but the
# group only changes the trip count of an outer loop, so one value (1: heads == kv_heads) is compiled.
AOT_SHAPES = {"div16": (16, 256), "ragged": (3, 255)}
# The kernel variants besides plain causal and non-causal: name -> (causal, keyword arguments of
# attention_fwd / attention_bwd; varlen: packed sequences, as attention_varlen_fwd / _bwd launch).
# Each feature alone, the window, softcapping and ALiBi at once (the most live values in the score
# computation), and packed sequences plain and with a window, ALiBi per sequence and dropout.
AOT_FEATURES = {
    "window": (True, dict(window_left=100)),
    "softcap": (False, dict(softcap=30.0)),
    "alibi": (True, dict(alibi_slopes="per-head")),
    "window-softcap-alibi": (False, dict(window_left=100, window_right=27, softcap=30.0, alibi_slopes="per-batch")),
    "dropout": (True, dict(dropout_p=0.1)),
    "varlen": (True, dict(varlen=True)),
    "varlen-window-alibi-dropout": (False, dict(varlen=True, window_left=100, window_right=27,
                                                alibi_slopes="per-batch", dropout_p=0.1)),
}
_AOT_SEQUENCES = 3  # packed sequences of a varlen case, splitting the shape's rows


def _aot_tensors(dtype, head_dim, shape, varlen=False):
    heads, seqlen = AOT_SHAPES[shape]
    if varlen:  # packed (total, H, D) tensors, viewed as the kernels take them
        q, k, v, do, o = (_packed_rows(torch.empty(seqlen, heads, head_dim, dtype=dtype)) for _ in range(5))
        lse, delta = (torch.empty(heads, seqlen).unsqueeze(0) for _ in range(2))
        return q, k, v, do, o, lse, delta
    q, k, v, do = (torch.empty(1, heads, seqlen, head_dim, dtype=dtype) for _ in range(4))
    o = torch.empty(1, seqlen, heads, head_dim, dtype=dtype).transpose(1, 2)  # as attention_fwd's
    lse, delta = (torch.empty(1, heads, seqlen) for _ in range(2))
    return q, k, v, do, o, lse, delta


def _aot_scores(q, k, lse, causal, features, scale):
    options = {**dict(window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None), **features}
    batch = q.shape[0]
    if options.pop("varlen", False):
        total = q.shape[2]
        cu_seqlens = torch.tensor([0, total // 4, total // 2, total], dtype=torch.int32)
        options["sequences"] = (cu_seqlens, cu_seqlens, total - total // 2, total - total // 2)
        batch = _AOT_SEQUENCES
    if "dropout_p" in options:
        options["dropout_seed"] = torch.empty(1, dtype=torch.int64)
    if options["alibi_slopes"] is not None:  # "per-head": (H,), "per-batch": (B, H)
        per_batch = options["alibi_slopes"] == "per-batch"
        options["alibi_slopes"] = torch.empty((batch, q.shape[1]) if per_batch else q.shape[1:2])
    return _score_options(q, k, lse, causal, scale, **options)


def _aot_launch(kind, dtype, head_dim, causal, shape, config, features=None):
    q, k, v, do, o, lse, delta = _aot_tensors(dtype, head_dim, shape, (features or {}).get("varlen", False))
    scale = head_dim**-0.5
    scores = _aot_scores(q, k, lse, causal, features or {}, scale)
    if kind == "fwd":
        _launch_fwd(q, k, v, o, lse, scores, scale, config)
    elif kind == "dkdv":
        _launch_dkdv(q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v), scores, scale, config)
    elif kind == "dq":
        _launch_dq(q, k, v, do, lse, delta, torch.empty_like(q), scores, scale, config)
    else:  # the backward's preprocess
        _launch_preprocess(o, do, delta, _PRE_BLOCK_M)


def _aot_variants(causals, features):
    """(name, causal, feature keywords) of the kernel variants to compile."""
    plain = [("causal" if causal else "full", causal, None) for causal in causals]
    return plain + [(name, *AOT_FEATURES[name]) for name in features]


def aot_cases(dtypes=(torch.float16, torch.bfloat16, torch.float32), head_dims=HEAD_DIMS, causals=(False, True),
              shapes=tuple(AOT_SHAPES), features=tuple(AOT_FEATURES)):
    """Launches of every configuration the launchers above can use on a GPU: each autotuning
    candidate (the table entry among them) of each kernel, and the preprocess, at each shape;
    for plain causal and non-causal attention (causals) and the variants of AOT_FEATURES (features).
    The Hopper-only candidates carry archs=(90,): they are launched, and compiled, on sm_90 only.
    Keys: name, launch, archs, kind, table (True for the fixed-table entry), shape, variant.

    Distinct configurations only: head dims 80 and 96 compile separately from 128 (HEAD_DIM is
    a constexpr) although they share its block sizes.
    """
    cases = []
    for dtype, head_dim, shape in ((t, d, s) for t in dtypes for d in head_dims for s in shapes):
        tag = f"{TYPE_NAMES[dtype]}_d{head_dim}"
        for variant, causal, keywords in _aot_variants(causals, features):
            # The candidates _select_config offers the variant: a window takes the causal ones.
            tuned_causal = causal or "window_left" in (keywords or {})
            for kind in KINDS:
                score_features = set(keywords or {}) - {"varlen"}  # packed sequences take the plain candidates
                featured = dict(features=bool(score_features), dropout="dropout_p" in score_features)
                everywhere = candidates(kind, head_dim, dtype, causal=tuned_causal, **featured)
                for config in candidates(kind, head_dim, dtype, hopper=True, causal=tuned_causal, **featured):
                    bm, bn, w, st = config
                    cases.append(dict(
                        name=f"{kind}_{tag}_{variant}_BM{bm}_BN{bn}_w{w}_s{st}_{shape}",
                        launch=functools.partial(_aot_launch, kind, dtype, head_dim, causal, shape, config, keywords),
                        archs=None if config in everywhere else (90,), kind=kind, table=config == everywhere[0],
                        shape=shape, variant=variant,
                    ))
        cases.append(dict(name=f"pre_{tag}_BM{_PRE_BLOCK_M}_{shape}", archs=None, kind="pre", table=True, shape=shape,
                          variant=None, launch=functools.partial(_aot_launch, "pre", dtype, head_dim, False, shape,
                                                                 None)))
    return cases
