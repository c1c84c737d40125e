"""Gated activations y = act(gate) · up (SwiGLU, GeGLU): references, custom ops (kernel, fake, autograd),
public function.

act is "silu", "gelu" (erf) or "gelu_tanh". The op works on (rows, N) gate and up of one dtype,
each with unit last stride and its own row stride (the two halves of one fused gate_up projection
are read in place). The backward recomputes act(gate) from gate and up, writes [d_gate | d_up] as
one (rows, 2N) tensor (the gradient of a fused projection as it is; two views for separate ones)
and can also rebuild y (recompute_output) for the down projection's weight gradient: a gated MLP
keeps only gate and up, never act(gate) nor the product.

round_activation=True rounds act(gate) to the input dtype before the multiply, as transformers'
MLPs compute act_fn(gate_proj(x)) * up_proj(x) in the input dtype: y is then bitwise the stock
y for the same act(gate). False rounds once, at the end (about half the error).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _backend
from .._validate import check_choice, check_float_tensor, check_same_device, rows_with_unit_stride
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves
from .gelu import gelu_and_derivative

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch, in fp32 (or float64 when given float64).
# ---------------------------------------------------------------------------------------------


def _activation(gate, activation, round_activation):
    """(act(gate), act'(gate)) in the math dtype; act rounded through gate's dtype on request."""
    h = gate.to(torch.float64 if gate.dtype == torch.float64 else torch.float32)
    if activation == "silu":
        s = torch.sigmoid(h)
        value, derivative = h * s, s + h * s * (1 - s)
    else:
        value, derivative = gelu_and_derivative(h, "tanh" if activation == "gelu_tanh" else "none")
    if round_activation:
        value = value.to(gate.dtype).to(value.dtype)
    return value, derivative


def gated_fwd_ref(gate: Tensor, up: Tensor, activation: str, round_activation: bool) -> Tensor:
    """act(gate) · up in gate's dtype, for gate and up (M, N) of one dtype."""
    value, _ = _activation(gate, activation, round_activation)
    return (value * up.to(value.dtype)).to(gate.dtype)


def gated_bwd_ref(
    dy: Tensor, gate: Tensor, up: Tensor, activation: str, recompute_output: bool, round_activation: bool
) -> tuple[Tensor, Tensor]:
    """(d_gate_up, y): d_gate_up (M, 2N) = [d_gate | d_up] in gate's dtype; y when recompute_output,
    else empty (0,). d_up = dy · act(gate) (the rounded act with round_activation), d_gate = dy · up · act'(gate)."""
    value, derivative = _activation(gate, activation, round_activation)
    dy_f = dy.to(value.dtype)
    d_gate_up = torch.cat([dy_f * up.to(value.dtype) * derivative, dy_f * value], dim=1).to(gate.dtype)
    y = gated_fwd_ref(gate, up, activation, round_activation) if recompute_output else gate.new_empty((0,))
    return d_gate_up, y


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd (the ops themselves are declared at the end of the file)
# ---------------------------------------------------------------------------------------------


def _gated_fwd_fake(gate, up, activation, round_activation):
    return gate.new_empty(gate.shape)


def _gated_bwd_fake(dy, gate, up, activation, recompute_output, round_activation):
    rows, width = gate.shape
    return gate.new_empty((rows, 2 * width)), gate.new_empty(gate.shape if recompute_output else (0,))


def _setup_context(ctx, inputs, output):
    gate, up, activation, round_activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation, ctx.round_activation = activation, round_activation


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dy = rows_with_unit_stride(dy, gate.shape[1])
    # Under create_graph=True the reference's formula, which a second backward can differentiate.
    backward = gated_bwd_ref if _backend.backward_is_differentiated() else gated_bwd
    d_gate_up, _ = backward(dy, gate, up, ctx.activation, False, ctx.round_activation)
    width = gate.shape[1]
    return d_gate_up[:, :width], d_gate_up[:, width:], None, None


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def check_gate_and_up(gate, up):
    check_float_tensor("gate", gate)
    check_float_tensor("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"up has dtype {up.dtype} but gate has {gate.dtype}; they must match")
    check_same_device("up", up, "gate", gate)
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension")


def gated_activation(gate, up, activation="silu", round_activation=True):
    """act(gate) · up in one kernel, as transformers' gated MLPs compute act_fn(gate) * up.

    gate, up: of one shape and dtype (float32, float16 or bfloat16), any strides whose last is 1
    (the halves of one tensor, as torch.chunk gives them, are read in place). activation: "silu"
    (SwiGLU), "gelu" or "gelu_tanh" (GeGLU). round_activation: round act(gate) to the dtype before the
    multiply, as the stock two-step computation does (bitwise the stock y); False rounds once.
    Math in fp32; autograd saves gate and up, never act(gate) nor the output.
    """
    check_gate_and_up(gate, up)
    check_choice("activation", activation, ACTIVATIONS)
    width = gate.shape[-1]
    y = gated_fwd(rows_with_unit_stride(gate, width), rows_with_unit_stride(up, width), activation,
                  bool(round_activation))
    return y.view(gate.shape)


# ---------------------------------------------------------------------------------------------
# The family: remat::gated_fwd and remat::gated_bwd, and what the tooling needs
# ---------------------------------------------------------------------------------------------


def _samples(device):
    """A width of 37 (no power of two, a masked tail), gate and up as the halves of one tensor (strided
    rows) and as tensors of their own, every activation, both roundings."""
    fused = torch.randn(5, 74, device=device)
    forward, backward = [], []
    for gate, up in ((fused[:, :37], fused[:, 37:]), (torch.randn(5, 37, device=device), torch.randn(5, 37))):
        up = up.to(device)
        for activation in ACTIVATIONS:
            for rounding in (False, True):
                forward.append((*grad_leaves(gate, up), activation, rounding))
                backward += [(torch.randn(5, 37, device=device), gate, up, activation, recompute, rounding)
                             for recompute in (False, True)]
    return OpSamples(forward, backward)


def _stock_swiglu(t):
    return F.silu(t["gate"]) * t["up"]


_WIDTH = 24  # the validation table's width: no power of two
FAMILY = OpFamily(
    name="gated",
    forward_ref=gated_fwd_ref,
    backward_ref=gated_bwd_ref,
    forward_fake=_gated_fwd_fake,
    backward_fake=_gated_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="gated",
    calls=(PublicCall("gated_activation", {"gate": (2, 3, _WIDTH), "up": (2, 3, _WIDTH)},
                      lambda t: gated_activation(t["gate"], t["up"], "silu"), _stock_swiglu, inputs=("gate", "up")),),
    triton="gated",
    cuda=True,
)
gated_fwd, gated_bwd = FAMILY.forward, FAMILY.backward
