"""LayerNorm and RMSNorm forward and backward in Triton; the backward recomputes xhat (and, on
request, y).

The forward keeps only what is cheap to store: x itself (the caller's), and per row the fp32
mean and rstd (8 bytes a row). The backward rebuilds xhat = (x - mean) * rstd from those in the
same pass that computes dx, and can also rebuild y = xhat * w + b for a consumer that needs it
(e.g. the weight gradient of a following Linear), bitwise equal to what the forward wrote.

RMSNorm is a mode of the same kernels (IS_RMS_NORM): xhat = x * rstd, only the fp32 rstd stored
(4 bytes a row), no bias, and each stock module's rounding selected by a style ("torch", "llama",
"gemma", "t5": _rms_norm_mode) through two more constexprs.

Layout of this file, top to bottom:
  1. configuration heuristics: (N, dtype) -> block sizes and warps, no autotuning
  2. forward kernels: rows held in registers (N <= max_fused_n_fwd(x.dtype)), or looped over column chunks
  3. backward kernels: one fused, software-pipelined pass per row (N <= MAX_FUSED_N_BWD for rows
     Triton vectorises, MAX_FUSED_N_BWD_UNALIGNED for others), or two kernels over chunks;
     a last kernel sums the dw/db partials and casts them to the parameters' dtype
  4. launchers: layer_norm_fwd, layer_norm_bwd, rms_norm_fwd, rms_norm_bwd
  5. aot_cases(): every launch configuration above, for the ahead-of-time compile test

Tensor contract (shared with the CUDA extension):
  x (M, N) with unit column stride and any row stride; weight and bias (N,) or None, in any float
  dtype; y, dx (M, N) contiguous in x.dtype; mean, rstd (M,) fp32; dw, db in the parameter's dtype.
  RMSNorm: the same, but y (and dy) in the style's output dtype (Llama's and T5's follow the
  weight's dtype as their modules' type promotion does) and no mean. All arithmetic is fp32.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    TYPE_NAMES,
    cdiv,
    check_choice,
    check_eps,
    check_float_tensor,
    next_power_of_2,
    num_sms,
    on_input_device,
    unit_last_stride,
)

# ---------------------------------------------------------------------------------------------
# 1. Configuration
# ---------------------------------------------------------------------------------------------
# Rows wider than these do not fit in registers without spilling (checked by
# tests/package/test_triton_aot.py on sm_80 and sm_90) and take the looped paths. The forward holds one
# fp32 copy of the row and the weight: 32 KiB of input a row, i.e. 16384 bf16/fp16 or 8192 fp32
# elements. The backward holds x, dy, the weight and two fp32 gradient accumulators.
MAX_FUSED_BYTES_FWD = 32768
MAX_FUSED_N_BWD = 8192
# ... for rows that Triton can load as 16-byte vectors (N and every row stride a multiple of 16,
# 16-byte aligned base pointers: what it specialises on). Other rows are loaded element by
# element, each with its own predicate, and from 4097 elements on those spill: they take the
# looped path instead.
MAX_FUSED_N_BWD_UNALIGNED = 4096
# Elements one program handles at once for narrow rows: BLOCK_M = tile // BLOCK_N rows per
# program, so a 1024-wide row still gives each program several rows and enough bytes in flight.
# Forward: about 32 bytes of input a thread (16 bf16 or 8 fp32 elements), up to 32 warps; the
# widest rows (16384 bf16, 8192 fp32) then use 32 warps at <= 64 registers, without spilling.
# Backward: more live tensors per element, so half the tile, 4 elements a thread and 16 warps
# (8 elements a thread at 8 warps spilled on sm_90: ptxas capped the kernel at 64 registers), up
# to 16 elements a thread for 8192-wide rows (at 32 warps those spill).
FWD_TILE, FWD_BYTES_PER_THREAD, FWD_MAX_WARPS = 4096, 32, 32
BWD_TILE, BWD_ELEMENTS_PER_THREAD, BWD_MAX_WARPS = 2048, 4, 16
# Narrowest block: rows of 1..15 elements share the 16-wide configuration (wasted lanes are
# cheap there, and it keeps the number of compiled variants small).
MIN_BLOCK_N = 16
# Column chunk of the looped paths for rows wider than the fused limits.
CHUNK_N = 4096
CHUNK_WARPS = 8
# The fused backward's loop is software pipelined: the copies of the next two row blocks (cp.async
# into shared memory) are in flight while a block is computed. Pipelined only where those two
# blocks of x and dy take at most BWD_PIPELINE_BYTES (every width in bf16/fp16, up to 4096 in
# fp32 or with a bf16 x and an fp32 dy, as RMSNorm's Llama and T5 styles give for an fp32
# weight), so that two programs still share an sm_90 SM and every buffer fits an sm_80 block
# (163 KiB). recompute_output re-reads the bias each step, which is pipelined too: up to 96 KiB a
# program with a bias in x's dtype, 128 KiB with an fp32 one (one program an SM then).
# With two stages Triton issues the next block's copies only after this block's reductions,
# which hides nothing: the 8192-wide fp32 rows load directly instead.
BWD_PIPELINE_BYTES = 65536
# dw/db's second step: (BLOCK_G, BLOCK_N) fp32 tiles of the (G, N) partials, 16 a thread, one
# program per BLOCK_N columns (N = 1024 already gives 16 programs; G is a few hundred rows).
PARAM_GRADS_BLOCK_G, PARAM_GRADS_BLOCK_N, PARAM_GRADS_WARPS = 32, 64, 4
# Resident warps per SM the backward's persistent grid aims for: the fused backward's programs
# use 16 warps at up to ~64 registers a thread (more for 8192-wide rows), so about two fit an
# SM; a bigger grid would only add rows to the (G, N) partial buffers.
BWD_WARPS_PER_SM = 32


def max_fused_n_fwd(dtype: torch.dtype) -> int:
    """Widest row the forward holds in registers for input dtype `dtype`."""
    return MAX_FUSED_BYTES_FWD // _element_size(dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _fused_config(n: int, tile: int, elements_per_thread: int, max_warps: int):
    """(BLOCK_M, BLOCK_N, num_warps) for rows that fit in registers: the whole row in BLOCK_N,
    BLOCK_M rows to fill the tile, about elements_per_thread elements a thread."""
    block_n = max(MIN_BLOCK_N, next_power_of_2(n))
    block_m = max(1, tile // block_n)
    warps = max(4, min(max_warps, block_m * block_n // (32 * elements_per_thread)))
    return block_m, block_n, warps


def _fwd_config(n: int, dtype: torch.dtype):
    elements_per_thread = FWD_BYTES_PER_THREAD // _element_size(dtype)
    return _fused_config(n, FWD_TILE, elements_per_thread, FWD_MAX_WARPS)


def _bwd_config(n: int):
    return _fused_config(n, BWD_TILE, BWD_ELEMENTS_PER_THREAD, BWD_MAX_WARPS)


def _bwd_pipeline_stages(block_m: int, block_n: int, x_dtype: torch.dtype, dy_dtype: torch.dtype) -> int:
    """Row blocks in flight in the fused backward's loop, the one being computed included: 3 (two
    buffered) where two steps of x and dy fit in BWD_PIPELINE_BYTES, else 1 (no pipelining)."""
    step_bytes = block_m * block_n * (_element_size(x_dtype) + _element_size(dy_dtype))
    return 3 if 2 * step_bytes <= BWD_PIPELINE_BYTES else 1


def _fused_block_ns(limit: int):
    """Every BLOCK_N the fused path can choose up to `limit`, for aot_cases()."""
    out, b = [], MIN_BLOCK_N
    while b <= limit:
        out.append(b)
        b *= 2
    return out


# ---------------------------------------------------------------------------------------------
# 2. Forward
# ---------------------------------------------------------------------------------------------
# Row counts (M, rows_per_program, G) are not specialised (do_not_specialize): they only bound
# loops and mask rows, so one compiled variant serves every M (no recompile for M == 1 or a
# multiple of 16), and the ahead-of-time checks compile the variant any M runs. N and the row
# strides are: their divisibility by 16 is what lets Triton use 16-byte accesses.
#
# Every kernel has an RMSNorm mode (IS_RMS_NORM): no mean (xhat = x * rstd, rstd from the mean
# of squares), only rstd stored, no bias. Two more constexprs give each stock RMSNorm its own
# rounding: NORMED_DTYPE, the dtype xhat is rounded to before the weight multiply (fp32: not
# rounded), and WEIGHT_PLUS_ONE, scaling by (1 + w) instead of w. LayerNorm runs with
# IS_RMS_NORM=False, NORMED_DTYPE=fp32, WEIGHT_PLUS_ONE=False: the same code as without them.
@triton.jit
def _load_weight(W, cols, mask, WEIGHT_PLUS_ONE: tl.constexpr):
    # The weight in fp32; (1 + w) is formed in fp32, as Gemma's norm does (1.0 + weight.float()).
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_PLUS_ONE:
        w = w + 1.0
    return w


@triton.jit
def _affine(xhat, w, b, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, NORMED_DTYPE: tl.constexpr):
    # y = round(xhat) * w + b, round being the cast to NORMED_DTYPE and back (none for fp32).
    # Shared by the forward and by the backward's RECOMPUTE_OUTPUT so both compile the same fp32
    # expression (same rounding, same fma contraction): bitwise equal y.
    y = xhat.to(NORMED_DTYPE).to(tl.float32)
    if HAS_WEIGHT:
        y = y * w
    if HAS_BIAS:
        y = y + b
    return y


@triton.jit(do_not_specialize=["M"])
def _layer_norm_fwd_kernel(
    X,  # (M, N) input, row stride stride_x_row, column stride 1
    Y,  # (M, N) output, row stride stride_y_row
    W,  # (N,) weight; any valid pointer when HAS_WEIGHT is False
    B,  # (N,) bias; any valid pointer when HAS_BIAS is False
    Mean,  # (M,) fp32 output; not written when IS_RMS_NORM
    Rstd,  # (M,) fp32 output
    stride_x_row,
    stride_y_row,
    M,
    N,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    NORMED_DTYPE: tl.constexpr,
    WEIGHT_PLUS_ONE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # >= N: the whole row is in registers
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    # int64 row offsets: M * stride may exceed 2**31.
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS_NORM:
        # Mean of squares; the padding holds zeros.
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        xc = x
    else:
        # Corrected two-pass statistics: mean first, then squared deviations from it. E[x^2] -
        # E[x]^2 would lose all precision for rows with a large mean and a small spread. The
        # deviations' own mean is the rounding error of the first mean: it is added back to the
        # mean and removed from the variance (var = mean(xc^2) - mean(xc)^2, with mean(xc) tiny).
        rough_mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - rough_mean[:, None], 0.0)
        correction = tl.sum(xc, axis=1) / N
        var = tl.maximum(tl.sum(xc * xc, axis=1) / N - correction * correction, 0.0)
        rstd = tl.math.rsqrt(var + eps)
        mean = rough_mean + correction
        # Normalise with the stored mean, exactly as the backward recomputes xhat.
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)

    w = 1.0
    b = 0.0
    if HAS_WEIGHT:
        w = _load_weight(W, cols, col_mask, WEIGHT_PLUS_ONE)[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = _affine(xc * rstd[:, None], w, b, HAS_WEIGHT, HAS_BIAS, NORMED_DTYPE)
    tl.store(Y + rows64[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_fwd_looped_kernel(
    X,  # (M, N) input, row stride stride_x_row, column stride 1
    Y,  # (M, N) output, row stride stride_y_row
    W,  # (N,) weight, or any valid pointer when HAS_WEIGHT is False
    B,  # (N,) bias, or any valid pointer when HAS_BIAS is False
    Mean,  # (M,) fp32 output; not written when IS_RMS_NORM
    Rstd,  # (M,) fp32 output
    stride_x_row,
    stride_y_row,
    N,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    NORMED_DTYPE: tl.constexpr,
    WEIGHT_PLUS_ONE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # column chunk; any N
):
    # One row per program, too wide for registers: sweeps over column chunks (LayerNorm: sum,
    # squared deviations, output; RMSNorm: squares, output). The same statistics as the fused
    # kernel; the repeated reads of one row mostly hit L2.
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x_row
    Y += row * stride_y_row

    if IS_RMS_NORM:
        acc_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
            acc_sq += x * x
        rstd = tl.math.rsqrt(tl.sum(acc_sq, axis=0) / N + eps)
        mean = 0.0  # x - 0.0 is x: the output sweep below normalises as the fused kernel does
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            acc += tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / N

        # Deviations from the first mean; their own mean corrects it, as in the fused kernel.
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean, 0.0)
            acc += xc
            acc_sq += xc * xc
        correction = tl.sum(acc, axis=0) / N
        var = tl.maximum(tl.sum(acc_sq, axis=0) / N - correction * correction, 0.0)
        rstd = tl.math.rsqrt(var + eps)
        mean += correction
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)

    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        w = 1.0
        b = 0.0
        if HAS_WEIGHT:
            w = _load_weight(W, cols, mask, WEIGHT_PLUS_ONE)
        if HAS_BIAS:
            b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        y = _affine((x - mean) * rstd, w, b, HAS_WEIGHT, HAS_BIAS, NORMED_DTYPE)
        tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 3. Backward
# ---------------------------------------------------------------------------------------------
# Gradient derivation, per row of N elements (w = 1 and b = 0 when absent):
#
#   xhat_j = (x_j - mean) * rstd,    rstd = (var + eps)^(-1/2),    y_j = xhat_j * w_j + b_j
#
#   db_j = sum_rows dy_j                 dw_j = sum_rows dy_j * xhat_j
#
#   With g_j = dy_j * w_j (the gradient reaching xhat), and using
#     d mean / d x_i = 1/N,   d rstd / d x_i = -rstd^3 * (x_i - mean) / N = -rstd^2 * xhat_i / N,
#   d xhat_j / d x_i = rstd * (delta_ij - 1/N) - xhat_j * rstd * xhat_i / N, so
#
#   dx_i = sum_j g_j * d xhat_j / d x_i
#        = rstd * (g_i - c2 - xhat_i * c1),   c1 = mean_j(g_j * xhat_j),   c2 = mean_j(g_j).
#
# RMSNorm (IS_RMS_NORM): xhat_j = x_j * rstd, rstd = (mean_j(x_j^2) + eps)^(-1/2), no bias. The
# same derivation without the mean: d rstd / d x_i = -rstd^2 * xhat_i / N and
#   dx_i = rstd * (g_i - xhat_i * c1)     (c2 drops out).
# Gemma-style (WEIGHT_PLUS_ONE) scales by w' = 1 + w: g_j = dy_j * w'_j, and dw_j is unchanged
# (d w' / d w = 1). The rounding of xhat to NORMED_DTYPE before the weight multiply is taken as
# the identity, as autograd takes the stock modules' casts: dw sums dy * xhat in fp32.
#
# So a row needs x, dy, mean, rstd and two row reductions (one for RMSNorm): one pass when the
# row fits in registers. dw and db sum over rows: each program accumulates the rows it owns in
# fp32 and writes one row of a (G, N) partial buffer; a second step sums the G rows
# (deterministic, no atomics).
@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _layer_norm_bwd_kernel(
    X,  # (M, N) forward input, row stride stride_x_row
    DY,  # (M, N) gradient of y, row stride stride_dy_row
    W,  # (N,) weight, or any valid pointer when HAS_WEIGHT is False
    B,  # (N,) bias, read only when RECOMPUTE_OUTPUT and HAS_BIAS
    Mean,  # (M,) fp32, from the forward; not read when IS_RMS_NORM
    Rstd,  # (M,) fp32, from the forward
    DX,  # (M, N) output, row stride stride_dx_row
    Y,  # (M, N) output y, written when RECOMPUTE_OUTPUT, row stride stride_y_row
    DW_partial,  # (G, N) fp32 output: row g = sum of dy * xhat over program g's rows
    DB_partial,  # (G, N) fp32 output: row g = sum of dy over program g's rows
    stride_x_row,
    stride_dy_row,
    stride_dx_row,
    stride_y_row,
    M,
    N,
    rows_per_program,  # a multiple of BLOCK_M
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RECOMPUTE_OUTPUT: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    NORMED_DTYPE: tl.constexpr,
    WEIGHT_PLUS_ONE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr,  # >= N
    PIPELINE_STAGES: tl.constexpr,  # row blocks in flight, the one being computed included
):
    # Persistent: program g owns rows [g * rows_per_program, (g + 1) * rows_per_program).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = 1.0
    if HAS_WEIGHT:
        w = _load_weight(W, cols, col_mask, WEIGHT_PLUS_ONE)[None, :]
    # 2-D accumulators, reduced over rows once at the end rather than once per step.
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    # Software pipelined: Triton's pipeliner issues the loads of the next PIPELINE_STAGES - 1 row
    # blocks (cp.async into shared memory) before this block's two row reductions, whose shuffles
    # and block barrier would otherwise leave the memory system idle between blocks. The buffer
    # costs shared memory, not registers (a register double buffer spilled for 8192-wide rows).
    for first in tl.range(row_start, row_end, BLOCK_M, num_stages=PIPELINE_STAGES):
        rows = first + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        x = tl.load(X + rows64[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)

        # Recompute xhat; zero it in the padding so it adds nothing to the row sums.
        if IS_RMS_NORM:
            xhat = tl.where(mask, x * rstd[:, None], 0.0)
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * w
        c1 = tl.sum(g * xhat, axis=1) / N
        if IS_RMS_NORM:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / N
            dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dx_row + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
        if RECOMPUTE_OUTPUT:
            # The bias is re-read each step (it stays in cache) instead of held in registers
            # across the loop: wide rows run out of registers otherwise.
            b = 0.0
            if HAS_BIAS:
                b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            y = _affine(xhat, w, b, HAS_WEIGHT, HAS_BIAS, NORMED_DTYPE)
            tl.store(Y + rows64[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    partial_offsets = pid.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_partial + partial_offsets, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_partial + partial_offsets, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["G"])
def _layer_norm_param_grads_kernel(
    DW_partial,  # (G, N) fp32, from a backward kernel
    DB_partial,  # (G, N) fp32
    DW,  # (N,) output in the weight's dtype, written when HAS_WEIGHT
    DB,  # (N,) output in the bias's dtype, written when HAS_BIAS
    G,
    N,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Second step of dw and db, both in one launch: program j sums columns [j * BLOCK_N, ...) of
    # the G partial rows in fp32, BLOCK_G rows at a time in a fixed order (bitwise the same every
    # run for a given G), and writes them cast to the parameters' dtype.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw_acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for start in range(0, G, BLOCK_G):
        rows = start + tl.arange(0, BLOCK_G)
        mask = (rows < G)[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_WEIGHT:
            dw_acc += tl.load(DW_partial + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db_acc += tl.load(DB_partial + offsets, mask=mask, other=0.0)
    if HAS_WEIGHT:
        tl.store(DW + cols, tl.sum(dw_acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(db_acc, axis=0).to(DB.dtype.element_ty), mask=col_mask)


@triton.jit
def _layer_norm_bwd_row_sums_kernel(
    X,  # (M, N) forward input, row stride stride_x_row
    DY,  # (M, N) gradient of y, row stride stride_dy_row
    W,  # (N,) weight, or any valid pointer when HAS_WEIGHT is False
    Mean,  # (M,) fp32; not read when IS_RMS_NORM
    Rstd,  # (M,) fp32
    C1,  # (M,) fp32 output: mean over the row of g * xhat
    C2,  # (M,) fp32 output: mean over the row of g; not written when IS_RMS_NORM
    stride_x_row,
    stride_dy_row,
    N,
    HAS_WEIGHT: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    WEIGHT_PLUS_ONE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # column chunk; any N
):
    # Wide rows, step 1 of 2: the two row reductions of dx, one row per program, looping over
    # column chunks.
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x_row
    DY += row * stride_dy_row
    mean = 0.0
    if not IS_RMS_NORM:
        mean = tl.load(Mean + row)
    rstd = tl.load(Rstd + row)
    c1_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    c2_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * _load_weight(W, cols, mask, WEIGHT_PLUS_ONE)
        c1_acc += g * xhat
        if not IS_RMS_NORM:
            c2_acc += g
    tl.store(C1 + row, tl.sum(c1_acc, axis=0) / N)
    if not IS_RMS_NORM:
        tl.store(C2 + row, tl.sum(c2_acc, axis=0) / N)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _layer_norm_bwd_chunked_kernel(
    X,  # (M, N) forward input, row stride stride_x_row
    DY,  # (M, N) gradient of y, row stride stride_dy_row
    W,  # (N,) weight, or any valid pointer when HAS_WEIGHT is False
    B,  # (N,) bias, read only when RECOMPUTE_OUTPUT and HAS_BIAS
    Mean,  # (M,) fp32; not read when IS_RMS_NORM
    Rstd,  # (M,) fp32
    C1,  # (M,) fp32, from _layer_norm_bwd_row_sums_kernel
    C2,  # (M,) fp32, from _layer_norm_bwd_row_sums_kernel; not read when IS_RMS_NORM
    DX,  # (M, N) output, row stride stride_dx_row
    Y,  # (M, N) output y, written when RECOMPUTE_OUTPUT, row stride stride_y_row
    DW_partial,  # (G, N) fp32 output
    DB_partial,  # (G, N) fp32 output
    stride_x_row,
    stride_dy_row,
    stride_dx_row,
    stride_y_row,
    M,
    N,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RECOMPUTE_OUTPUT: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    NORMED_DTYPE: tl.constexpr,
    WEIGHT_PLUS_ONE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # column chunk
):
    # Wide rows, step 2 of 2: grid (G, cdiv(N, BLOCK_N)). Program (g, j) owns the rows of group g
    # and the columns of chunk j: dx (and y) there, and the partial sums of chunk j for group g.
    # Same arithmetic as _layer_norm_bwd_kernel, one row at a time.
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    w = 1.0
    b = 0.0
    if HAS_WEIGHT:
        w = _load_weight(W, cols, mask, WEIGHT_PLUS_ONE)
    if RECOMPUTE_OUTPUT and HAS_BIAS:
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)

    # int64 loop bounds: the loop variable is then int64 and row * stride cannot overflow.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        c1 = tl.load(C1 + row)
        if IS_RMS_NORM:
            xhat = tl.where(mask, x * rstd, 0.0)
        else:
            mean = tl.load(Mean + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * w
        if IS_RMS_NORM:
            dx = (g - xhat * c1) * rstd
        else:
            dx = (g - (xhat * c1 + tl.load(C2 + row))) * rstd
        tl.store(DX + row * stride_dx_row + cols, dx.to(DX.dtype.element_ty), mask=mask)

        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
        if RECOMPUTE_OUTPUT:
            y = _affine(xhat, w, b, HAS_WEIGHT, HAS_BIAS, NORMED_DTYPE)
            tl.store(Y + row * stride_y_row + cols, y.to(Y.dtype.element_ty), mask=mask)

    partial_offsets = pid.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_partial + partial_offsets, dw_acc, mask=mask)
    if HAS_BIAS:
        tl.store(DB_partial + partial_offsets, db_acc, mask=mask)


# ---------------------------------------------------------------------------------------------
# 4. Launchers
# ---------------------------------------------------------------------------------------------
class _Mode(NamedTuple):
    """What the kernels compute: LayerNorm (the defaults) or one RMSNorm style (section 2)."""

    rms: bool = False
    normed_dtype: torch.dtype = torch.float32  # xhat is rounded to this before the weight multiply
    weight_plus_one: bool = False

    def constexprs(self):
        return dict(IS_RMS_NORM=self.rms, NORMED_DTYPE=_TRITON_DTYPES[self.normed_dtype],
                    WEIGHT_PLUS_ONE=self.weight_plus_one)


_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_LAYER_NORM = _Mode()
RMS_NORM_STYLES = ("torch", "llama", "gemma", "t5")


def _rms_norm_mode(style, x_dtype, weight):
    """(mode, y dtype) of an RMSNorm style: the roundings of its stock module, every product in fp32.

    torch  torch.nn.RMSNorm / F.rms_norm: y = (xhat * w) cast to x's dtype.
    llama  LlamaRMSNorm: xhat cast to x's dtype, then w * that in the promoted dtype of w and x.
    gemma  GemmaRMSNorm: y = (xhat * (1 + w)) cast to x's dtype, 1 + w formed in fp32.
    t5     T5LayerNorm: xhat cast to w's dtype when that is fp16/bf16, then w * that, in w's dtype.
    """
    check_choice("style", style, RMS_NORM_STYLES)
    if weight is None and style != "torch":
        raise ValueError(f"weight is required for style {style!r} (its stock module always has one)")
    if style == "torch":
        return _Mode(rms=True), x_dtype
    if style == "llama":
        return _Mode(rms=True, normed_dtype=x_dtype), torch.promote_types(x_dtype, weight.dtype)
    if style == "gemma":
        return _Mode(rms=True, weight_plus_one=True), x_dtype
    half_weight = weight.dtype in (torch.float16, torch.bfloat16)
    return _Mode(rms=True, normed_dtype=weight.dtype if half_weight else torch.float32), weight.dtype


def _check_rms_norm_inputs(x, weight):
    check_float_tensor("x", x, dims=2)
    if weight is not None:
        check_float_tensor("weight", weight, shape=(x.shape[1],), like=("x", x))


@on_input_device
def layer_norm_fwd(x, weight, bias, eps):
    """LayerNorm over the last dim of a 2-D x.

    x (M, N), unit column stride, any row stride; weight, bias (N,) or None, any float dtype.
    Returns y (M, N) contiguous in x.dtype, and mean, rstd (M,) fp32.
    """
    return _norm_fwd(x, weight, bias, eps, _LAYER_NORM, x.dtype)


@on_input_device
def rms_norm_fwd(x, weight, eps, style):
    """RMSNorm over the last dim of a 2-D x, rounded as the stock module of `style` rounds it.

    x (M, N), unit column stride, any row stride; weight (N,) in any float dtype, or None (style
    "torch" only); eps a float (torch's eps=None stands for finfo(float32).eps for every input
    dtype but float64: the caller resolves it). style: see _rms_norm_mode.
    Returns y (M, N) contiguous in the style's output dtype (x's, but for "llama" and "t5" with
    a weight of another dtype), and rstd (M,) fp32: all that the backward needs besides x.
    """
    _check_rms_norm_inputs(x, weight)
    check_eps(eps)
    mode, y_dtype = _rms_norm_mode(style, x.dtype, weight)
    y, _, rstd = _norm_fwd(x, weight, None, eps, mode, y_dtype)
    return y, rstd


def _norm_fwd(x, weight, bias, eps, mode, y_dtype):
    """(y, mean, rstd); mean is an empty tensor for RMSNorm."""
    x = unit_last_stride(x)
    M, N = x.shape
    y = torch.empty((M, N), dtype=y_dtype, device=x.device)
    mean = torch.empty((0,) if mode.rms else (M,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y, mean, rstd
    # An absent weight, bias or mean is compiled out (HAS_WEIGHT/HAS_BIAS/IS_RMS_NORM); pass
    # another tensor as a placeholder.
    w = weight.contiguous() if weight is not None else x
    b = bias.contiguous() if bias is not None else x
    mean_arg = rstd if mode.rms else mean
    common = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **mode.constexprs())
    if N <= max_fused_n_fwd(x.dtype):
        block_m, block_n, warps = _fwd_config(N, x.dtype)
        _layer_norm_fwd_kernel[(cdiv(M, block_m),)](
            x, y, w, b, mean_arg, rstd, x.stride(0), y.stride(0), M, N, eps,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **common,
        )
    else:
        _layer_norm_fwd_looped_kernel[(M,)](
            x, y, w, b, mean_arg, rstd, x.stride(0), y.stride(0), N, eps,
            BLOCK_N=CHUNK_N, num_warps=CHUNK_WARPS, **common,
        )
    return y, mean, rstd


def _rows_vectorize(n, *tensors):
    """True when Triton specialises these rows for 16-byte vector access: N and every row stride a
    multiple of 16 elements, every base pointer 16-byte aligned (fresh outputs have stride N)."""
    return n % 16 == 0 and all(t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)


def _persistent_groups(M, block_m, programs):
    """(G, rows_per_program): at most `programs` groups of a multiple of block_m rows each."""
    rows_per_program = cdiv(cdiv(M, programs), block_m) * block_m
    return cdiv(M, rows_per_program), rows_per_program


@on_input_device
def layer_norm_bwd(dy, x, weight, bias, mean, rstd, recompute_output):
    """Gradients of LayerNorm, recomputing xhat from x, mean and rstd.

    Returns (dx, dw, db, y): dx (M, N) contiguous in x.dtype; dw, db (N,) in weight's and bias's
    dtype (empty tensors of x.dtype when the parameter is None; zeros when M == 0); y the forward
    output recomputed bitwise equal when recompute_output, else an empty tensor.
    """
    return _norm_bwd(dy, x, weight, bias, mean, rstd, recompute_output, _LAYER_NORM, x.dtype)


@on_input_device
def rms_norm_bwd(dy, x, weight, rstd, style, recompute_output):
    """Gradients of rms_norm_fwd, recomputing xhat = x * rstd from x and the forward's rstd.

    dy (M, N) in y's dtype, unit column stride. Returns (dx, dw, y): dx (M, N) contiguous in
    x.dtype; dw (N,) in weight's dtype (an empty tensor of x.dtype without a weight; zeros when
    M == 0), summed deterministically; y the forward output recomputed bitwise equal when
    recompute_output (for the weight gradient of a Linear that consumes it), else empty.
    """
    _check_rms_norm_inputs(x, weight)
    check_float_tensor("dy", dy, shape=x.shape, like=("x", x))
    check_float_tensor("rstd", rstd, shape=(x.shape[0],), like=("x", x), dtypes=(torch.float32,))
    mode, y_dtype = _rms_norm_mode(style, x.dtype, weight)
    dx, dw, _, y = _norm_bwd(dy, x, weight, None, None, rstd, recompute_output, mode, y_dtype)
    return dx, dw, y


def _norm_bwd(dy, x, weight, bias, mean, rstd, recompute_output, mode, y_dtype):
    """(dx, dw, db, y); mean is None for RMSNorm."""
    x = unit_last_stride(x)
    dy = unit_last_stride(dy)
    M, N = x.shape
    device = x.device
    dx = torch.empty((M, N), dtype=x.dtype, device=device)
    y = torch.empty((M, N) if recompute_output else (0,), dtype=y_dtype, device=device)
    has_w, has_b = weight is not None, bias is not None
    if M == 0 or N == 0:
        dw = (torch.zeros((N,), dtype=weight.dtype, device=device) if has_w
              else torch.empty(0, dtype=x.dtype, device=device))
        db = (torch.zeros((N,), dtype=bias.dtype, device=device) if has_b
              else torch.empty(0, dtype=x.dtype, device=device))
        return dx, dw, db, y

    rstd = rstd.contiguous()
    mean = rstd if mode.rms else mean.contiguous()  # a placeholder in RMSNorm mode, never read
    w = weight.contiguous() if has_w else x
    b = bias.contiguous() if has_b else x
    y_arg = y if recompute_output else dx  # placeholder pointer; never written when not recomputing
    common = dict(HAS_WEIGHT=has_w, HAS_BIAS=has_b, RECOMPUTE_OUTPUT=bool(recompute_output), **mode.constexprs())
    sms = num_sms(device)

    if N <= MAX_FUSED_N_BWD_UNALIGNED or (N <= MAX_FUSED_N_BWD and _rows_vectorize(N, x, dy)):
        block_m, block_n, warps = _bwd_config(N)
        groups, rows_per_program = _persistent_groups(M, block_m, sms * max(1, BWD_WARPS_PER_SM // warps))
        dw_partial = torch.empty((groups, N) if has_w else (0,), dtype=torch.float32, device=device)
        db_partial = torch.empty((groups, N) if has_b else (0,), dtype=torch.float32, device=device)
        stages = _bwd_pipeline_stages(block_m, block_n, x.dtype, dy.dtype)
        _layer_norm_bwd_kernel[(groups,)](
            x, dy, w, b, mean, rstd, dx, y_arg,
            dw_partial if has_w else dx, db_partial if has_b else dx,
            x.stride(0), dy.stride(0), dx.stride(0), y_arg.stride(0) if recompute_output else N,
            M, N, rows_per_program,
            BLOCK_M=block_m, BLOCK_N=block_n, PIPELINE_STAGES=stages, num_warps=warps, **common,
        )
    else:
        c1 = torch.empty((M,), dtype=torch.float32, device=device)
        c2 = c1 if mode.rms else torch.empty((M,), dtype=torch.float32, device=device)  # RMSNorm: unused
        _layer_norm_bwd_row_sums_kernel[(M,)](
            x, dy, w, mean, rstd, c1, c2, x.stride(0), dy.stride(0), N,
            HAS_WEIGHT=has_w, IS_RMS_NORM=mode.rms, WEIGHT_PLUS_ONE=mode.weight_plus_one,
            BLOCK_N=CHUNK_N, num_warps=CHUNK_WARPS,
        )
        col_blocks = cdiv(N, CHUNK_N)
        programs = max(1, sms * max(1, BWD_WARPS_PER_SM // CHUNK_WARPS) // col_blocks)
        groups, rows_per_program = _persistent_groups(M, 1, programs)
        dw_partial = torch.empty((groups, N) if has_w else (0,), dtype=torch.float32, device=device)
        db_partial = torch.empty((groups, N) if has_b else (0,), dtype=torch.float32, device=device)
        _layer_norm_bwd_chunked_kernel[(groups, col_blocks)](
            x, dy, w, b, mean, rstd, c1, c2, dx, y_arg,
            dw_partial if has_w else dx, db_partial if has_b else dx,
            x.stride(0), dy.stride(0), dx.stride(0), y_arg.stride(0) if recompute_output else N,
            M, N, rows_per_program,
            BLOCK_N=CHUNK_N, num_warps=CHUNK_WARPS, **common,
        )

    # Second step: reduce the G partial rows, in a fixed order (G depends only on (M, N, device)).
    dw = torch.empty((N,) if has_w else (0,), dtype=weight.dtype if has_w else x.dtype, device=device)
    db = torch.empty((N,) if has_b else (0,), dtype=bias.dtype if has_b else x.dtype, device=device)
    _sum_partials(dw_partial if has_w else None, db_partial if has_b else None, dw, db)
    return dx, dw, db, y


def _sum_partials(dw_partial, db_partial, dw, db):
    """dw, db = the column sums of the (G, N) fp32 partials, cast to their own dtype, in one launch
    (a partial buffer that is None has no output)."""
    has_w, has_b = dw_partial is not None, db_partial is not None
    if not (has_w or has_b):
        return
    # An absent output is compiled out (HAS_WEIGHT/HAS_BIAS): the present one's tensors stand in.
    if not has_w:
        dw_partial, dw = db_partial, db
    if not has_b:
        db_partial, db = dw_partial, dw
    groups, n = dw_partial.shape
    _layer_norm_param_grads_kernel[(cdiv(n, PARAM_GRADS_BLOCK_N),)](
        dw_partial, db_partial, dw, db, groups, n, HAS_WEIGHT=has_w, HAS_BIAS=has_b,
        BLOCK_G=PARAM_GRADS_BLOCK_G, BLOCK_N=PARAM_GRADS_BLOCK_N, num_warps=PARAM_GRADS_WARPS,
    )


# ---------------------------------------------------------------------------------------------
# 5. Ahead-of-time compile cases
# ---------------------------------------------------------------------------------------------
# Each case calls a launcher above on CPU tensors; tests/_helpers/triton_aot.py compiles the kernels it
# launches for a GPU, specialised by Triton on the real arguments. Every configuration is met at
# two widths: a multiple of 16 (Triton marks N and the row strides 16-divisible, the variant
# production widths run) and one that is not (N - 1: same blocks, no divisibility).
_DTYPE_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]


def _aot_widths(fused_limit, unaligned_limit):
    """(BLOCK_N or "looped", width, divisible) covering every configuration of a path whose fused
    kernel takes rows up to fused_limit wide, unaligned ones up to unaligned_limit."""
    for block_n in _fused_block_ns(fused_limit):
        yield block_n, block_n, True
        if block_n <= unaligned_limit:
            yield block_n, block_n - 1, False
    yield "looped", fused_limit + 16, True
    yield "looped", fused_limit + 1, False


def _aot_launch(width, divisible, x_dtype, p_dtype, affine, recompute):
    """The forward (recompute None) or the backward on CPU tensors of `width` columns."""
    rows = 64 if divisible else 67
    x = torch.empty((rows, width), dtype=x_dtype)
    w, b = (torch.empty((width,), dtype=p_dtype) if affine else None for _ in range(2))
    if recompute is None:
        layer_norm_fwd(x, w, b, 1e-5)
    else:
        layer_norm_bwd(torch.empty_like(x), x, w, b, torch.empty((rows,)), torch.empty((rows,)), recompute)


def aot_cases():
    """Launches covering every kernel variant the launchers above can run on a GPU: each dtype pair
    (bf16 stands for fp16, same code), weight and bias both present (the most registers) or both
    absent, recompute or not, every BLOCK_N and the looped paths, each at a 16-divisible and a
    ragged width; then the RMSNorm variants (rms_norm_aot_cases). Keys: name, launch, divisible,
    block_n (an int, or "looped")."""
    cases = []
    for x_dtype, p_dtype in _DTYPE_PAIRS:
        for affine in (True, False) if p_dtype == x_dtype else (True,):
            variants = [("fwd", None, _aot_widths(max_fused_n_fwd(x_dtype), max_fused_n_fwd(x_dtype)))]
            variants += [("bwd", rec, _aot_widths(MAX_FUSED_N_BWD, MAX_FUSED_N_BWD_UNALIGNED)) for rec in (False, True)]
            for direction, recompute, widths in variants:
                for block, width, divisible in widths:
                    params = TYPE_NAMES[p_dtype] if affine else "none"
                    rec = "" if recompute is None else f"_rec{int(recompute)}"
                    cases.append(dict(
                        name=f"{direction}_x{TYPE_NAMES[x_dtype]}_w{params}{rec}_BN{block}_N{width}",
                        launch=functools.partial(_aot_launch, width, divisible, x_dtype, p_dtype, affine, recompute),
                        divisible=divisible, block_n=block,
                    ))
    return cases + rms_norm_aot_cases()


# RMSNorm: each distinct compiled variant (the styles' modes and output dtypes over the dtype pairs,
# one style standing for those that compile alike). The mode adds a cast or an add per element to
# LayerNorm's code and drops the mean: every BLOCK_N is compiled for the plain torch style, the
# other variants at the widths where registers and shared memory are tightest (the widest fused
# blocks, aligned and not) and on the looped paths.
def _rms_norm_variants():
    """(style, x dtype, weight dtype or None) of every distinct RMSNorm kernel variant."""
    variants = {}
    for style in RMS_NORM_STYLES:
        for x_dtype, w_dtype in [(torch.bfloat16, None), *_DTYPE_PAIRS]:
            if w_dtype is None and style != "torch":
                continue
            weight = torch.empty(0, dtype=w_dtype) if w_dtype is not None else None
            variants.setdefault((x_dtype, w_dtype, _rms_norm_mode(style, x_dtype, weight)), (style, x_dtype, w_dtype))
    return list(variants.values())


def _rms_aot_launch(width, divisible, x_dtype, w_dtype, style, recompute):
    """rms_norm_fwd (recompute None) or rms_norm_bwd on CPU tensors of `width` columns."""
    rows = 64 if divisible else 67
    x = torch.empty((rows, width), dtype=x_dtype)
    w = torch.empty((width,), dtype=w_dtype) if w_dtype is not None else None
    if recompute is None:
        rms_norm_fwd(x, w, 1e-6, style)
    else:
        _, y_dtype = _rms_norm_mode(style, x_dtype, w)
        rms_norm_bwd(torch.empty((rows, width), dtype=y_dtype), x, w, torch.empty((rows,)), style, recompute)


def rms_norm_aot_cases():
    """The RMSNorm launches, keyed as aot_cases()'s."""
    cases = []
    for style, x_dtype, w_dtype in _rms_norm_variants():
        every_block = (style, x_dtype, w_dtype) == ("torch", torch.bfloat16, torch.bfloat16)
        limits = {"fwd": (max_fused_n_fwd(x_dtype),) * 2, "bwd": (MAX_FUSED_N_BWD, MAX_FUSED_N_BWD_UNALIGNED)}
        for direction, recompute in (("fwd", None), ("bwd", False), ("bwd", True)):
            for block, width, divisible in _aot_widths(*limits[direction]):
                if not (every_block or block == "looped" or block in limits[direction]):
                    continue
                params = TYPE_NAMES[w_dtype] if w_dtype is not None else "none"
                rec = "" if recompute is None else f"_rec{int(recompute)}"
                cases.append(dict(
                    name=f"rms_{style}_{direction}_x{TYPE_NAMES[x_dtype]}_w{params}{rec}_BN{block}_N{width}",
                    launch=functools.partial(_rms_aot_launch, width, divisible, x_dtype, w_dtype, style, recompute),
                    divisible=divisible, block_n=block,
                ))
    return cases
