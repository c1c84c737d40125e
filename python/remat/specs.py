"""The vocabulary of the fused layers, shared by remat.ops.fused, remat.nn, remat.convert and its
Hugging Face families: a norm, an activation, Linears with their LoRA adapters.

    Norm(weight, bias, eps, kind, style)  kind "layer_norm", or "rms_norm" rounded as `style` rounds it
                                          (remat.ops.rms_norm.STYLES; bias None)
    Activation(name, gated)               a GELU ("gelu" exact, "gelu_tanh", "gelu_quick"), or with
                                          gated=True act(gate) * up for "silu", "gelu", "gelu_tanh"
    Linear(weight, bias, adapters,        F.linear(x, weight, bias) + Σ LoRA terms; weight (out, in), or with
           transposed)                    transposed=True stored (in, out) as transformers' Conv1D keeps it:
                                          x·weight + bias, computed as Conv1D computes it (addmm)
    LoRA(a, b, b_bias, scale)             F.linear(F.linear(x, a), b, b_bias) * scale (peft's order)
"""

import collections

LoRA = collections.namedtuple("LoRA", "a b b_bias scale")
Linear = collections.namedtuple("Linear", "weight bias adapters transposed", defaults=(None, (), False))
Norm = collections.namedtuple("Norm", "weight bias eps kind style", defaults=(None, None, 1e-5, "layer_norm", None))
Activation = collections.namedtuple("Activation", "name gated", defaults=(False,))

NORM_KINDS = ("layer_norm", "rms_norm")
RMS_NORM_STYLES = ("torch", "llama", "gemma", "t5")  # remat.ops.rms_norm.STYLES
# Activation name -> the GELU kernels' `approximate`.
GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh", "gelu_quick": "quick"}
# The activations of the gated kernels (remat.ops.gated.ACTIVATIONS).
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def norm_of(module, style=None):
    """The Norm of a LayerNorm module (its parameters as they are now), or with `style` of an RMSNorm
    module rounded as `style` rounds it: its weight and eps (`eps`, or transformers' `variance_epsilon`;
    torch's eps=None resolved by the op)."""
    if style is None and type(module).__name__ == "RMSNorm":  # torch.nn.RMSNorm and remat.nn.RMSNorm
        style = "torch"
    if style is None:
        return Norm(module.weight, module.bias, module.eps)
    return Norm(module.weight, None, norm_eps(module), "rms_norm", style)


def norm_eps(module):
    """The eps of a norm module as norm_of reads it (an RMSNorm's `eps`, or transformers' `variance_epsilon`)."""
    eps = module.__dict__.get("eps")  # read at every fused call: hasattr on a module without it raises inside
    if eps is None:
        eps = module.eps if hasattr(module, "eps") else module.variance_epsilon
    return eps


_GELU_OF_APPROXIMATE = {approximate: Activation(name) for name, approximate in GELU_APPROXIMATE.items()}


def gelu(approximate):
    """The Activation of a GELU with the GELU kernels' `approximate` ("none", "tanh" or "quick")."""
    return _GELU_OF_APPROXIMATE[approximate]


def check_activation(act):
    """`act` if it is an Activation the fused MLP computes, else a ValueError."""
    if not isinstance(act, Activation) or act.name not in (GATED_ACTIVATIONS if act.gated else GELU_APPROXIMATE):
        raise ValueError(f"act must be Activation(name) with name one of {tuple(GELU_APPROXIMATE)}, or "
                         f"Activation(name, gated=True) with name one of {GATED_ACTIVATIONS}, got {act!r}")
    return act


def check_norm(norm):
    if not isinstance(norm, Norm) or norm.kind not in NORM_KINDS:
        raise ValueError(f"norm must be a Norm(weight, bias, eps, kind, style) with kind one of {NORM_KINDS}, "
                         f"got {norm!r}")
    if norm.kind == "rms_norm" and (norm.style not in RMS_NORM_STYLES or norm.bias is not None):
        raise ValueError(f"an rms_norm Norm has no bias and a style, one of {RMS_NORM_STYLES}, got {norm!r}")
    return norm
