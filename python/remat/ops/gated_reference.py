"""References in plain PyTorch for the gated activations y = act(gate) * up and for QuickGELU;
float64-capable (fp32 math for narrower inputs, float64 for float64).

Gated (SwiGLU, GeGLU): act is "silu", "gelu" (erf) or "gelu_tanh". round_activation=True rounds
act(gate) to the input dtype before the multiply, as transformers' MLPs compute
act_fn(gate_proj(x)) * up_proj(x) in the input dtype; False rounds once, at the end.

QuickGELU (CLIP): gelu(h) = h * sigmoid(1.702 h), with the contract of ops/gelu.py's
gelu_fwd_ref / gelu_bwd_ref (an optional bias added first).
"""

import torch

from .gelu import _pre_activation, gelu_and_derivative

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
QUICK_GELU_SCALE = 1.702


def _math_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scaled_sigmoid_gated(h, scale):
    """h * sigmoid(scale h) and its derivative s + scale h s (1 - s)."""
    s = torch.sigmoid(scale * h)
    return h * s, s + scale * h * s * (1 - s)


def activation_and_derivative(h, activation):
    """act(h) and act'(h), in h's dtype."""
    if activation == "silu":
        return _scaled_sigmoid_gated(h, 1.0)
    if activation == "gelu":
        return gelu_and_derivative(h, "none")
    if activation == "gelu_tanh":
        return gelu_and_derivative(h, "tanh")
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _activation(gate, activation, round_activation):
    """(act(gate), act'(gate)) in the math dtype; act rounded through gate's dtype on request."""
    value, derivative = activation_and_derivative(gate.to(_math_dtype(gate)), activation)
    if round_activation:
        value = value.to(gate.dtype).to(value.dtype)
    return value, derivative


def gated_fwd_ref(gate, up, activation, round_activation=False):
    """act(gate) * up in gate's dtype, for gate and up (M, N) of one dtype."""
    value, _ = _activation(gate, activation, round_activation)
    return (value * up.to(value.dtype)).to(gate.dtype)


def gated_bwd_ref(dy, gate, up, activation, recompute_output, round_activation=False):
    """(d_gate_up, y): d_gate_up (M, 2N) = [d_gate | d_up] in gate's dtype; y when recompute_output.

    d_up = dy * act(gate) (the rounded act with round_activation), d_gate = dy * up * act'(gate).
    """
    value, derivative = _activation(gate, activation, round_activation)
    dy_f = dy.to(value.dtype)
    d_gate = dy_f * up.to(value.dtype) * derivative
    d_gate_up = torch.cat([d_gate, dy_f * value], dim=1).to(gate.dtype)
    y = gated_fwd_ref(gate, up, activation, round_activation) if recompute_output else gate.new_empty((0,))
    return d_gate_up, y


def quick_gelu_fwd_ref(x, bias):
    """quick_gelu(x + bias) in x's dtype; bias (N,) or None."""
    h = _pre_activation(x, bias)
    value, _ = _scaled_sigmoid_gated(h, QUICK_GELU_SCALE)
    return value.to(x.dtype)


def quick_gelu_bwd_ref(dy, x, bias, recompute_output):
    """(dx, dbias, y) as ops/gelu.py's gelu_bwd_ref: dbias and y empty without a bias or a recompute."""
    value, derivative = _scaled_sigmoid_gated(_pre_activation(x, bias), QUICK_GELU_SCALE)
    dx = dy.to(derivative.dtype) * derivative
    dbias = dx.sum(dim=0).to(bias.dtype) if bias is not None else x.new_empty((0,))
    y = value.to(x.dtype) if recompute_output else x.new_empty((0,))
    return dx.to(x.dtype), dbias, y
