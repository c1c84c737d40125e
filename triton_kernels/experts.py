"""A mixture of experts' routed expert MLPs in Triton: grouped matmuls over the (token, expert) pairs
sorted by expert, with the token gather fused into the loads; the backward rebuilds the
pre-activation and the activation instead of keeping them.

Per pair p = (t, k) routed to expert e with weight w (S = T·K pairs, sorted by expert; `order` maps
a sorted position to its pair, `offsets` (E + 1) bounds each expert's positions):

    h_p = gate_up_e x_t + b_e     (N1 = 2I gated, I plain)      a_p = act(h_p)      (I,)
    y_p = down_e a_p + c_e        (h,)                           out_t = sum_k w_p y_p

Forward, two grouped matmuls on tiles of BLOCK_M sorted positions of one expert:
  _up_kernel     x rows loaded through the pair's token (no gathered copy of x), both halves of a
                 gated h per tile of I columns, the activation in registers; writes a (S, I) (a
                 transient buffer, freed after the forward) and, with keep_hidden, h (S, N1).
  _down_kernel   y_p = down_e a_p + c_e, times w, written at row p of a (S, h) buffer that is summed
                 over k afterwards (a fixed order: no atomics).
Backward, recompute policy (h rebuilt from x; with keep_hidden read from the kept h):
  _hidden_grad_kernel  per tile of I columns: h (rebuilt), a, g = down_e^T dout_t (dout loaded through
                 the token), then dh = w g act'(h) (S, N1) and a (S, I) into transient buffers, and
                 per-tile partial sums of dw_p = <dout_t, y_p> = <g, a_p> + <dout_t, c_e>.
  _dx_kernel     dx_p = gate_up_e^T dh_p at row p of a (S, h) fp32 buffer, summed over k afterwards.
  _weight_grad_kernel  one program per (expert, output tile) sums over the expert's positions:
                 dgate_up_e = sum dh_p x_t^T (x gathered) and ddown_e = sum (w dout_t) a_p^T (dout
                 gathered and scaled), with the biases' gradients as the column sums. Every output is
                 written by one program in a fixed order: deterministic, no atomics.

The tile schedule (which expert and which positions each program of a grouped kernel takes) is
computed on the device from the offsets with a fixed upper bound on the tile count (cdiv(S,
BLOCK_M) + E): no synchronisation with the host, and programs past the last tile return at once.

Tensor contract: x (T, h), any strides; top_k_weights (T, K) any float dtype and strides; gate_up
(E, N1, h) and down (E, h, I) in x's dtype, any strides (the transposed layouts are views); biases
(E, N1), (E, h) or None; order (S,) int32, offsets (E + 1,) int32 (remat.ops.experts.route). All
arithmetic fp32; h, a and the expert output rounded to x's dtype where the stock computation rounds
them (its linear layers' outputs and, gated, act(gate) before the product with up).

Layout of this file: 1. configuration; 2. shared tiles (schedule, activations, the pre-activation);
3. forward kernels; 4. backward kernels; 5. launchers; 6. aot_cases().
"""

import contextlib
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import TYPE_NAMES, cdiv, check_choice, check_float_tensor, on_input_device
from .gelu import _gelu_derivative, _gelu_gate, _sigmoid_gate

GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_clamped")
PLAIN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")

# ---------------------------------------------------------------------------------------------
# 1. Configuration
# ---------------------------------------------------------------------------------------------


class Tiles(NamedTuple):
    """BLOCK_M sorted positions x BLOCK_N output columns, stepping BLOCK_K over the reduction."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# 16-bit inputs: 64 x 64 tiles with 64-deep steps (the gated up kernel holds two fp32 accumulators,
# gate and up, and two weight tiles); fp32 inputs multiply in full fp32 (input_precision="ieee", as
# torch's default fp32 matmul) on FMA units: 64 x 64 with 32-deep steps. The weight-gradient kernel
# reduces over the expert's positions. On CPU tensors (the interpreter) 16 x 16 x 16 tiles, so that
# the tests' small shapes run several tiles per expert, masked tails and several reduction steps.
HALF_TILES = Tiles(64, 64, 64, 8, 3)
FP32_TILES = Tiles(64, 64, 32, 8, 2)
CPU_TILES = Tiles(32, 32, 32, 4, 1)
# The backward's hidden-gradient kernel holds three fp32 (BLOCK_M, BLOCK_N) tiles (gate, up and
# down^T dout) and the activation's derivatives at once: at 64 columns it took sm_80 to 255
# registers and spilled; it takes half the columns of I and two pipeline stages (at three, sm_80 still
# spilled 8 bytes in Qwen3-MoE's bf16 layer).
HIDDEN_GRAD_COLUMNS_DIVISOR = 2


_AOT_AS_CUDA = False  # set while aot_cases() launch on CPU tensors: the tiles a GPU would get


def tiles(dtype, device, kernel=None):
    """The Tiles of the grouped kernels on `device`; kernel "hidden_grad" for _hidden_grad_kernel's."""
    if torch.device(device).type != "cuda" and not _AOT_AS_CUDA:
        return CPU_TILES
    config = FP32_TILES if dtype == torch.float32 else HALF_TILES
    if kernel == "hidden_grad":
        config = config._replace(block_n=config.block_n // HIDDEN_GRAD_COLUMNS_DIVISOR, stages=2)
    return config


# ---------------------------------------------------------------------------------------------
# 2. Shared tiles
# ---------------------------------------------------------------------------------------------


def _precision(dtype):
    """tl.dot's input_precision: fp32 operands multiply in full fp32 ("ieee"; Triton's default there is
    tf32, which rounds the inputs to 10 mantissa bits); 16-bit operands ignore it (tf32, the default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _tile_rows(TileExpert, TileRow, Offsets, Order, tile, top_k, BLOCK_M: tl.constexpr):
    # (expert, sorted positions, their mask, pairs, tokens) of tile `tile`; expert is -1 past the last tile.
    e = tl.load(TileExpert + tile)
    start = tl.load(TileRow + tile)
    end = tl.where(e >= 0, tl.load(Offsets + tl.maximum(e, 0) + 1), start)
    rows = start + tl.arange(0, BLOCK_M)
    mask = rows < end
    pair = tl.load(Order + rows, mask=mask, other=0)
    return e, rows, mask, pair, pair // top_k


@triton.jit
def _gate_up_rows(cols, intermediate, GATED: tl.constexpr, INTERLEAVED: tl.constexpr):
    # The rows of gate_up (and columns of h) holding gate and up for activation columns `cols`.
    if GATED:
        if INTERLEAVED:
            return 2 * cols, 2 * cols + 1
        else:
            return cols, cols + intermediate
    else:
        return cols, cols


@triton.jit
def _plain_activation(h, ACTIVATION: tl.constexpr):
    # (act(h), act'(h)) in fp32; the derivative is dead code where unused.
    if ACTIVATION == "silu":
        s, aux = _sigmoid_gate(h)
        value = h * s
        derivative = s + h * aux
    elif ACTIVATION == "gelu":
        g, aux = _gelu_gate(h, "none")
        value = h * g
        derivative = _gelu_derivative(h, g, aux, "none")
    elif ACTIVATION == "gelu_tanh":
        g, aux = _gelu_gate(h, "tanh")
        value = h * g
        derivative = _gelu_derivative(h, g, aux, "tanh")
    elif ACTIVATION == "relu":
        value = tl.maximum(h, 0.0)
        derivative = tl.where(h > 0.0, 1.0, 0.0)
    else:  # relu2
        r = tl.maximum(h, 0.0)
        value = r * r
        derivative = 2.0 * r
    return value, derivative


@triton.jit
def _activation(gate, up, alpha, limit, ACTIVATION: tl.constexpr, GATED: tl.constexpr, DTYPE: tl.constexpr):
    # (a, da/dgate, da/dup) in fp32 (da/dup unused for a plain activation of `gate`). A gated
    # activation rounds act(gate) to DTYPE before the product with up, as act_fn(gate) * up does.
    if GATED:
        if ACTIVATION == "swiglu_clamped":
            gate_c = tl.minimum(gate, limit)
            up_c = tl.minimum(tl.maximum(up, -limit), limit)
            s, aux = _sigmoid_gate(alpha * gate_c)
            glu = gate_c * s
            a = (up_c + 1.0) * glu
            d_gate = tl.where(gate <= limit, (up_c + 1.0) * (s + alpha * gate_c * aux), 0.0)
            d_up = tl.where((up >= -limit) & (up <= limit), glu, 0.0)
        else:
            value, derivative = _plain_activation(gate, ACTIVATION)
            value = value.to(DTYPE).to(tl.float32)
            a = value * up
            d_gate = derivative * up
            d_up = value
    else:
        a, d_gate = _plain_activation(gate, ACTIVATION)
        d_up = d_gate
    return a, d_gate, d_up


@triton.jit
def _pre_activation(X, W, B, e, tokens, row_mask, gate_rows, up_rows, col_mask, width,
                    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn,
                    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # (gate, up) tiles of h = gate_up_e x_t + b_e, fp32 rounded to x's dtype (the stock linear's
    # output): x's rows loaded through the tokens, never copied. up is gate for a plain activation.
    w_expert = W + e.to(tl.int64) * stride_we
    x_rows = X + tokens.to(tl.int64)[:, None] * stride_xt
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, width, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < width
        x = tl.load(x_rows + ks[None, :] * stride_xh, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(w_expert + gate_rows[None, :] * stride_wn + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_expert + up_rows[None, :] * stride_wn + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        b_expert = B + e.to(tl.int64) * stride_be
        acc_gate += tl.load(b_expert + gate_rows * stride_bn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_expert + up_rows * stride_bn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    gate = acc_gate.to(X.dtype.element_ty).to(tl.float32)
    if GATED:
        up = acc_up.to(X.dtype.element_ty).to(tl.float32)
    else:
        up = gate
    return gate, up


@triton.jit
def _routing_weight(Weights, pair, mask, top_k, stride_wt, stride_wk):
    t = pair // top_k
    k = pair - t * top_k
    return tl.load(Weights + t.to(tl.int64) * stride_wt + k * stride_wk, mask=mask, other=0.0).to(tl.float32)


# ---------------------------------------------------------------------------------------------
# 3. Forward
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["max_tiles"])
def _up_kernel(
    X, W, B,  # x (T, h); gate_up (E, N1, h); its bias (E, N1) or any pointer without
    TileExpert, TileRow, Offsets, Order,  # the schedule and the routing
    A,  # (S, I) output: the activation, in x's dtype, rows in sorted order
    Hidden,  # (S, N1) output when KEEP_HIDDEN: the pre-activation, in x's dtype
    max_tiles, top_k, width, intermediate, n1, alpha, limit,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    KEEP_HIDDEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid % max_tiles
    col_block = pid // max_tiles
    e, rows, row_mask, pair, tokens = _tile_rows(TileExpert, TileRow, Offsets, Order, tile, top_k, BLOCK_M)
    if e < 0:
        return
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    gate_rows, up_rows = _gate_up_rows(cols, intermediate, GATED, INTERLEAVED)
    gate, up = _pre_activation(X, W, B, e, tokens, row_mask, gate_rows, up_rows, col_mask, width,
                               stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn,
                               HAS_BIAS, GATED, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if KEEP_HIDDEN:
        tl.store(Hidden + rows64 * n1 + gate_rows[None, :], gate.to(Hidden.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(Hidden + rows64 * n1 + up_rows[None, :], up.to(Hidden.dtype.element_ty), mask=mask)
    a, _, _ = _activation(gate, up, alpha, limit, ACTIVATION, GATED, A.dtype.element_ty)
    tl.store(A + rows64 * intermediate + cols[None, :], a.to(A.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["max_tiles"])
def _down_kernel(
    A,  # (S, I) the activation, sorted rows
    D, C,  # down (E, h, I); its bias (E, h) or any pointer without
    Weights,  # (T, K) routing weights
    TileExpert, TileRow, Offsets, Order,
    PairOut,  # (S, h) output in x's dtype: w_p y_p at row p (the pair's own index, not its sorted position)
    max_tiles, top_k, width, intermediate,
    stride_de, stride_dh, stride_di, stride_ce, stride_ch, stride_wt, stride_wk,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid % max_tiles
    col_block = pid // max_tiles
    e, rows, row_mask, pair, _ = _tile_rows(TileExpert, TileRow, Offsets, Order, tile, top_k, BLOCK_M)
    if e < 0:
        return
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < width
    d_expert = D + e.to(tl.int64) * stride_de
    a_rows = A + rows.to(tl.int64)[:, None] * intermediate
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, intermediate, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < intermediate
        a = tl.load(a_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        d = tl.load(d_expert + cols[None, :] * stride_dh + ks[:, None] * stride_di,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, d, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(C + e.to(tl.int64) * stride_ce + cols * stride_ch, mask=col_mask, other=0.0).to(
            tl.float32)[None, :]
    y = acc.to(PairOut.dtype.element_ty).to(tl.float32)  # the expert's output, rounded as the stock linear's
    w = _routing_weight(Weights, pair, row_mask, top_k, stride_wt, stride_wk)
    tl.store(PairOut + pair.to(tl.int64)[:, None] * width + cols[None, :], (y * w[:, None]).to(
        PairOut.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# ---------------------------------------------------------------------------------------------
# 4. Backward
# ---------------------------------------------------------------------------------------------
# Per pair p (token t, expert e, weight w), with g = down_e^T dout_t (I,):
#   d w_p   = <dout_t, y_p> = <g, a_p> + <dout_t, c_e>        (y_p = down_e a_p + c_e)
#   d a_p   = w g;   d h_p = d a_p * act'(h_p) (gate and up parts for a gated activation)
#   d x_t  += gate_up_e^T d h_p
#   d gate_up_e = sum_p d h_p x_t^T,   d b_e = sum_p d h_p
#   d down_e    = sum_p (w dout_t) a_p^T,   d c_e = sum_p w dout_t
@triton.jit(do_not_specialize=["max_tiles"])
def _hidden_grad_kernel(
    X, W, B, D, C, Weights, DOut,
    TileExpert, TileRow, Offsets, Order,
    Hidden,  # (S, N1) the kept pre-activation when HIDDEN_KEPT
    DH,  # (S, N1) output in x's dtype: d h, sorted rows
    A,  # (S, I) output in x's dtype: the activation, sorted rows
    WeightPartials,  # (S, column blocks) fp32 output: parts of d w, sorted rows
    max_tiles, top_k, width, intermediate, n1, alpha, limit, column_blocks,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn,
    stride_de, stride_dh, stride_di, stride_ce, stride_ch, stride_wt, stride_wk, stride_ot, stride_oh,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr, HIDDEN_KEPT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid % max_tiles
    col_block = pid // max_tiles
    e, rows, row_mask, pair, tokens = _tile_rows(TileExpert, TileRow, Offsets, Order, tile, top_k, BLOCK_M)
    if e < 0:
        return
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_rows, up_rows = _gate_up_rows(cols, intermediate, GATED, INTERLEAVED)
    if HIDDEN_KEPT:
        gate = tl.load(Hidden + rows64 * n1 + gate_rows[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(Hidden + rows64 * n1 + up_rows[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            up = gate
    else:
        gate, up = _pre_activation(X, W, B, e, tokens, row_mask, gate_rows, up_rows, col_mask, width,
                                   stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn,
                                   HAS_BIAS, GATED, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    a, d_gate, d_up = _activation(gate, up, alpha, limit, ACTIVATION, GATED, A.dtype.element_ty)
    a = tl.where(mask, a.to(A.dtype.element_ty).to(tl.float32), 0.0)  # what the down projection read

    # g = down_e^T dout_t for this tile's columns, dout's rows loaded through the tokens.
    d_expert = D + e.to(tl.int64) * stride_de
    dout_rows = DOut + tokens.to(tl.int64)[:, None] * stride_ot
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bias_dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, width, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < width
        dout = tl.load(dout_rows + ks[None, :] * stride_oh, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        d = tl.load(d_expert + ks[:, None] * stride_dh + cols[None, :] * stride_di,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        g = tl.dot(dout.to(D.dtype.element_ty), d, g, input_precision=PRECISION)
        if HAS_DOWN_BIAS:
            c = tl.load(C + e.to(tl.int64) * stride_ce + ks * stride_ch, mask=k_mask, other=0.0).to(tl.float32)
            bias_dot += tl.sum(dout.to(tl.float32) * c[None, :], axis=1)
    weight_part = tl.sum(g * a, axis=1)
    if HAS_DOWN_BIAS:
        weight_part += tl.where(col_block == 0, bias_dot, 0.0)
    tl.store(WeightPartials + rows.to(tl.int64) * column_blocks + col_block, weight_part, mask=row_mask)

    w = _routing_weight(Weights, pair, row_mask, top_k, stride_wt, stride_wk)
    da = g * w[:, None]
    tl.store(A + rows64 * intermediate + cols[None, :], a.to(A.dtype.element_ty), mask=mask)
    tl.store(DH + rows64 * n1 + gate_rows[None, :], (da * d_gate).to(DH.dtype.element_ty), mask=mask)
    if GATED:
        tl.store(DH + rows64 * n1 + up_rows[None, :], (da * d_up).to(DH.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["max_tiles"])
def _dx_kernel(
    DH,  # (S, N1) d h, sorted rows
    W,  # gate_up (E, N1, h)
    TileExpert, TileRow, Offsets, Order,
    PairDX,  # (S, h) fp32 output: gate_up_e^T d h_p at row p (the pair's index)
    max_tiles, top_k, width, n1,
    stride_we, stride_wn, stride_wh,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid % max_tiles
    col_block = pid // max_tiles
    e, rows, row_mask, pair, _ = _tile_rows(TileExpert, TileRow, Offsets, Order, tile, top_k, BLOCK_M)
    if e < 0:
        return
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < width
    w_expert = W + e.to(tl.int64) * stride_we
    dh_rows = DH + rows.to(tl.int64)[:, None] * n1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, n1, BLOCK_K):
        ns = start + tl.arange(0, BLOCK_K)
        n_mask = ns < n1
        dh = tl.load(dh_rows + ns[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        w = tl.load(w_expert + ns[:, None] * stride_wn + cols[None, :] * stride_wh,
                    mask=n_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(dh, w, acc, input_precision=PRECISION)
    tl.store(PairDX + pair.to(tl.int64)[:, None] * width + cols[None, :], acc,
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _weight_grad_kernel(
    L,  # left operand rows (n columns): sorted rows, or token rows when LEFT_GATHERED
    R,  # right operand rows (m columns): sorted rows, or token rows when RIGHT_GATHERED
    Weights,  # (T, K) routing weights: the left rows are scaled by them when LEFT_SCALED
    Offsets, Order,
    DW,  # (E, n, m) output, contiguous: sum over the expert's positions of L^T R
    DB,  # (E, n) output, contiguous, when HAS_BIAS: the column sums of L
    n, m, top_k, stride_l, stride_lc, stride_r, stride_rc, stride_wt, stride_wk,
    LEFT_GATHERED: tl.constexpr, RIGHT_GATHERED: tl.constexpr, LEFT_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program per (expert, BLOCK_M rows of n, BLOCK_N columns of m), summing BLOCK_K positions a step.
    blocks_n, blocks_m = tl.cdiv(n, BLOCK_M), tl.cdiv(m, BLOCK_N)
    pid = tl.program_id(0)
    e = pid // (blocks_n * blocks_m)
    within = pid % (blocks_n * blocks_m)
    pid_n, pid_m = within // blocks_m, within % blocks_m
    ns = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)
    ms = pid_m * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask, m_mask = ns < n, ms < m
    first = tl.load(Offsets + e)
    last = tl.load(Offsets + e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    column_sums = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(first, last, BLOCK_K):
        rows = start + tl.arange(0, BLOCK_K)
        r_mask = rows < last
        pair = tl.load(Order + rows, mask=r_mask, other=0)
        token = pair // top_k
        left_rows = token if LEFT_GATHERED else rows
        right_rows = token if RIGHT_GATHERED else rows
        left_t = tl.load(L + left_rows.to(tl.int64)[None, :] * stride_l + ns[:, None] * stride_lc,
                         mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_K): L transposed
        if LEFT_SCALED:
            w = _routing_weight(Weights, pair, r_mask, top_k, stride_wt, stride_wk)
            left_f = left_t.to(tl.float32) * w[None, :]
            left_t = left_f.to(R.dtype.element_ty)  # as stock autograd rounds d(y w)/dy = dout w
        else:
            left_f = left_t.to(tl.float32)
        if HAS_BIAS:
            column_sums += tl.sum(left_f, axis=1)
        right = tl.load(R + right_rows.to(tl.int64)[:, None] * stride_r + ms[None, :] * stride_rc,
                        mask=r_mask[:, None] & m_mask[None, :], other=0.0)
        acc = tl.dot(left_t.to(R.dtype.element_ty), right, acc, input_precision=PRECISION)
    e64 = e.to(tl.int64)
    tl.store(DW + e64 * n * m + ns[:, None] * m + ms[None, :], acc.to(DW.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])
    if HAS_BIAS:
        # One program per expert and row block writes the bias's gradient: those of the first column block.
        bias_rows = tl.where(pid_m == 0, n, 0)
        tl.store(DB + e64 * n + ns, column_sums.to(DB.dtype.element_ty), mask=ns < bias_rows)


# ---------------------------------------------------------------------------------------------
# 5. Launchers
# ---------------------------------------------------------------------------------------------
INDEX_DTYPES = (torch.int64, torch.int32)


def _check_inputs(x, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gated):
    """The shapes the kernels rely on: a wrong one would be read out of bounds, silently."""
    check_choice("activation", activation, GATED_ACTIVATIONS if gated else PLAIN_ACTIVATIONS)
    check_float_tensor("x", x, dims=2)
    check_float_tensor("top_k_weights", top_k_weights, dims=2, like=("x", x))
    check_float_tensor("gate_up", gate_up, dims=3, like=("x", x), dtypes=(x.dtype,))
    experts, n1, width = gate_up.shape
    if width != x.shape[1] or (gated and n1 % 2):
        raise ValueError(f"gate_up must have shape (experts, {'2 * ' if gated else ''}intermediate, {x.shape[1]}), "
                         f"got {tuple(gate_up.shape)}")
    check_float_tensor("down", down, shape=(experts, width, n1 // 2 if gated else n1), like=("x", x),
                       dtypes=(x.dtype,))
    if gate_up_bias is not None:
        check_float_tensor("gate_up_bias", gate_up_bias, shape=(experts, n1), like=("x", x), dtypes=(x.dtype,))
    if down_bias is not None:
        check_float_tensor("down_bias", down_bias, shape=(experts, width), like=("x", x), dtypes=(x.dtype,))


def _route(top_k_index, experts):
    """remat.ops.experts.route, here too so the launchers run from a plain checkout of the kernels."""
    ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(ids, stable=True)
    offsets = torch.searchsorted(sorted_ids, torch.arange(experts + 1, device=ids.device, dtype=sorted_ids.dtype))
    return order.to(torch.int32), offsets.to(torch.int32)


def _schedule(offsets, pairs, block_m):
    """(tile_expert, tile_row, max_tiles): for each of max_tiles = cdiv(pairs, block_m) + E programs the
    expert it takes (-1: none, past the last tile) and its first sorted position; from the offsets on
    the device (no synchronisation)."""
    experts = offsets.numel() - 1
    counts = (offsets[1:] - offsets[:-1]).long()
    per_expert = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    ends = torch.cumsum(per_expert, 0)
    max_tiles = cdiv(pairs, block_m) + experts
    tile = torch.arange(max_tiles, device=offsets.device)
    expert = torch.searchsorted(ends, tile, right=True)
    clamped = expert.clamp(max=experts - 1)
    row = offsets.long()[clamped] + (tile - (ends[clamped] - per_expert[clamped])) * block_m
    expert = torch.where(expert < experts, expert, -1)
    return expert.to(torch.int32), row.to(torch.int32), max_tiles


def _bias_args(bias, like):
    """(pointer, expert stride, column stride) of an optional bias; `like` stands in for an absent one."""
    return (bias, bias.stride(0), bias.stride(1)) if bias is not None else (like, 0, 0)


def _sum_over_k(pair_rows, tokens, top_k, dtype):
    """The per-token sum of (T·K, h) pair rows, in fp32 and in k's order, in `dtype`."""
    return pair_rows.view(tokens, top_k, pair_rows.shape[1]).sum(dim=1, dtype=torch.float32).to(dtype)


@on_input_device
def experts_fwd(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gated,
                interleaved, alpha, limit, keep_hidden):
    """(out, order, offsets, hidden) as remat.ops.experts.experts_fwd_ref returns them (see the contract above)."""
    _check_inputs(x, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gated)
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dtype not in INDEX_DTYPES \
            or top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index must be an int64 or int32 tensor of shape ({x.shape[0]}, K) like "
                         f"top_k_weights {tuple(top_k_weights.shape)}")
    tokens, top_k = top_k_index.shape
    experts, n1, width = gate_up.shape
    intermediate = down.shape[2]
    pairs = tokens * top_k
    device = x.device
    order, offsets = _route(top_k_index, experts)
    hidden = torch.zeros((pairs, n1) if keep_hidden else (0,), dtype=x.dtype, device=device)
    if pairs == 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format), order, offsets, hidden
    config = tiles(x.dtype, device)
    tile_expert, tile_row, max_tiles = _schedule(offsets, pairs, config.block_m)
    activations = torch.empty((pairs, intermediate), dtype=x.dtype, device=device)
    bias, stride_be, stride_bn = _bias_args(gate_up_bias, x)
    launch = dict(PRECISION=_precision(x.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  BLOCK_K=config.block_k, num_warps=config.warps, num_stages=config.stages)
    _up_kernel[(max_tiles * cdiv(intermediate, config.block_n),)](
        x, gate_up, bias, tile_expert, tile_row, offsets, order, activations, hidden if keep_hidden else activations,
        max_tiles, top_k, width, intermediate, n1, float(alpha), float(limit),
        x.stride(0), x.stride(1), *gate_up.stride(), stride_be, stride_bn,
        ACTIVATION=activation, GATED=bool(gated), INTERLEAVED=bool(interleaved), HAS_BIAS=gate_up_bias is not None,
        KEEP_HIDDEN=bool(keep_hidden), **launch,
    )
    pair_out = torch.zeros((pairs, width), dtype=x.dtype, device=device)  # skipped pairs stay 0
    down_bias_ptr, stride_ce, stride_ch = _bias_args(down_bias, x)
    _down_kernel[(max_tiles * cdiv(width, config.block_n),)](
        activations, down, down_bias_ptr, top_k_weights, tile_expert, tile_row, offsets, order, pair_out,
        max_tiles, top_k, width, intermediate, *down.stride(), stride_ce, stride_ch, *top_k_weights.stride(),
        HAS_BIAS=down_bias is not None, **launch,
    )
    return _sum_over_k(pair_out, tokens, top_k, x.dtype), order, offsets, hidden


@on_input_device
def experts_bwd(dout, x, top_k_weights, gate_up, down, gate_up_bias, down_bias, order, offsets, hidden, activation,
                gated, interleaved, alpha, limit):
    """(dx, dtop_k_weights, dgate_up, ddown, dgate_up_bias, ddown_bias) as
    remat.ops.experts.experts_bwd_ref returns them; h rebuilt from x unless `hidden` holds it."""
    _check_inputs(x, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gated)
    check_float_tensor("dout", dout, shape=x.shape, like=("x", x))
    tokens, top_k = top_k_weights.shape
    experts, n1, width = gate_up.shape
    intermediate = down.shape[2]
    pairs = tokens * top_k
    if order.shape != (pairs,) or offsets.shape != (experts + 1,):
        raise ValueError(f"order and offsets must have shapes ({pairs},) and ({experts + 1},) (remat.ops.experts."
                         f"route), got {tuple(order.shape)} and {tuple(offsets.shape)}")
    hidden_kept = hidden.numel() > 0
    if hidden_kept:
        check_float_tensor("hidden", hidden, shape=(pairs, n1), like=("x", x), dtypes=(x.dtype,))
        hidden = hidden.contiguous()
    device = x.device
    dgate_up = torch.empty((experts, n1, width), dtype=x.dtype, device=device)
    ddown = torch.empty((experts, width, intermediate), dtype=x.dtype, device=device)
    dgate_up_bias = torch.empty((experts, n1) if gate_up_bias is not None else (0,), dtype=x.dtype, device=device)
    ddown_bias = torch.empty((experts, width) if down_bias is not None else (0,), dtype=x.dtype, device=device)
    config = tiles(x.dtype, device)
    launch = dict(PRECISION=_precision(x.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  BLOCK_K=config.block_k, num_warps=config.warps, num_stages=config.stages)
    hidden_config = tiles(x.dtype, device, "hidden_grad")
    column_blocks = cdiv(intermediate, hidden_config.block_n)
    dh = torch.empty((pairs, n1), dtype=x.dtype, device=device)
    activations = torch.empty((pairs, intermediate), dtype=x.dtype, device=device)
    partials = torch.zeros((pairs, column_blocks), dtype=torch.float32, device=device)  # skipped pairs stay 0
    pair_dx = torch.zeros((pairs, width), dtype=torch.float32, device=device)
    if pairs:
        tile_expert, tile_row, max_tiles = _schedule(offsets, pairs, config.block_m)
        schedule = (tile_expert, tile_row, offsets, order)
        bias, stride_be, stride_bn = _bias_args(gate_up_bias, x)
        down_bias_ptr, stride_ce, stride_ch = _bias_args(down_bias, x)
        _hidden_grad_kernel[(max_tiles * column_blocks,)](
            x, gate_up, bias, down, down_bias_ptr, top_k_weights, dout, *schedule, hidden if hidden_kept else dh,
            dh, activations, partials,
            max_tiles, top_k, width, intermediate, n1, float(alpha), float(limit), column_blocks,
            x.stride(0), x.stride(1), *gate_up.stride(), stride_be, stride_bn, *down.stride(), stride_ce, stride_ch,
            *top_k_weights.stride(), dout.stride(0), dout.stride(1),
            ACTIVATION=activation, GATED=bool(gated), INTERLEAVED=bool(interleaved), HAS_BIAS=gate_up_bias is not None,
            HAS_DOWN_BIAS=down_bias is not None, HIDDEN_KEPT=hidden_kept,
            **{**launch, "BLOCK_N": hidden_config.block_n, "num_stages": hidden_config.stages},
        )
        _dx_kernel[(max_tiles * cdiv(width, config.block_n),)](
            dh, gate_up, *schedule, pair_dx, max_tiles, top_k, width, n1, *gate_up.stride(), **launch,
        )
    _weight_grad_kernel[(experts * cdiv(n1, config.block_m) * cdiv(width, config.block_n),)](
        dh, x, top_k_weights, offsets, order, dgate_up, dgate_up_bias if gate_up_bias is not None else dgate_up,
        n1, width, top_k, n1, 1, x.stride(0), x.stride(1), *top_k_weights.stride(),
        LEFT_GATHERED=False, RIGHT_GATHERED=True, LEFT_SCALED=False, HAS_BIAS=gate_up_bias is not None, **launch,
    )
    _weight_grad_kernel[(experts * cdiv(width, config.block_m) * cdiv(intermediate, config.block_n),)](
        dout, activations, top_k_weights, offsets, order, ddown, ddown_bias if down_bias is not None else ddown,
        width, intermediate, top_k, dout.stride(0), dout.stride(1), intermediate, 1, *top_k_weights.stride(),
        LEFT_GATHERED=True, RIGHT_GATHERED=False, LEFT_SCALED=True, HAS_BIAS=down_bias is not None, **launch,
    )
    dweights = torch.zeros((pairs,), dtype=torch.float32, device=device)
    dweights.scatter_(0, order.long(), partials.sum(dim=1))  # order is a permutation: each pair once
    return (_sum_over_k(pair_dx, tokens, top_k, x.dtype), dweights.view(tokens, top_k).to(top_k_weights.dtype),
            dgate_up, ddown, dgate_up_bias, ddown_bias)


# ---------------------------------------------------------------------------------------------
# 6. Ahead-of-time compile cases
# ---------------------------------------------------------------------------------------------
# Each case calls the launchers on CPU tensors shaped like a production layer (torch.empty weights:
# nothing is written; the routing is real, so the schedule is built as on a GPU); the helper compiles
# every kernel they launch, at the tiles a CUDA device gets (tiles() is asked for a cuda device).
# Shapes: Qwen3-30B-A3B's experts (hidden 2048, intermediate 768, 128 experts, top-8, concatenated
# SwiGLU), gpt-oss-20b's (hidden 2880, intermediate 2880, 32 experts, top-4, interleaved clamped
# SwiGLU with biases, transposed weights) and Nemotron-H's non-gated squared ReLU (hidden 2688,
# intermediate 1856, 128 experts, top-6), each with 64 tokens, both policies.
AOT_TOKENS = 64
AOT_LAYERS = {
    "qwen3_moe": dict(width=2048, intermediate=768, experts=128, top_k=8, activation="silu", gated=True,
                      interleaved=False, transposed=False, biases=False),
    "gpt_oss": dict(width=2880, intermediate=2880, experts=32, top_k=4, activation="swiglu_clamped", gated=True,
                    interleaved=True, transposed=True, biases=True),
    "nemotron_h": dict(width=2688, intermediate=1856, experts=128, top_k=6, activation="relu2", gated=False,
                       interleaved=False, transposed=False, biases=False),
}


def _aot_launch(dtype, layer, keep_hidden):
    spec = AOT_LAYERS[layer]
    width, inter, experts, top_k = spec["width"], spec["intermediate"], spec["experts"], spec["top_k"]
    n1 = 2 * inter if spec["gated"] else inter
    x = torch.empty((AOT_TOKENS, width), dtype=dtype)
    index = (torch.arange(AOT_TOKENS)[:, None] * 7 + torch.arange(top_k)[None, :]) % experts
    weights = torch.empty((AOT_TOKENS, top_k), dtype=dtype)
    if spec["transposed"]:
        gate_up = torch.empty((experts, width, n1), dtype=dtype).transpose(1, 2)
        down = torch.empty((experts, inter, width), dtype=dtype).transpose(1, 2)
    else:
        gate_up = torch.empty((experts, n1, width), dtype=dtype)
        down = torch.empty((experts, width, inter), dtype=dtype)
    biases = (torch.empty((experts, n1), dtype=dtype), torch.empty((experts, width), dtype=dtype)) \
        if spec["biases"] else (None, None)
    options = (spec["activation"], spec["gated"], spec["interleaved"], 1.702, 7.0)
    with _cuda_tiles():
        _, order, offsets, hidden = experts_fwd(x, index, weights, gate_up, down, *biases, *options, keep_hidden)
        experts_bwd(torch.empty_like(x), x, weights, gate_up, down, *biases, order, offsets, hidden, *options)


@contextlib.contextmanager
def _cuda_tiles():
    """tiles() answers as for a CUDA device while an AOT case launches on CPU tensors."""
    global _AOT_AS_CUDA
    _AOT_AS_CUDA = True
    try:
        yield
    finally:
        _AOT_AS_CUDA = False


def aot_cases():
    """Each production layer above in bf16 (standing for fp16: same code) and fp32, with the pre-activation
    recomputed and kept. Keys: name, launch, dtype, layer."""
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for layer in AOT_LAYERS:
            for keep_hidden in (False, True):
                cases.append(dict(name=f"{layer}_{TYPE_NAMES[dtype]}_{'keep' if keep_hidden else 'recompute'}",
                                  launch=functools.partial(_aot_launch, dtype, layer, keep_hidden),
                                  dtype=dtype, layer=layer))
    return cases
