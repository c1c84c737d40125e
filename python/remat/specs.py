"""The vocabulary of the fused layers, shared by remat.ops.fused, remat.nn, remat.convert and its
Hugging Face families: a norm, an activation, Linears with their LoRA adapters.

    Norm(weight, bias, eps, kind)     kind "layer_norm" (the kinds the fused ops take)
    Activation(name, gated)           name "gelu" (exact) or "gelu_tanh"; gated: act(gate) * up
    Linear(weight, bias, adapters)    F.linear(x, weight, bias) + Σ LoRA terms; weight (out, in)
    LoRA(a, b, b_bias, scale)         F.linear(F.linear(x, a), b, b_bias) * scale (peft's order)
"""

import collections

LoRA = collections.namedtuple("LoRA", "a b b_bias scale")
Linear = collections.namedtuple("Linear", "weight bias adapters", defaults=(None, ()))
Norm = collections.namedtuple("Norm", "weight bias eps kind", defaults=(None, None, 1e-5, "layer_norm"))
Activation = collections.namedtuple("Activation", "name gated", defaults=(False,))

NORM_KINDS = ("layer_norm",)
# Activation name -> the GELU kernels' `approximate`.
GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}


def norm_of(module):
    """The Norm of a LayerNorm module (its parameters as they are now)."""
    return Norm(module.weight, module.bias, module.eps)


def gelu(approximate):
    """The Activation of a GELU with torch's `approximate` ("none" or "tanh")."""
    return Activation("gelu_tanh" if approximate == "tanh" else "gelu")


def check_activation(act):
    """The GELU kernels' approximate for `act`, an Activation the fused MLP computes; else a ValueError."""
    if not isinstance(act, Activation) or act.name not in GELU_APPROXIMATE or act.gated:
        raise ValueError(f"act must be Activation(name, gated=False) with name one of {tuple(GELU_APPROXIMATE)}, "
                         f"got {act!r}")
    return GELU_APPROXIMATE[act.name]


def check_norm(norm):
    if not isinstance(norm, Norm) or norm.kind not in NORM_KINDS:
        raise ValueError(f"norm must be a Norm(weight, bias, eps, kind) with kind one of {NORM_KINDS}, got {norm!r}")
    return norm
