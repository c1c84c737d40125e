"""GELU (exact erf, tanh approximation, or QuickGELU) with an optional fused bias, in Triton; the
backward recomputes the pre-activation (and, on request, the output) from x.

The forward keeps nothing beyond the caller's x (and bias). The backward reads x and dy once,
rebuilds h = x + bias and gelu'(h) in registers, writes dx, and can also write y = gelu(h),
bitwise equal to what the forward wrote, for a consumer that needs it (the weight gradient of the
Linear after the activation): a fused MLP then never stores the activation.

Layout of this file, top to bottom:
  1. configuration heuristics: (M, N, dtype, device) -> tiles, warps and grids, no autotuning
  2. the fp32 math shared by every kernel (one definition: forward and recomputed y agree bitwise)
  3. forward kernels: dense elementwise (no bias, contiguous rows) and 2-D tiles (bias or strided rows)
  4. backward kernels: the same two shapes; the tiled one is persistent and writes dbias partials
  5. launchers: gelu_fwd, gelu_bwd
  6. aot_cases(): every launch configuration above, for the ahead-of-time compile test

Tensor contract (shared with the CUDA extension):
  x (M, N) with unit column stride and any row stride; bias (N,) or None, fp32 or x.dtype;
  dy (M, N) with unit column stride and its own row stride; y, dx (M, N) contiguous in x.dtype;
  dbias (N,) in bias.dtype, summed over rows in fp32 from the fp32 values of dy * gelu'(h) (before
  dx is rounded to x.dtype). All arithmetic is fp32.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from ._common import TYPE_NAMES, cdiv, num_sms, on_input_device, unit_last_stride

# ---------------------------------------------------------------------------------------------
# 1. Configuration
# ---------------------------------------------------------------------------------------------
# GELU is memory bound (a few dozen flops per element against 4-8 bytes moved), so the
# configuration only has to keep enough bytes in flight with full-width vector accesses and
# few wasted lanes.
#
# Dense path (no bias, rows contiguous): the (M, N) matrix is one flat array, cut into blocks of
# FLAT_BLOCK elements: no lane is wasted whatever N is (N = 1 included).
FLAT_BLOCK = 4096
FLAT_WARPS = 8
# Tiled path (a bias to broadcast over rows, or rows with a stride != N): [BLOCK_M, BLOCK_N]
# tiles of TILE_BYTES of input, 32 bytes a thread at TILE_WARPS warps (16 bf16 or 8 fp32
# elements: two 16-byte accesses per tensor; 16 fp32 elements spilled on sm_80 where the width
# is not a multiple of 16, each element then having its own predicate). The tile size is fixed
# per dtype, so registers a thread do not depend on the shape: BLOCK_N only trades rows for
# columns.
TILE_BYTES = 8192
TILE_WARPS = 8
# BLOCK_N: WIDE_BLOCK_N (16 rows of 512 bytes of bf16: whole 128-byte lines, one bias load per
# 16 rows), or NARROW_BLOCK_N where that pads the row much less (rows up to ~200 wide, or just
# past a multiple of 256 such as 1025; a 127-wide row would leave half the lanes of a 256-wide
# block idle). Two candidates only: every one multiplies the compiled variants (aot_cases), and
# tests/package/test_triton_aot.py compiles them all for two archs.
WIDE_BLOCK_N = 256
NARROW_BLOCK_N = 32
# The wide block may pad the row by up to this factor more than the narrow one.
PADDING_SLACK = 1.125
# Backward (tiled): persistent grid of (column blocks, G) programs; G row groups make the dbias
# partial buffer (G, N). Programs resident at once per SM: with a bias the backward uses 75-124
# registers a thread (tests/package/test_triton_aot.py, sm_80/sm_90), so two 8-warp programs fit in the
# 64K registers of an SM. More would only run in a second wave and add rows to the buffer.
BWD_PROGRAMS_PER_SM = 2


def _tile_config(n: int, dtype: torch.dtype, has_bias: bool = True):
    """(BLOCK_M, BLOCK_N, num_warps) of the tiled kernels for rows of n elements of dtype.

    Without a bias the tiled kernels serve only rows with a stride != N (dense rows take the
    flat kernels): a rare case, given the wide block whatever n, to keep compiled variants few.
    """
    block_n = WIDE_BLOCK_N
    if has_bias and cdiv(n, WIDE_BLOCK_N) * WIDE_BLOCK_N > PADDING_SLACK * cdiv(n, NARROW_BLOCK_N) * NARROW_BLOCK_N:
        block_n = NARROW_BLOCK_N
    tile = TILE_BYTES // torch.empty(0, dtype=dtype).element_size()
    return tile // block_n, block_n, TILE_WARPS


def _bwd_groups(m: int, block_m: int, col_blocks: int, device) -> int:
    """G, the row groups of the persistent backward: about BWD_PROGRAMS_PER_SM programs per SM in
    all, never more groups than row blocks. Depends only on (M, N, device): the dbias reduction
    order, hence its rounding, is fixed for a given shape and device."""
    programs = num_sms(device) * BWD_PROGRAMS_PER_SM
    return max(1, min(cdiv(m, block_m), programs // col_blocks))


APPROXIMATIONS = ("none", "tanh", "quick")


def _check_approximate(approximate):
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    return approximate


# ---------------------------------------------------------------------------------------------
# 2. Shared fp32 math
# ---------------------------------------------------------------------------------------------
# Every kernel calls these two helpers, so the forward and the backward's RECOMPUTE_OUTPUT
# compile the same fp32 expression for gelu(h) (same operations, same order, same fma
# contraction): the recomputed y is bitwise equal to the forward's.
#
# Exact:  gelu(h) = h * Phi(h),  Phi(h) = (1 + erf(h / sqrt 2)) / 2.
# Tanh:   gelu(h) = h (1 + tanh u) / 2,  u = sqrt(2/pi) (h + 0.044715 h^3).
#   (1 + tanh u) / 2 = sigmoid(2u) = s, so gelu(h) = h * s.
# Quick:  gelu(h) = h * sigmoid(1.702 h)  (QuickGELU, as CLIP uses it).
# sigmoid(z) is computed from e = exp(-|z|), which lies in (0, 1] and never overflows: s = 1 / (1 + e)
#   for z >= 0 and e / (1 + e) for z < 0. Unlike 1 + tanh(u) in fp32, this keeps full relative
#   precision in the negative tail, where 1 + tanh(u) cancels (about 1e-7 absolute error there),
#   and saturates exactly: s -> 1 or 0. Also s (1 - s) = e / (1 + e)^2 for either sign of z,
#   without cancellation (backward).
SQRT_HALF = tl.constexpr(1.0 / math.sqrt(2.0))
INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
TANH_CUBIC = tl.constexpr(0.044715)
TANH_CUBIC_X3 = tl.constexpr(3.0 * 0.044715)
QUICK_SCALE = tl.constexpr(1.702)


@triton.jit
def _sigmoid_gate(z):
    """(sigmoid(z), sigmoid(z) (1 - sigmoid(z))), both without overflow or cancellation (above)."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    return tl.where(z >= 0, r, e * r), e * r * r


@triton.jit
def _gelu_gate(h, APPROXIMATE: tl.constexpr):
    """(g, aux) with gelu(h) = h * g: g = Phi(h) (exact), sigmoid(2u) (tanh) or sigmoid(1.702 h)
    (quick); aux = s (1 - s) for the sigmoid forms (used by the derivative only; dead code in the
    forward), unused 0 for exact."""
    if APPROXIMATE == "tanh":
        u = SQRT_2_OVER_PI * h * (1.0 + TANH_CUBIC * h * h)
        g, aux = _sigmoid_gate(2.0 * u)
    elif APPROXIMATE == "quick":
        g, aux = _sigmoid_gate(h * QUICK_SCALE)
    else:
        g = 0.5 * (1.0 + tl.math.erf(h * SQRT_HALF))
        aux = 0.0
    return g, aux


@triton.jit
def _gelu_derivative(h, g, aux, APPROXIMATE: tl.constexpr):
    """gelu'(h) from _gelu_gate's (g, aux); see the derivation above _gelu_bwd_kernel."""
    if APPROXIMATE == "quick":
        # s + 1.702 h s (1 - s): where s (1 - s) underflows to 0 the second term is 0 (h finite).
        d = g + h * (aux * QUICK_SCALE)
    elif APPROXIMATE == "tanh":
        # s + h * 2 s (1 - s) * du/dh,  du/dh = sqrt(2/pi) (1 + 3 * 0.044715 h^2). Where s (1 - s)
        # underflows to 0 the second term is 0, also for |h| > ~1e19 where h^2 overflows (0 * inf);
        # 0 * h rather than 0 keeps h = +-inf giving NaN, as PyTorch's gelu backward does.
        slope = 2.0 * h * aux * (SQRT_2_OVER_PI * (1.0 + TANH_CUBIC_X3 * h * h))
        d = g + tl.where(aux > 0.0, slope, 0.0 * h)
    else:
        # Phi(h) + h phi(h),  phi(h) = exp(-h^2 / 2) / sqrt(2 pi); exp underflows to 0 for
        # |h| > ~14, where h * phi is 0, not NaN.
        d = g + h * (tl.exp(-0.5 * h * h) * INV_SQRT_2PI)
    return d


# ---------------------------------------------------------------------------------------------
# 3. Forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _gelu_fwd_flat_kernel(
    X,  # (M, N) input, contiguous: M * N elements
    Y,  # (M, N) output, contiguous
    M,
    N,
    APPROXIMATE: tl.constexpr,  # "none", "tanh" or "quick"
    BLOCK: tl.constexpr,  # elements per program
):
    # Elementwise over the flat array. M and N come separately (each < 2**31, so always i32
    # arguments) and the size is formed in int64 here: M * N may exceed 2**31.
    size = tl.cast(M, tl.int64) * N
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < size
    h = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    g, _ = _gelu_gate(h, APPROXIMATE)
    tl.store(Y + offsets, (h * g).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile on a 1-D grid of row blocks x column blocks (column block fastest, so
    neighbouring programs share rows; a 1-D grid has no 65535 limit on either count): (rows, cols,
    mask), rows as an int64 column (M * stride may exceed 2**31), cols a row of indices."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows.to(tl.int64)[:, None], cols, mask


@triton.jit
def _gelu_fwd_kernel(
    X,  # (M, N) input, row stride stride_x_row, column stride 1
    B,  # (N,) bias, fp32 or X's dtype; any valid pointer when HAS_BIAS is False
    Y,  # (M, N) output, contiguous (row stride N)
    stride_x_row,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    APPROXIMATE: tl.constexpr,  # "none", "tanh" or "quick"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    h = tl.load(X + rows * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    g, _ = _gelu_gate(h, APPROXIMATE)
    tl.store(Y + rows * N + cols[None, :], (h * g).to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 4. Backward
# ---------------------------------------------------------------------------------------------
# Gradient derivation, per element, h = x + bias (bias = 0 when absent):
#
#   dx = dy * gelu'(h),     dbias_j = sum over rows i of dy_ij * gelu'(h_ij)   (dh/dbias = 1)
#
#   Exact: gelu(h) = h Phi(h), Phi' = phi, phi(h) = exp(-h^2/2) / sqrt(2 pi), so
#       gelu'(h) = Phi(h) + h phi(h).
#   Tanh: gelu(h) = h (1 + t) / 2, t = tanh(u), u = sqrt(2/pi) (h + 0.044715 h^3), tanh' = 1 - t^2:
#       gelu'(h) = (1 + t) / 2 + h (1 - t^2) / 2 * du/dh,   du/dh = sqrt(2/pi) (1 + 3 * 0.044715 h^2).
#     With s = (1 + t) / 2 = sigmoid(2u): 1 - t^2 = (1 - t)(1 + t) = 4 s (1 - s), so
#       gelu'(h) = s + 2 h s (1 - s) du/dh,
#     which _gelu_gate/_gelu_derivative evaluate from e = exp(-2|u|) (see section 2).
#   Quick: gelu(h) = h s, s = sigmoid(1.702 h), s' = s (1 - s):  gelu'(h) = s + 1.702 h s (1 - s).
#
# Nothing but x (and the bias) is needed: h, Phi or s, gelu'(h) and, with RECOMPUTE_OUTPUT,
# y = h * g are rebuilt in registers in one pass that reads x and dy once. dbias sums the fp32
# products dy * gelu'(h) (not dx rounded to x's dtype): each program accumulates its rows in an
# fp32 tile and writes one row of a (G, N) partial buffer; a second step sums the G rows
# (deterministic, no atomics).
@triton.jit
def _gelu_bwd_flat_kernel(
    X,  # (M, N) forward input, contiguous
    DY,  # (M, N) gradient of y, contiguous
    DX,  # (M, N) output, contiguous
    Y,  # (M, N) output y, contiguous, written when RECOMPUTE_OUTPUT; any valid pointer otherwise
    M,
    N,
    APPROXIMATE: tl.constexpr,  # "none", "tanh" or "quick"
    RECOMPUTE_OUTPUT: tl.constexpr,
    BLOCK: tl.constexpr,  # elements per program
):
    # No bias, dense rows: elementwise over the flat array, as _gelu_fwd_flat_kernel.
    size = tl.cast(M, tl.int64) * N
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < size
    h = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    g, aux = _gelu_gate(h, APPROXIMATE)
    dx = dy * _gelu_derivative(h, g, aux, APPROXIMATE)
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    if RECOMPUTE_OUTPUT:
        tl.store(Y + offsets, (h * g).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(
    X,  # (M, N) forward input, row stride stride_x_row, column stride 1
    DY,  # (M, N) gradient of y, row stride stride_dy_row, column stride 1
    B,  # (N,) bias, fp32 or X's dtype; any valid pointer when HAS_BIAS is False
    DX,  # (M, N) output, contiguous (row stride N)
    Y,  # (M, N) output y, contiguous, written when RECOMPUTE_OUTPUT; any valid pointer otherwise
    DB_partial,  # (G, N) fp32 output, written when HAS_BIAS: row g = program row g's sum of dy * gelu'
    stride_x_row,
    stride_dy_row,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    APPROXIMATE: tl.constexpr,  # "none", "tanh" or "quick"
    RECOMPUTE_OUTPUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Persistent: grid (column blocks, G). Program (j, g) owns column block j of row blocks
    # g, g + G, g + 2G, ... (strided, so the G programs of a column get equal work to within one
    # block), and writes row g, block j of the partial buffer.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    col_mask = cols < N
    bias = 0.0
    if HAS_BIAS:
        # Loaded once, kept in registers across the loop.
        bias = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    # 2-D accumulator, reduced over rows once at the end rather than once per step.
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    for row_block in range(group, tl.cdiv(M, BLOCK_M), groups):
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        h = tl.load(X + rows64[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            h += bias
        g, aux = _gelu_gate(h, APPROXIMATE)
        # Masked lanes have dy = 0 and a finite gelu'(bias): they add exactly 0 to db_acc.
        dx = dy * _gelu_derivative(h, g, aux, APPROXIMATE)
        out_offsets = rows64[:, None] * N + cols[None, :]
        tl.store(DX + out_offsets, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db_acc += dx  # fp32, before the rounding to DX's dtype
        if RECOMPUTE_OUTPUT:
            tl.store(Y + out_offsets, (h * g).to(Y.dtype.element_ty), mask=mask)

    if HAS_BIAS:
        tl.store(DB_partial + group.to(tl.int64) * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# 5. Launchers
# ---------------------------------------------------------------------------------------------
def _dense(t):
    """True when the rows of a 2-D tensor with unit column stride are back to back."""
    return t.stride(0) == t.shape[1] or t.shape[0] == 1


@on_input_device
def gelu_fwd(x, bias, approximate):
    """gelu(x + bias) of a 2-D x.

    x (M, N), unit column stride, any row stride; bias (N,) or None, fp32 or x.dtype;
    approximate "none" (erf), "tanh" or "quick" (x * sigmoid(1.702 x)). Returns y (M, N)
    contiguous in x.dtype.
    """
    approximate = _check_approximate(approximate)
    x = unit_last_stride(x)
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if bias is None and _dense(x):
        _gelu_fwd_flat_kernel[(cdiv(M * N, FLAT_BLOCK),)](
            x, y, M, N, APPROXIMATE=approximate, BLOCK=FLAT_BLOCK, num_warps=FLAT_WARPS,
        )
        return y
    block_m, block_n, warps = _tile_config(N, x.dtype, bias is not None)
    # An absent bias is compiled out (HAS_BIAS); pass x as a placeholder pointer.
    b = bias.contiguous() if bias is not None else x
    _gelu_fwd_kernel[(cdiv(M, block_m) * cdiv(N, block_n),)](
        x, b, y, x.stride(0), M, N,
        HAS_BIAS=bias is not None, APPROXIMATE=approximate, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return y


@on_input_device
def gelu_bwd(dy, x, bias, approximate, recompute_output):
    """Gradients of gelu(x + bias), recomputing x + bias (and y when recompute_output) from x.

    Returns (dx, dbias, y): dx (M, N) contiguous in x.dtype; dbias (N,) in bias.dtype (an empty
    tensor of x.dtype when bias is None; zeros when M == 0); y (M, N), bitwise equal to gelu_fwd's
    output, when recompute_output, else an empty tensor of shape (0,).
    """
    approximate = _check_approximate(approximate)
    x = unit_last_stride(x)
    dy = unit_last_stride(dy)
    M, N = x.shape
    device = x.device
    dx = torch.empty((M, N), dtype=x.dtype, device=device)
    y = torch.empty((M, N) if recompute_output else (0,), dtype=x.dtype, device=device)
    y_arg = y if recompute_output else dx  # placeholder pointer; never written when not recomputing
    has_bias = bias is not None
    no_dbias = torch.empty(0, dtype=x.dtype, device=device)
    if M == 0 or N == 0:
        return dx, torch.zeros((N,), dtype=bias.dtype, device=device) if has_bias else no_dbias, y

    if not has_bias and _dense(x) and _dense(dy):
        _gelu_bwd_flat_kernel[(cdiv(M * N, FLAT_BLOCK),)](
            x, dy, dx, y_arg, M, N,
            APPROXIMATE=approximate, RECOMPUTE_OUTPUT=bool(recompute_output), BLOCK=FLAT_BLOCK, num_warps=FLAT_WARPS,
        )
        return dx, no_dbias, y

    block_m, block_n, warps = _tile_config(N, x.dtype, has_bias)
    col_blocks = cdiv(N, block_n)
    groups = _bwd_groups(M, block_m, col_blocks, device)
    b = bias.contiguous() if has_bias else x
    db_partial = torch.empty((groups, N), dtype=torch.float32, device=device) if has_bias else dx
    _gelu_bwd_kernel[(col_blocks, groups)](
        x, dy, b, dx, y_arg, db_partial, x.stride(0), dy.stride(0), M, N,
        HAS_BIAS=has_bias, APPROXIMATE=approximate, RECOMPUTE_OUTPUT=bool(recompute_output),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    # Second step: reduce the G partial rows. torch.sum is deterministic for a fixed G, and G
    # depends only on (M, N, device).
    dbias = db_partial.sum(0).to(bias.dtype) if has_bias else no_dbias
    return dx, dbias, y


# ---------------------------------------------------------------------------------------------
# 6. Ahead-of-time compile cases
# ---------------------------------------------------------------------------------------------
# Each case calls a launcher above on CPU tensors; tests/_helpers/triton_aot.py compiles the kernels it
# launches for a GPU, specialised by Triton on the real arguments. Every path is met at a shape
# whose sizes and row strides are multiples of 16 (the variant production shapes run) and at a
# ragged one.
# (rows, width) per BLOCK_N that _tile_config picks, 16-divisible and ragged.
_AOT_SHAPES = {WIDE_BLOCK_N: ((64, 1024), (67, 1000)), NARROW_BLOCK_N: ((64, 96), (67, 100))}


def _aot_launch(x_dtype, bias_dtype, approximate, shape, strided, backward, recompute):
    rows, width = shape
    # Strided rows (a slice of wider ones) take the tiled kernels even without a bias.
    x = torch.empty((rows, width + 16), dtype=x_dtype)[:, :width] if strided else torch.empty(shape, dtype=x_dtype)
    bias = torch.empty((width,), dtype=bias_dtype) if bias_dtype is not None else None
    if backward:
        gelu_bwd(torch.empty_like(x), x, bias, approximate, recompute)
    else:
        gelu_fwd(x, bias, approximate)


def aot_cases():
    """Launches covering every kernel variant the launchers above can run on a GPU: the flat kernels
    (no bias, dense rows) and the tiled ones (a bias of x's dtype or fp32, or strided rows) at each
    BLOCK_N they use, every approximation, x in bf16 (standing for fp16 too) and fp32, forward and
    backward with and without recompute, each at a 16-divisible and a ragged shape.
    Keys: name, launch, divisible."""
    cases = []
    variants = [(x, b, block_n) for x in (torch.bfloat16, torch.float32) for b in (None, x, torch.float32)
                for block_n in ((WIDE_BLOCK_N, NARROW_BLOCK_N) if b is not None else (WIDE_BLOCK_N,))]
    for approximate in APPROXIMATIONS:
        for x_dtype, bias_dtype, block_n in dict.fromkeys(variants):
            for divisible, shape in zip((True, False), _AOT_SHAPES[block_n]):
                # Without a bias: the flat kernels (dense rows) and the tiled ones (strided rows).
                for strided in (False, True) if bias_dtype is None else (False,):
                    kind = "tiled" if bias_dtype is not None or strided else "flat"
                    bias = TYPE_NAMES[bias_dtype] if bias_dtype is not None else "none"
                    blocks = f"_BN{block_n}" if kind == "tiled" else ""
                    tag = f"{kind}_x{TYPE_NAMES[x_dtype]}_b{bias}_{approximate}{blocks}_{shape[0]}x{shape[1]}"
                    for backward, recompute in ((False, False), (True, False), (True, True)):
                        name = f"{'bwd' if backward else 'fwd'}_{tag}" + (f"_rec{int(recompute)}" if backward else "")
                        launch = functools.partial(_aot_launch, x_dtype, bias_dtype, approximate, shape, strided,
                                                   backward, recompute)
                        cases.append(dict(name=name, launch=launch, divisible=divisible))
    return cases
