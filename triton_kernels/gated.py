"""Gated activations y = act(gate) * up (SwiGLU, GeGLU) in Triton; the backward recomputes
act(gate) (and, on request, y) from gate and up.

act is silu, gelu (exact erf) or gelu_tanh. The forward reads gate and up once and writes y. The
backward reads gate, up and dy once and writes d_gate, d_up and, when asked, y, bitwise equal to
what the forward wrote, for the weight gradient of the down projection: a gated MLP then keeps
only its gate and up projections' outputs, never act(gate) nor the product.

Layout of this file, top to bottom:
  1. configuration (the GELU kernels' tiles) and the fp32 math shared by both kernels
  2. forward kernel
  3. backward kernel
  4. launchers: gated_fwd, gated_bwd
  5. aot_cases(): every launch configuration, for the ahead-of-time compile test

Tensor contract:
  gate, up (M, N) of one dtype (fp32, fp16, bf16), each with unit column stride and its own row
  stride: the two halves of one (M, 2N) projection output (Phi-3's gate_up_proj) are read in
  place, no copy. y (M, N) contiguous in that dtype. The backward writes d_gate and d_up into one
  contiguous (M, 2N) tensor, d_gate_up = [d_gate | d_up]: the gradient of a fused gate_up
  projection as it is, and two strided views for separate gate and up projections. dy (M, N)
  with unit column stride. All arithmetic is fp32.

Rounding (round_activation): transformers' gated MLPs compute act_fn(gate) * up in the input
dtype, so act(gate) is rounded to that dtype before the multiply, then the product is rounded
again. round_activation=True does the same (the fp32 product of two values of a 16-bit float
type is exact, so its single rounding is the stock product's): y is then bitwise the stock y
wherever act(gate) rounds alike (the fp32 act may differ from PyTorch's in its last bit), and
d_up = dy * round(act(gate)) too. round_activation=False rounds once, at the end: smaller
error, not the stock bits. Measured on (256, 4096) bf16 inputs against float64 (relative error;
stock = act(gate) * up in bf16): y 2.36e-3 stock, 2.36e-3 with round_activation, 1.66e-3
without (silu; gelu 2.09e-3 / 2.09e-3 / 1.66e-3); y bitwise stock's for 100 % (silu), 99.8 %
(gelu), 98.5 % (gelu_tanh: torch uses tanh, we the sigmoid form) of the elements with
round_activation, about 73 % without. Both are within the tests' bound of twice the stock error;
a drop-in for a stock model wants True, a model trained with remat from the start can take False.
"""

import functools

import torch
import triton
import triton.language as tl

from ._common import TYPE_NAMES, cdiv, check_choice, check_float_tensor, on_input_device, unit_last_stride
from .gelu import NARROW_BLOCK_N, WIDE_BLOCK_N, _gelu_derivative, _gelu_gate, _sigmoid_gate, _tile, _tile_config

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

# ---------------------------------------------------------------------------------------------
# 1. Configuration and shared fp32 math
# ---------------------------------------------------------------------------------------------
# Memory bound like GELU: the GELU kernels' [BLOCK_M, BLOCK_N] tiles of 8 KiB of each input at
# 8 warps, 32 bytes a thread (two 16-byte accesses per tensor), a wide or a narrow BLOCK_N by the
# padding of the row (gelu._tile_config). The backward holds three inputs and writes three outputs:
# it takes half the rows, 16 bytes a thread per tensor (at 32 the ragged, unaligned halves of a
# fused projection spilled on sm_80). Both kernels are one pass over independent tiles: no
# reduction, so no persistent grid.
BWD_ROWS_DIVISOR = 2


@triton.jit
def _activation_gate(h, ACTIVATION: tl.constexpr):
    """(s, aux) with act(h) = h * s; aux feeds the derivative only (dead code in the forward)."""
    if ACTIVATION == "silu":
        s, aux = _sigmoid_gate(h)
    elif ACTIVATION == "gelu":
        s, aux = _gelu_gate(h, "none")
    else:
        s, aux = _gelu_gate(h, "tanh")
    return s, aux


@triton.jit
def _activation_derivative(h, s, aux, ACTIVATION: tl.constexpr):
    """act'(h) from _activation_gate's (s, aux)."""
    if ACTIVATION == "silu":
        # silu(h) = h s, s = sigmoid(h):  silu'(h) = s + h s (1 - s).
        d = s + h * aux
    elif ACTIVATION == "gelu":
        d = _gelu_derivative(h, s, aux, "none")
    else:
        d = _gelu_derivative(h, s, aux, "tanh")
    return d


@triton.jit
def _activation_value(h, s, ROUND_ACTIVATION: tl.constexpr, DTYPE: tl.constexpr):
    """act(h) in fp32, rounded to DTYPE first when ROUND_ACTIVATION. One definition for the
    forward and the backward: the recomputed y and d_up use the forward's act(gate) bitwise."""
    a = h * s
    if ROUND_ACTIVATION:
        a = a.to(DTYPE).to(tl.float32)
    return a


# ---------------------------------------------------------------------------------------------
# 2. Forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _gated_fwd_kernel(
    Gate,  # (M, N), row stride stride_gate_row, column stride 1
    Up,  # (M, N), row stride stride_up_row, column stride 1
    Y,  # (M, N) output, contiguous
    stride_gate_row,
    stride_up_row,
    M,
    N,
    ACTIVATION: tl.constexpr,  # "silu", "gelu" or "gelu_tanh"
    ROUND_ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    h = tl.load(Gate + rows * stride_gate_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(Up + rows * stride_up_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, _ = _activation_gate(h, ACTIVATION)
    a = _activation_value(h, s, ROUND_ACTIVATION, Y.dtype.element_ty)
    tl.store(Y + rows * N + cols[None, :], (a * up).to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 3. Backward
# ---------------------------------------------------------------------------------------------
# Gradient derivation, per element, y = a * up with a = act(gate):
#
#   d_up = dy * a,      d_gate = dy * up * act'(gate)
#
#   silu(h) = h s, s = sigmoid(h), s' = s (1 - s):   silu'(h) = s + h s (1 - s)
#   gelu, gelu_tanh: as in gelu.py (Phi(h) + h phi(h), and s + 2 h s (1 - s) du/dh).
#
# With round_activation, a is the rounded activation, as the stock product sees it; d_gate takes
# the rounding as the identity (as autograd does). Everything else is rebuilt in registers from
# gate, up and dy in one pass; no reduction.
@triton.jit
def _gated_bwd_kernel(
    Gate,  # (M, N) forward input, row stride stride_gate_row, column stride 1
    Up,  # (M, N) forward input, row stride stride_up_row, column stride 1
    DY,  # (M, N) gradient of y, row stride stride_dy_row, column stride 1
    DGateUp,  # (M, 2N) output, contiguous: d_gate in columns [0, N), d_up in [N, 2N)
    Y,  # (M, N) output y, contiguous, written when RECOMPUTE_OUTPUT; any valid pointer otherwise
    stride_gate_row,
    stride_up_row,
    stride_dy_row,
    M,
    N,
    ACTIVATION: tl.constexpr,
    ROUND_ACTIVATION: tl.constexpr,
    RECOMPUTE_OUTPUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    h = tl.load(Gate + rows * stride_gate_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(Up + rows * stride_up_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, aux = _activation_gate(h, ACTIVATION)
    a = _activation_value(h, s, ROUND_ACTIVATION, DGateUp.dtype.element_ty)
    d_gate = dy * up * _activation_derivative(h, s, aux, ACTIVATION)
    grad_offsets = rows * (2 * N) + cols[None, :]
    tl.store(DGateUp + grad_offsets, d_gate.to(DGateUp.dtype.element_ty), mask=mask)
    tl.store(DGateUp + grad_offsets + N, (dy * a).to(DGateUp.dtype.element_ty), mask=mask)
    if RECOMPUTE_OUTPUT:
        tl.store(Y + rows * N + cols[None, :], (a * up).to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 4. Launchers
# ---------------------------------------------------------------------------------------------
def _check_inputs(gate, up, activation):
    check_choice("activation", activation, ACTIVATIONS)
    check_float_tensor("gate", gate, dims=2)
    check_float_tensor("up", up, shape=gate.shape, dtypes=(gate.dtype,), like=("gate", gate))


def _tiles(gate, backward):
    """(grid, BLOCK_M, BLOCK_N, num_warps) for (M, N) gate/up."""
    M, N = gate.shape
    block_m, block_n, warps = _tile_config(N, gate.dtype)
    if backward:
        block_m = max(1, block_m // BWD_ROWS_DIVISOR)
    return (cdiv(M, block_m) * cdiv(N, block_n),), block_m, block_n, warps


@on_input_device
def gated_fwd(gate, up, activation, round_activation=False):
    """act(gate) * up for (M, N) gate and up of one dtype, unit column stride, any row strides.

    activation "silu", "gelu" (erf) or "gelu_tanh"; round_activation rounds act(gate) to the
    dtype before the multiply, as transformers' MLPs do (see the module docstring).
    Returns y (M, N) contiguous in gate's dtype.
    """
    _check_inputs(gate, up, activation)
    gate, up = unit_last_stride(gate), unit_last_stride(up)
    M, N = gate.shape
    y = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    if M == 0 or N == 0:
        return y
    grid, block_m, block_n, warps = _tiles(gate, backward=False)
    _gated_fwd_kernel[grid](
        gate, up, y, gate.stride(0), up.stride(0), M, N,
        ACTIVATION=activation, ROUND_ACTIVATION=bool(round_activation),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return y


@on_input_device
def gated_bwd(dy, gate, up, activation, recompute_output, round_activation=False):
    """Gradients of gated_fwd, recomputing act(gate) (and y when recompute_output) in one pass.

    Returns (d_gate_up, y): d_gate_up (M, 2N) contiguous in gate's dtype, d_gate in its first N
    columns and d_up in the last N; y (M, N), bitwise equal to gated_fwd's output with the same
    round_activation, when recompute_output, else an empty tensor of shape (0,).
    """
    _check_inputs(gate, up, activation)
    check_float_tensor("dy", dy, shape=gate.shape, like=("gate", gate))
    gate, up, dy = unit_last_stride(gate), unit_last_stride(up), unit_last_stride(dy)
    M, N = gate.shape
    d_gate_up = torch.empty((M, 2 * N), dtype=gate.dtype, device=gate.device)
    y = torch.empty((M, N) if recompute_output else (0,), dtype=gate.dtype, device=gate.device)
    if M == 0 or N == 0:
        return d_gate_up, y
    grid, block_m, block_n, warps = _tiles(gate, backward=True)
    _gated_bwd_kernel[grid](
        gate, up, dy, d_gate_up, y if recompute_output else d_gate_up,
        gate.stride(0), up.stride(0), dy.stride(0), M, N,
        ACTIVATION=activation, ROUND_ACTIVATION=bool(round_activation), RECOMPUTE_OUTPUT=bool(recompute_output),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )
    return d_gate_up, y


# ---------------------------------------------------------------------------------------------
# 5. Ahead-of-time compile cases
# ---------------------------------------------------------------------------------------------
# Each case calls a launcher above on CPU tensors; tests/_helpers/triton_aot.py compiles the kernels it
# launches for a GPU, specialised by Triton on the real arguments. gate and up are the halves of
# one (M, 2N) tensor (the fused projection) or two tensors of their own: at a 16-divisible width
# both specialise alike (16-byte aligned rows); at a ragged width the halves' up is not even
# 16-byte aligned, a variant of its own.
# (rows, width) per BLOCK_N that _tile_config picks, 16-divisible and ragged.
_AOT_SHAPES = {WIDE_BLOCK_N: ((64, 1024), (67, 1000)), NARROW_BLOCK_N: ((64, 96), (67, 100))}


def _aot_launch(dtype, activation, round_activation, shape, halves, backward, recompute):
    rows, width = shape
    if halves:
        gate, up = torch.empty((rows, 2 * width), dtype=dtype).chunk(2, dim=1)
    else:
        gate, up = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    if backward:
        gated_bwd(torch.empty(shape, dtype=dtype), gate, up, activation, recompute, round_activation)
    else:
        gated_fwd(gate, up, activation, round_activation)


def aot_cases():
    """Launches covering every kernel variant the launchers above can run on a GPU: each activation,
    bf16 (standing for fp16) with and without round_activation and fp32 (where rounding to fp32 is
    no rounding), each BLOCK_N, forward and backward with and without recompute, at a 16-divisible
    shape and at a ragged one with gate and up apart and as halves of one tensor.
    Keys: name, launch, divisible."""
    cases = []
    variants = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)]
    for activation in ACTIVATIONS:
        for dtype, round_activation in variants:
            for block_n, (divisible_shape, ragged_shape) in _AOT_SHAPES.items():
                layouts = [(True, divisible_shape, True), (False, ragged_shape, False), (False, ragged_shape, True)]
                for divisible, shape, halves in layouts:
                    tag = (f"{activation}_{TYPE_NAMES[dtype]}_round{int(round_activation)}_BN{block_n}_"
                           f"{shape[0]}x{shape[1]}{'_halves' if halves else ''}")
                    for backward, recompute in ((False, False), (True, False), (True, True)):
                        name = f"{'bwd' if backward else 'fwd'}_{tag}" + (f"_rec{int(recompute)}" if backward else "")
                        launch = functools.partial(_aot_launch, dtype, activation, round_activation, shape, halves,
                                                   backward, recompute)
                        cases.append(dict(name=name, launch=launch, divisible=divisible))
    return cases
