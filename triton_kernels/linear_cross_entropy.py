"""Linear + cross-entropy (a language model's head and its loss) in Triton; the backward recomputes
the logits instead of keeping them.

The forward never writes the (tokens x vocabulary) logits. Each program computes tiles of
z = x W^T + b (tl.dot over the hidden dim, fp32 accumulation), applies the optional softcap and
folds every tile at once into four per-token numbers for its part of the vocabulary: the running
maximum, the sum of exponentials relative to it, the target's logit and (label smoothing) the sum
of the logits. A second, small kernel combines the parts into the fp32 log-sum-exp and the loss of
each token. Autograd then keeps the lse (4 bytes a token) besides the caller's x, weight and target.

The backward walks the vocabulary in chunks of columns. For each chunk it rebuilds the chunk's
logits tile by tile from x, W and the saved lse, and writes their gradient dz (tokens x chunk, in
x's dtype, which is what stock autograd hands the matmul's backward) into one reused buffer; then
  dx  (+)= dz @ W[chunk]       accumulated over the chunks in fp32 (a (tokens, hidden) buffer),
  dW[chunk] = dz^T @ x         complete within the chunk: the rows of dW are disjoint per chunk,
  db[chunk] = column sums of dz, from fp32 per-program partials summed in a second step.
Every output element is written by exactly one program in a fixed order: no atomics, the results
are bitwise reproducible run to run on one GPU.

Why no CUDA path: the work is three GEMMs of (tokens x vocabulary x hidden) with a softmax
epilogue on the first; Triton's tl.dot already runs them on the tensor cores (wgmma on sm_90,
mma on sm_80), and a hand-written CUDA kernel would be a CUTLASS GEMM with the same epilogue:
more code to keep right for a gain nothing here shows. The Triton kernels are the only kernels.

Layout of this file, top to bottom:
  1. configuration: fixed tiles per kernel and dtype, vocabulary splits, chunk widths
  2. the logit tile shared by the forward and the backward (one definition: the backward rebuilds
     the forward's logits, to the rounding of its tile shape's summation order)
  3. forward kernels: the per-split online softmax, then the combine into lse and loss
  4. backward kernels: dz of a chunk (and db partials), dx, dW, the db column sums
  5. launchers: linear_cross_entropy_fwd, linear_cross_entropy_bwd
  6. aot_cases(): the launch configurations, for the ahead-of-time compile test

Tensor contract:
  x (M, K) with unit column stride and any row stride; weight (V, K) with unit column stride, in
  x's dtype; bias (V,) or None, x's dtype or fp32; target (M,) integer class indices (int64, int32
  or uint8), ignore_index marking tokens without a loss. Forward returns loss (M,) fp32, 0 for ignored
  tokens (NaN for a target outside [0, V) that is not ignore_index: never a silent wrong loss), and
  lse (M,) fp32, natural log. Logits of -inf (a -inf bias) count as F.cross_entropy counts them:
  nothing in the lse (a block of them adds 0), +inf loss where the target's is -inf, lse -inf and
  a NaN loss where every logit is. Backward takes dloss (M,) fp32 of any stride (0 for a sum's expanded
  gradient) and returns dx (M, K) contiguous in x's dtype, dW (V, K) in weight's, db (V,) in bias's;
  each an empty (0,) tensor when not asked for. All arithmetic is fp32.
  Vocabulary parallel (vocab_total > 0): weight (and bias) hold rows vocab_start .. vocab_start + V of a
  vocabulary of vocab_total; the forward returns the shard's lse and its part of the loss (section 3),
  the backward takes the lse combined over the shards and returns the shard's part of dx.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import TYPE_NAMES, cdiv, check_float_tensor, next_power_of_2, num_sms, on_input_device, unit_last_stride
from .attention import _tanh

# ---------------------------------------------------------------------------------------------
# 1. Configuration
# ---------------------------------------------------------------------------------------------


class Tiles(NamedTuple):
    """A GEMM kernel's launch configuration: output tile (BLOCK_M, BLOCK_N), reduction step BLOCK_K."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# Per kernel: "forward" (BLOCK_M tokens x BLOCK_N vocabulary columns, stepping over the hidden
# dim, with the online softmax's running values besides), "logits" (the backward's dz tiles, the
# same product), "dx" (BLOCK_M tokens x BLOCK_N hidden, stepping over a chunk's columns), "dw"
# (BLOCK_M vocabulary rows x BLOCK_N hidden, stepping over tokens).
# 16-bit inputs: the classic tensor-core tile, 128 x 128 with 64-deep steps, 8 warps, 3 stages (96
# KiB of shared memory: within sm_80's 163 KiB); the forward 128 x 64: at 128 x 128 its running
# maximum, sums and the options' values took sm_80 to 255 registers (no margin left). fp32 inputs
# multiply in full fp32 (input_precision="ieee", as torch's default fp32 matmul; tf32 would round
# the inputs to 10 mantissa bits) on FMA units: smaller tiles, 8 warps where 4 took sm_80 to 255
# registers or spilled. Registers a thread, the most over the cases of aot_cases(), sm_80 / sm_90
# (tests/package/test_triton_aot.py compiles every one for both and fails on any spill): bf16
# forward 174 / 148, logits (dz) 208 / 239, dx 175 / 107, dw 170 / 112; fp32 forward 244 / 128,
# logits 212 / 162, dx 108 / 66, dw 101 / 64.
HALF_TILES = {"forward": Tiles(128, 64, 64, 8, 3), "logits": Tiles(128, 128, 64, 8, 3), "dx": Tiles(128, 128, 64, 8, 3),
              "dw": Tiles(128, 128, 64, 8, 3)}
FP32_TILES = {"forward": Tiles(64, 64, 32, 8, 2), "logits": Tiles(64, 64, 32, 4, 2), "dx": Tiles(64, 64, 32, 8, 2),
              "dw": Tiles(64, 64, 32, 8, 2)}
# Programs sharing a band of GROUP_M row blocks sweep the columns together, so both operands' tiles
# are reused from L2 (the ordering of the Triton matmul tutorial).
GROUP_M = 8
# Forward: programs per row block, each over a contiguous part of the vocabulary. With at least
# MIN_SPLITS parts, the programs resident at once cover few row blocks (whose x tiles stay in L2,
# re-read for every vocabulary block) and many parts of W (each W tile read by every resident row
# block at about the same time). Small batches get more parts, to fill the GPU: about
# PROGRAMS_PER_SM programs an SM in all.
MIN_SPLITS = 16
PROGRAMS_PER_SM = 2
MAX_SPLITS = 1024  # the combine kernel holds one row's parts in registers
COMBINE_TILE = 2048  # elements of (rows x parts) a combine program holds
# Backward: a chunk's dz buffer holds about max(x's elements, CHUNK_ELEMENTS) values (the size of x
# for training batches, 32 MiB of bf16 for small ones), in whole multiples of CHUNK_ALIGN columns.
# On CPU tensors (the interpreter) a small budget, so that the tests' small vocabularies run
# several chunks: the accumulating paths are the ones a GPU runs.
CHUNK_ELEMENTS = 2**24
CPU_CHUNK_ELEMENTS = 2**14
CHUNK_ALIGN = 128
# The db column sums: (BLOCK_G partial rows) x (BLOCK_N columns) a step.
COLUMN_SUMS_BLOCK_G, COLUMN_SUMS_BLOCK_N, COLUMN_SUMS_WARPS = 32, 128, 4


def tiles(kernel: str, dtype: torch.dtype) -> Tiles:
    return (FP32_TILES if dtype == torch.float32 else HALF_TILES)[kernel]


def vocab_splits(row_blocks: int, vocab_blocks: int, device) -> int:
    """Parts of the vocabulary per row block in the forward (see MIN_SPLITS). Depends only on the
    shape and the device: the lse's summation order, hence its rounding, is fixed for both."""
    wanted = max(MIN_SPLITS, cdiv(PROGRAMS_PER_SM * num_sms(device), row_blocks))
    return max(1, min(vocab_blocks, wanted, MAX_SPLITS))


def chunk_columns(tokens: int, hidden: int, vocab: int, device) -> int:
    """Vocabulary columns per backward chunk (see CHUNK_ELEMENTS): a multiple of CHUNK_ALIGN, at
    most the vocabulary rounded up to one."""
    budget = max(tokens * hidden, CHUNK_ELEMENTS if torch.device(device).type == "cuda" else CPU_CHUNK_ELEMENTS)
    columns = max(CHUNK_ALIGN, budget // max(tokens, 1) // CHUNK_ALIGN * CHUNK_ALIGN)
    return min(columns, cdiv(vocab, CHUNK_ALIGN) * CHUNK_ALIGN)


# ---------------------------------------------------------------------------------------------
# 2. Shared tiles
# ---------------------------------------------------------------------------------------------


@triton.jit
def _grouped(pid, blocks_m, blocks_n, GROUP: tl.constexpr):
    # (pid_m, pid_n) of program `pid` over a (blocks_m, blocks_n) grid, GROUP row blocks a band.
    band_size = GROUP * blocks_n
    band = pid // band_size
    first_m = band * GROUP
    rows_in_band = tl.minimum(blocks_m - first_m, GROUP)
    within = pid % band_size
    return first_m + within % rows_in_band, within // rows_in_band


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # fp32 operands: full fp32 products (tl.dot's default there is tf32). Half operands ignore it.
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _logit_tile(X, W, B, rows, cols, row_mask, col_mask, K, stride_x, stride_w, softcap,
                HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # (z, t): the fp32 logits z = x W^T + b of `rows` x `cols` after the softcap, and t = tanh of
    # the capped logit over the cap (z = softcap * t), whose derivative 1 - t^2 the backward needs;
    # t is z itself without a cap. Masked rows and columns hold the bias (or 0): callers mask them.
    x_rows = X + rows.to(tl.int64)[:, None] * stride_x
    w_rows = W + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot(x, tl.trans(w), acc, IEEE)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    t = acc
    if SOFTCAP:
        t = _tanh(acc / softcap)
        acc = t * softcap
    return acc, t


# ---------------------------------------------------------------------------------------------
# 3. Forward
# ---------------------------------------------------------------------------------------------
# Per token i (z_ij its logits after bias and softcap, t_i its target, eps the label smoothing,
# lam the z-loss coefficient, V the vocabulary):
#   lse_i  = log sum_j exp(z_ij)
#   loss_i = (1 - eps) (lse_i - z_it) + eps (lse_i - mean_j z_ij) + lam lse_i^2
#          = lse_i - (1 - eps) z_it - (eps / V) sum_j z_ij + lam lse_i^2,      0 when t_i is ignored.
# Program (row block r, split s) covers vocabulary blocks [s * per_split, (s + 1) * per_split) and
# writes for each row: max_j z_ij, sum_j exp(z_ij - max), z_it (0 when t_i is elsewhere) and
# sum_j z_ij, into Partials (planes, M, splits). Row counts are not specialised (do_not_specialize):
# one compiled variant serves every number of tokens; nor is a vocabulary shard's first row.
# A tensor-parallel shard (W holding rows vocab_start .. vocab_start + V of a vocabulary of
# vocab_total, 0 for the whole) compares the targets with its columns' places in the whole vocabulary
# and writes, as its loss, the part it holds of the loss's terms that are sums over the vocabulary:
#   part_i = - (1 - eps) z_it [t_i in the shard] - (eps / vocab_total) sum_{j in shard} z_ij
# the caller adding the shards' parts and lse_i + lam lse_i^2 of their combined log-sum-exp.
@triton.jit(do_not_specialize=["M", "vocab_start"])
def _lce_fwd_kernel(
    X,  # (M, K) input, row stride stride_x, column stride 1
    W,  # (V, K) weight, row stride stride_w, column stride 1
    B,  # (V,) bias; any valid pointer when HAS_BIAS is False
    Target,  # (M,) class indices
    Partials,  # (3 or 4, M, splits) fp32 output: maxima, exponential sums, target logits, logit sums
    M, V, K, stride_x, stride_w, splits, per_split, softcap, vocab_start,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    row_block = pid // splits
    split = pid % splits
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    # The target's column in this weight: outside [0, V) (another shard's, ignored) it matches none.
    target = tl.load(Target + rows, mask=row_mask, other=-1) - vocab_start

    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    exp_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    first = split * per_split
    last = tl.minimum(first + per_split, tl.cdiv(V, BLOCK_N))
    for block in range(first, last):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < V
        z, _ = _logit_tile(X, W, B, rows, cols, row_mask, col_mask, K, stride_x, stride_w, softcap,
                           HAS_BIAS, SOFTCAP, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        z_real = tl.where(col_mask[None, :], z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z_real, axis=1))
        # While every logit so far is -inf (a -inf bias, a mask added to it), the maximum stays -inf
        # and exp(z - max) would be exp(-inf + inf) = NaN: shifting by 0 then makes every term
        # exp(-inf) = 0, so such a block contributes nothing, as to F.cross_entropy's log-sum-exp.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - shift)
        exp_sum = exp_sum * rescale + tl.sum(tl.exp(z_real - shift[:, None]), axis=1)
        running_max = new_max
        target_logit += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
        if SMOOTHING:
            logit_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)

    plane = M.to(tl.int64) * splits
    out = Partials + rows.to(tl.int64) * splits + split
    tl.store(out, running_max, mask=row_mask)
    tl.store(out + plane, exp_sum, mask=row_mask)
    tl.store(out + 2 * plane, target_logit, mask=row_mask)
    if SMOOTHING:
        tl.store(out + 3 * plane, logit_sum, mask=row_mask)


@triton.jit(do_not_specialize=["M"])
def _lce_fwd_combine_kernel(
    Partials,  # (3 or 4, M, splits) fp32, as _lce_fwd_kernel wrote them
    Target,  # (M,) class indices
    Loss,  # (M,) fp32 output: the loss, or a shard's part of it (not WHOLE)
    Lse,  # (M,) fp32 output
    M, vocab_total, splits, ignore_index, label_smoothing, z_loss,
    SMOOTHING: tl.constexpr, WHOLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    parts = tl.arange(0, BLOCK_S)
    row_mask = rows < M
    # Rows past M repeat the last row (their results are not stored): no -inf - -inf nor log(0).
    rows = tl.minimum(rows, M - 1)
    mask = (parts < splits)[None, :]
    plane = M.to(tl.int64) * splits
    offsets = rows.to(tl.int64)[:, None] * splits + parts[None, :]

    maxima = tl.load(Partials + offsets, mask=mask, other=float("-inf"))
    sums = tl.load(Partials + plane + offsets, mask=mask, other=0.0)
    row_max = tl.max(maxima, axis=1)
    # Parts whose logits are all -inf have maximum -inf and sum 0: they add exp(-inf) * 0 = 0. A row
    # whose every logit is -inf shifts by 0 (not -inf - -inf) and gets lse = log(0) = -inf, its loss
    # -inf + inf = NaN, as F.cross_entropy's.
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    lse = shift + tl.log(tl.sum(sums * tl.exp(maxima - shift[:, None]), axis=1))
    target_logit = tl.sum(tl.load(Partials + 2 * plane + offsets, mask=mask, other=0.0), axis=1)
    loss = -(1.0 - label_smoothing) * target_logit
    if WHOLE:
        loss += lse + z_loss * lse * lse
    if SMOOTHING:
        logit_sum = tl.sum(tl.load(Partials + 3 * plane + offsets, mask=mask, other=0.0), axis=1)
        loss -= (label_smoothing / vocab_total) * logit_sum

    target = tl.load(Target + rows)
    in_range = (target >= 0) & (target < vocab_total)
    loss = tl.where(target != ignore_index, tl.where(in_range, loss, float("nan")), 0.0)
    tl.store(Loss + rows, loss, mask=row_mask)
    tl.store(Lse + rows, lse, mask=row_mask)


# ---------------------------------------------------------------------------------------------
# 4. Backward
# ---------------------------------------------------------------------------------------------
# Gradient derivation, per token i with upstream gradient g_i (dloss_i), p_ij = exp(z_ij - lse_i):
#   d lse_i / d z_ij = p_ij
#   d loss_i / d z_ij = p_ij (1 + 2 lam lse_i) - (1 - eps) [j = t_i] - eps / V
#   dz_ij = g_i * that, 0 for an ignored token; with a softcap z = c tanh(u / c) on the raw
#   logit u, du_ij = dz_ij (1 - tanh^2(u / c)).
# A shard of the vocabulary (see the forward) takes the combined lse and forms its columns' dz with
# V the whole vocabulary's size and its columns' places in it: its dx is its part of the sum over j.
# Then dx_i = sum_j du_ij W_j, dW_j = sum_i du_ij x_i, db_j = sum_i du_ij. du is rounded to x's
# dtype before the two GEMMs, as stock autograd rounds the logits' gradient; db sums it in fp32
# before that rounding.
@triton.jit(do_not_specialize=["M", "vocab_start"])
def _lce_bwd_logit_grads_kernel(
    X,  # (M, K) input, row stride stride_x
    W,  # (V, K) weight, row stride stride_w
    B,  # (V,) bias; any valid pointer when HAS_BIAS is False
    Target,  # (M,) class indices
    Lse,  # (M,) fp32, the forward's
    DLoss,  # (M,) upstream gradient, element stride stride_dloss (0: one value for every token)
    DZ,  # (M, >= width) output in x's dtype, row stride stride_dz: the chunk's logit gradients
    DBPartials,  # (cdiv(M, BLOCK_M), >= width) fp32 output, row stride stride_dbp; written when DB_PARTIALS
    M, V, K, first_col, width, stride_x, stride_w, stride_dloss, stride_dz, stride_dbp,
    ignore_index, label_smoothing, z_loss, softcap, vocab_start,
    HAS_BIAS: tl.constexpr, DB_PARTIALS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(width, BLOCK_N), GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within the chunk
    cols = first_col + local
    row_mask = rows < M
    col_mask = local < width  # the chunk ends at or before V
    z, t = _logit_tile(X, W, B, rows, cols, row_mask, col_mask, K, stride_x, stride_w, softcap,
                       HAS_BIAS, SOFTCAP, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)

    lse = tl.load(Lse + rows, mask=row_mask, other=0.0)
    target = tl.load(Target + rows, mask=row_mask, other=ignore_index)
    upstream = tl.load(DLoss + rows.to(tl.int64) * stride_dloss, mask=row_mask, other=0.0).to(tl.float32)
    # A target outside the vocabulary had a NaN loss: its gradients are NaN too, never a guess. V is
    # the whole vocabulary's size, cols + vocab_start the columns' places in it (a shard's, see above).
    upstream = tl.where((target >= 0) & (target < V), upstream, float("nan"))
    counted = row_mask & (target != ignore_index)
    p = tl.exp(z - lse[:, None])
    dz = p * (1.0 + 2.0 * z_loss * lse)[:, None] - label_smoothing / V
    dz -= tl.where(cols[None, :] + vocab_start == target[:, None], 1.0 - label_smoothing, 0.0)
    dz *= upstream[:, None]
    if SOFTCAP:
        dz *= 1.0 - t * t
    # where, not a multiply by 0: an ignored token's row stays 0 even where its logits are NaN.
    keep = counted[:, None] & col_mask[None, :]
    dz = tl.where(keep, dz, 0.0)

    out = DZ + rows.to(tl.int64)[:, None] * stride_dz + local[None, :]
    tl.store(out, dz.to(DZ.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
    if DB_PARTIALS:  # a bias that trains: the column sums of this tile's fp32 dz
        tl.store(DBPartials + pid_m.to(tl.int64) * stride_dbp + local, tl.sum(dz, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["M"])
def _lce_bwd_dx_kernel(
    DZ,  # (M, >= width) the chunk's logit gradients, row stride stride_dz
    W,  # (V, K) weight, row stride stride_w; the chunk is rows first_col .. first_col + width
    Acc,  # (M, K) fp32 sum over the previous chunks, row stride stride_acc; read when ACCUMULATE
    Out,  # (M, K) output, row stride stride_out: the fp32 sum, or dx in its dtype after the last chunk
    M, K, first_col, width, stride_dz, stride_w, stride_acc, stride_out,
    ACCUMULATE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    k_mask = ks < K
    dz_rows = DZ + rows.to(tl.int64)[:, None] * stride_dz
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, width, BLOCK_K):
        cs = start + tl.arange(0, BLOCK_K)
        c_mask = cs < width
        dz = tl.load(dz_rows + cs[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        w = tl.load(W + (first_col + cs).to(tl.int64)[:, None] * stride_w + ks[None, :],
                    mask=c_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot(dz, w, acc, IEEE)
    mask = row_mask[:, None] & k_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if ACCUMULATE:
        acc += tl.load(Acc + rows64 * stride_acc + ks[None, :], mask=mask, other=0.0)
    tl.store(Out + rows64 * stride_out + ks[None, :], acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _lce_bwd_dw_kernel(
    DZ,  # (M, >= width) the chunk's logit gradients, row stride stride_dz
    X,  # (M, K) input, row stride stride_x
    DW,  # (V, K) output, row stride stride_dw: rows first_col .. first_col + width written here
    M, K, first_col, width, stride_dz, stride_x, stride_dw,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    # BLOCK_M vocabulary rows of dW x BLOCK_N hidden columns, summing over the tokens BLOCK_K at a time.
    pid_v, pid_n = _grouped(tl.program_id(0), tl.cdiv(width, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP)
    local = pid_v * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    v_mask = local < width
    k_mask = ks < K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, M, BLOCK_K):
        rs = start + tl.arange(0, BLOCK_K)
        r_mask = rs < M
        rs64 = rs.to(tl.int64)
        dz_t = tl.load(DZ + rs64[None, :] * stride_dz + local[:, None], mask=v_mask[:, None] & r_mask[None, :],
                       other=0.0)  # (BLOCK_M, BLOCK_K): dz transposed
        x = tl.load(X + rs64[:, None] * stride_x + ks[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot(dz_t, x, acc, IEEE)
    out = DW + (first_col + local).to(tl.int64)[:, None] * stride_dw + ks[None, :]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=v_mask[:, None] & k_mask[None, :])


@triton.jit
def _column_sums_kernel(
    Partials,  # (groups, >= width) fp32, row stride stride_p
    Out,  # (V,) output: elements first_col .. first_col + width written here
    groups, width, stride_p, first_col,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The second step of db: each column's partial sums added in a fixed order.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < width
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, groups, BLOCK_G):
        gs = start + tl.arange(0, BLOCK_G)
        part = tl.load(Partials + gs.to(tl.int64)[:, None] * stride_p + cols[None, :],
                       mask=(gs < groups)[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(part, axis=0)
    tl.store(Out + first_col + cols, acc.to(Out.dtype.element_ty), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# 5. Launchers
# ---------------------------------------------------------------------------------------------
TARGET_DTYPES = (torch.int64, torch.int32, torch.uint8)


def _check_inputs(x, weight, bias, target):
    """The shapes every launcher relies on: a wrong one would be read out of bounds, silently."""
    check_float_tensor("x", x, dims=2)
    check_float_tensor("weight", weight, dims=2, like=("x", x), dtypes=(x.dtype,))
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must have shape (vocabulary, {x.shape[1]}), got {tuple(weight.shape)}")
    if bias is not None:
        check_float_tensor("bias", bias, shape=(weight.shape[0],), like=("x", x),
                           dtypes=tuple(dict.fromkeys((x.dtype, torch.float32))))
    if not isinstance(target, torch.Tensor) or target.dtype not in TARGET_DTYPES:
        raise TypeError(f"target must be a tensor of dtype int64, int32 or uint8, got "
                        f"{getattr(target, 'dtype', type(target).__name__)}")
    if tuple(target.shape) != (x.shape[0],):
        raise ValueError(f"target must have shape ({x.shape[0]},), got {tuple(target.shape)}")


def _whole_vocabulary(vocab_start, vocab_total, rows):
    """The size of the vocabulary a weight of `rows` rows is a shard of, from row vocab_start (vocab_total 0:
    the weight is the whole of it); a ValueError where the shard does not lie within it."""
    if vocab_total and not 0 <= vocab_start <= vocab_total - rows:
        raise ValueError(f"a weight of {rows} rows from row vocab_start={vocab_start} must lie within the "
                         f"vocabulary of vocab_total={vocab_total} rows")
    return int(vocab_total or rows)


class _Prepared(NamedTuple):
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    target: torch.Tensor


def _prepared(x, weight, bias, target):
    """The inputs with a unit last stride (a copy only where needed), bias contiguous, target as
    contiguous int64 (the kernels' one index type); an absent bias is replaced by x as the
    never-read placeholder pointer."""
    x, weight = unit_last_stride(x), unit_last_stride(weight)
    bias = bias.contiguous() if bias is not None else x
    return _Prepared(x, weight, bias, target.to(torch.int64).contiguous())


@on_input_device
def linear_cross_entropy_fwd(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, vocab_start=0,
                             vocab_total=0):
    """(loss, lse) of tokens x (M, K) against classes weight (V, K) (+ bias (V,)): see the contract
    in the module docstring; softcap None or a positive float. With vocab_total > 0, weight holds rows
    vocab_start .. vocab_start + V of that vocabulary, and loss is the shard's part (section 3)."""
    return forward(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, vocab_start, vocab_total)


def forward(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, vocab_start=0, vocab_total=0,
            splits=None):
    """linear_cross_entropy_fwd with the number of vocabulary splits given (None: vocab_splits)."""
    _check_inputs(x, weight, bias, target)
    M, K = x.shape
    V = weight.shape[0]
    whole = _whole_vocabulary(vocab_start, vocab_total, V)
    loss = torch.empty((M,), dtype=torch.float32, device=x.device)
    lse = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return loss, lse
    p = _prepared(x, weight, bias, target)
    config = tiles("forward", x.dtype)
    row_blocks, vocab_blocks = cdiv(M, config.block_m), cdiv(V, config.block_n)
    per_split = cdiv(vocab_blocks, splits or vocab_splits(row_blocks, vocab_blocks, x.device))
    splits = cdiv(vocab_blocks, per_split)  # no empty split
    smoothing = label_smoothing != 0.0
    partials = torch.empty((4 if smoothing else 3, M, splits), dtype=torch.float32, device=x.device)
    _lce_fwd_kernel[(row_blocks * splits,)](
        p.x, p.weight, p.bias, p.target, partials, M, V, K, p.x.stride(0), p.weight.stride(0), splits, per_split,
        float(softcap or 1.0), int(vocab_start),
        HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, SMOOTHING=smoothing, IEEE=x.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.warps, num_stages=config.stages,
    )
    block_s = next_power_of_2(splits)
    block_rows = max(1, COMBINE_TILE // block_s)
    _lce_fwd_combine_kernel[(cdiv(M, block_rows),)](
        partials, p.target, loss, lse, M, whole, splits, int(ignore_index), float(label_smoothing),
        float(z_loss), SMOOTHING=smoothing, WHOLE=not vocab_total, BLOCK_M=block_rows, BLOCK_S=block_s, num_warps=4,
    )
    return loss, lse


@on_input_device
def linear_cross_entropy_bwd(dloss, x, weight, bias, target, lse, ignore_index, label_smoothing, z_loss, softcap,
                             need_dx, need_dweight, need_dbias, vocab_start=0, vocab_total=0):
    """(dx, dweight, dbias) of linear_cross_entropy_fwd for the upstream gradient dloss (M,),
    recomputing the logits chunk by chunk from x, weight and the forward's lse; an output not
    asked for (or dbias without a bias) is an empty (0,) tensor. A shard of the vocabulary (vocab_total
    > 0) takes the lse combined over the shards and returns its part of dx."""
    return backward(dloss, x, weight, bias, target, lse, ignore_index, label_smoothing, z_loss, softcap,
                    need_dx, need_dweight, need_dbias, vocab_start, vocab_total)


def backward(dloss, x, weight, bias, target, lse, ignore_index, label_smoothing, z_loss, softcap,
             need_dx, need_dweight, need_dbias, vocab_start=0, vocab_total=0, columns=None):
    """linear_cross_entropy_bwd with the chunk width given (None: chunk_columns)."""
    _check_inputs(x, weight, bias, target)
    M, K = x.shape
    V = weight.shape[0]
    whole = _whole_vocabulary(vocab_start, vocab_total, V)
    check_float_tensor("dloss", dloss, shape=(M,), like=("x", x), dtypes=(torch.float32, torch.float64, x.dtype))
    check_float_tensor("lse", lse, shape=(M,), like=("x", x), dtypes=(torch.float32,))
    device = x.device
    need_dbias = bool(need_dbias) and bias is not None
    dx = torch.empty((M, K) if need_dx else (0,), dtype=x.dtype, device=device)
    dweight = torch.empty((V, K) if need_dweight else (0,), dtype=weight.dtype, device=device)
    dbias = torch.empty((V,) if need_dbias else (0,), dtype=bias.dtype if need_dbias else x.dtype, device=device)
    if M == 0 or not (need_dx or need_dweight or need_dbias):
        return dx, dweight.zero_(), dbias.zero_()  # no token: the parameters' gradients are 0

    p = _prepared(x, weight, bias, target)
    ieee = x.dtype == torch.float32
    logits, dx_tiles, dw_tiles = tiles("logits", x.dtype), tiles("dx", x.dtype), tiles("dw", x.dtype)
    columns = min(columns or chunk_columns(M, K, V, device), V)
    chunks = [(start, min(columns, V - start)) for start in range(0, V, columns)]
    # Reused by every chunk; rows padded to a multiple of 16 elements, so that Triton can prove them
    # 16-byte aligned and vectorise their loads whatever the vocabulary (GPT-2's 50257 in one chunk).
    padded = cdiv(columns, 16) * 16
    dz = torch.empty((M, padded), dtype=x.dtype, device=device)
    row_blocks = cdiv(M, logits.block_m)
    db_partials = torch.empty((row_blocks, padded) if need_dbias else (0,), dtype=torch.float32, device=device)
    # The fp32 sum of dx over the chunks: dx itself when it is fp32, none for a single chunk.
    dx_sum = dx if ieee or len(chunks) == 1 else torch.empty((M, K), dtype=torch.float32, device=device)
    common = dict(IEEE=ieee, GROUP=GROUP_M)

    for index, (first_col, width) in enumerate(chunks):
        _lce_bwd_logit_grads_kernel[(row_blocks * cdiv(width, logits.block_n),)](
            p.x, p.weight, p.bias, p.target, lse, dloss, dz, db_partials if need_dbias else dz,
            M, whole, K, first_col, width, p.x.stride(0), p.weight.stride(0), dloss.stride(0),
            dz.stride(0), padded, int(ignore_index), float(label_smoothing), float(z_loss), float(softcap or 1.0),
            int(vocab_start),
            HAS_BIAS=bias is not None, DB_PARTIALS=need_dbias, SOFTCAP=softcap is not None,
            BLOCK_M=logits.block_m, BLOCK_N=logits.block_n, BLOCK_K=logits.block_k,
            num_warps=logits.warps, num_stages=logits.stages, **common,
        )
        if need_dbias:
            _column_sums_kernel[(cdiv(width, COLUMN_SUMS_BLOCK_N),)](
                db_partials, dbias, row_blocks, width, padded, first_col,
                BLOCK_G=COLUMN_SUMS_BLOCK_G, BLOCK_N=COLUMN_SUMS_BLOCK_N, num_warps=COLUMN_SUMS_WARPS,
            )
        if need_dx and K > 0:
            out = dx if index == len(chunks) - 1 else dx_sum
            _lce_bwd_dx_kernel[(cdiv(M, dx_tiles.block_m) * cdiv(K, dx_tiles.block_n),)](
                dz, p.weight, dx_sum, out, M, K, first_col, width, dz.stride(0), p.weight.stride(0),
                dx_sum.stride(0), out.stride(0), ACCUMULATE=index > 0,
                BLOCK_M=dx_tiles.block_m, BLOCK_N=dx_tiles.block_n, BLOCK_K=dx_tiles.block_k,
                num_warps=dx_tiles.warps, num_stages=dx_tiles.stages, **common,
            )
        if need_dweight and K > 0:
            _lce_bwd_dw_kernel[(cdiv(width, dw_tiles.block_m) * cdiv(K, dw_tiles.block_n),)](
                dz, p.x, dweight, M, K, first_col, width, dz.stride(0), p.x.stride(0), dweight.stride(0),
                BLOCK_M=dw_tiles.block_m, BLOCK_N=dw_tiles.block_n, BLOCK_K=dw_tiles.block_k,
                num_warps=dw_tiles.warps, num_stages=dw_tiles.stages, **common,
            )
    return dx, dweight, dbias


# ---------------------------------------------------------------------------------------------
# 6. Ahead-of-time compile cases
# ---------------------------------------------------------------------------------------------
# Each case calls a launcher above on CPU tensors (torch.empty: nothing is written; the weight's
# pages are never touched); tests/_helpers/triton_aot.py compiles the kernels it launches for a
# GPU, specialised by Triton on the real arguments. Production shapes: hidden 4096 and the
# vocabularies of Llama 3 (128256), Qwen 2 (151936), Gemma (256000) and GPT-2 (50257, not a
# multiple of 16: its own variant), with 256 tokens. The backward runs twice: over chunks of 48000
# columns (two to six: the first, accumulating and last dx variants) and over one chunk of the whole
# vocabulary (the single-chunk dx). The forward runs 16 splits (a training batch's count) or 264 (a small batch
# filling an H100, 251 once no split is empty: the combine's widest BLOCK_S).
AOT_HIDDEN, AOT_TOKENS, AOT_CHUNK = 4096, 256, 48000
AOT_VOCABS = (128256, 151936, 256000, 50257)


def _aot_launch(direction, dtype, vocab, hidden, with_bias, softcap, smoothing, splits=None, shards=1):
    """shards > 1: the launches of rank 1's shard of the vocabulary split over `shards` ranks."""
    rows = cdiv(vocab, shards)
    shard = (rows, vocab) if shards > 1 else (0, 0)
    x = torch.empty((AOT_TOKENS, hidden), dtype=dtype)
    weight = torch.empty((rows, hidden), dtype=dtype)
    bias = torch.empty((rows,), dtype=dtype) if with_bias else None
    target = torch.empty((AOT_TOKENS,), dtype=torch.int64)
    options = (-100, 0.1 if smoothing else 0.0, 1e-4, softcap)
    if direction == "fwd":
        forward(x, weight, bias, target, *options, *shard, splits=splits)
    else:
        for columns in (AOT_CHUNK, rows):
            backward(torch.empty((AOT_TOKENS,)), x, weight, bias, target, torch.empty((AOT_TOKENS,)), *options,
                     True, True, True, *shard, columns=columns)


def aot_cases():
    """Launches covering every kernel variant the launchers run on a GPU: per dtype (bf16 standing
    for fp16: same code), forward and backward, plain and with every option (bias, softcap, label
    smoothing: the most live values), at each production vocabulary; the forward also at the widest
    combine. Keys: name, launch, dtype, vocab, options ("plain" or "all"), direction."""
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in AOT_VOCABS:
            for options in ("plain", "all"):
                every = options == "all"
                for direction in ("fwd", "bwd"):
                    cases.append(dict(
                        name=f"{direction}_{TYPE_NAMES[dtype]}_V{vocab}_K{AOT_HIDDEN}_{options}",
                        launch=functools.partial(_aot_launch, direction, dtype, vocab, AOT_HIDDEN, every,
                                                 30.0 if every else None, every),
                        dtype=dtype, vocab=vocab, options=options, direction=direction,
                    ))
        for direction in ("fwd", "bwd"):  # tensor parallel: a shard of Llama 3's vocabulary over 8 ranks
            cases.append(dict(
                name=f"{direction}_{TYPE_NAMES[dtype]}_V128256_K{AOT_HIDDEN}_all_shard_of_8",
                launch=functools.partial(_aot_launch, direction, dtype, 128256, AOT_HIDDEN, True, 30.0, True, shards=8),
                dtype=dtype, vocab=128256, options="all", direction=direction,
            ))
        cases.append(dict(
            name=f"fwd_{TYPE_NAMES[dtype]}_V128256_K{AOT_HIDDEN}_plain_small_batch",
            launch=functools.partial(_aot_launch, "fwd", dtype, 128256, AOT_HIDDEN, False, None, False, 264),
            dtype=dtype, vocab=128256, options="plain", direction="fwd",
        ))
    return cases

