"""What remat fuses, as data, and the one check that a run of modules is such a fusion.

A fusion is a pattern of roles, and each front-end (nn.Sequential by position, torch.fx by the
dataflow of a forward, a Hugging Face model by what its structure probe recorded) finds runs of
modules that may play them, then asks `fusable(pattern, modules)` whether that run is exactly what remat's fused
op computes, and if not, why:

    pattern            roles                                   fused op / module
    LayerNormMLP       norm, linear, activation, linear        remat.ops.fused.mlp(..., layer_norm=True)
    MLP                linear, activation, linear              remat.ops.fused.mlp
    LayerNormLinear    norm, linear (one or more)              remat.ops.fused.layer_norm_linears

    norm        an exact nn.LayerNorm over the last dimension with affine parameters (a bias too,
                in front of an MLP), without hooks
    linear      nn.Linear, transformers' Conv1D, or peft's LoRA around either (remat._linears)
    activation  a GELU remat computes: nn.GELU (exact or tanh), transformers' GELU classes
                (GELUActivation; GELUTanh, PytorchGELUTanh, NewGELUActivation, FastGELUActivation and
                BLOOM's BloomGelu: the tanh approximation), without hooks

and every parameter of the run on one device in one dtype.
"""

import collections

from torch import nn

from .. import nn as remat_nn
from .._guards import from_transformers, hook_reason
from .._linears import base_layer, projection, widths

Pattern = collections.namedtuple("Pattern", "name roles")
LAYER_NORM_MLP = Pattern("LayerNormMLP", ("norm", "linear", "activation", "linear"))
MLP = Pattern("MLP", ("linear", "activation", "linear"))
LAYER_NORM_LINEAR = Pattern("LayerNormLinear", ("norm", "linear"))

# transformers' GELU modules, by class name (transformers need not be imported): their approximation.
# FastGELUActivation and BloomGelu write the tanh approximation by hand with sqrt(2/pi) rounded to
# 0.7978845608 and 0.79788456 (and BloomGelu's backward 3 * 0.044715 * sqrt(2/pi) to 0.1070322243):
# relative changes under 1e-8, below the rounding of any dtype the kernels run in (fp32: 6e-8), so
# the function is the same; in bf16/fp16 the stock Python formulas round after every op, the kernels
# once, in fp32 (closer to the exact function).
TRANSFORMERS_GELUS = {"GELUActivation": "none", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh",
                      "NewGELUActivation": "tanh", "FastGELUActivation": "tanh", "BloomGelu": "tanh",
                      "QuickGELUActivation": "quick"}


def gelu_approximate(module, kind=None):
    """"none", "tanh" or "quick" for the GELU modules remat computes exactly, else None. kind: the class to
    judge `module` by (the stock class of a swapped module), default its own."""
    kind = kind or type(module)
    if kind in (nn.GELU, remat_nn.GELU):
        return module.approximate if module.approximate in ("none", "tanh") else None
    if from_transformers(kind):
        return TRANSFORMERS_GELUS.get(kind.__name__)
    return None


def _activation_reason(act, label, kind, allow, computed, what):
    """Why `act` (judged as a `kind`, default its own class) is none of the activations `what` names, those
    for which computed(act, kind) is not None, or None (hooks allow(hook) takes not counted)."""
    label = label or "activation"
    if not isinstance(act, nn.Module) or computed(act, kind) is None:
        return f"{label} {(kind or type(act)).__name__} is not {what}"
    reason = hook_reason(act, allow=allow)
    return f"{type(act).__name__} {reason}" if reason else None


def activation_reason(act, label=None, kind=None, allow=None):
    """Why `act` (judged as a `kind`, default its own class) cannot play the activation role, or None (hooks
    allow(hook) takes not counted)."""
    return _activation_reason(act, label, kind, allow, gelu_approximate, "a GELU remat computes (exact, tanh or quick)")


# transformers' SiLU modules, by class name: ACT2FN["silu"] (nn.functional.silu; nn.SiLU in older releases).
TRANSFORMERS_SILUS = ("SiLUActivation",)


def gated_activation_name(module, kind=None):
    """The gated kernels' name ("silu", "gelu" or "gelu_tanh") of the activation module applied to
    the gate, for the modules remat computes exactly, else None. kind: as for gelu_approximate."""
    kind = kind or type(module)
    if kind is nn.SiLU or (from_transformers(kind) and kind.__name__ in TRANSFORMERS_SILUS):
        return "silu"
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(gelu_approximate(module, kind))


def gated_activation_reason(act, label=None, kind=None, allow=None):
    """Why `act` cannot be the activation of a gated MLP remat fuses, or None (hooks allow(hook) takes not
    counted)."""
    return _activation_reason(act, label, kind, allow, gated_activation_name,
                              "an activation remat's gated MLP computes (SiLU, exact or tanh GELU)")


def uniform_reason(*modules):
    """None when all parameters of `modules` share one device and dtype, else why not."""
    params = [p for m in modules for p in base_layer(m).parameters(recurse=False)]
    if len({(p.device, p.dtype) for p in params}) > 1:
        return "parameters on different devices or dtypes"
    return None


def layer_norm_fusable(norm, width, need_bias=False):
    """None when `norm` (an exact nn.LayerNorm) can play the norm role before a Linear of input
    width `width`, else why not."""
    if type(norm) not in (nn.LayerNorm, remat_nn.LayerNorm):
        return f"{type(norm).__name__} is not exactly nn.LayerNorm"
    if len(norm.normalized_shape) != 1:
        return "LayerNorm over more than the last dimension"
    if not norm.elementwise_affine:
        return "LayerNorm without affine parameters (elementwise_affine=False) is not supported by the fused layers"
    if need_bias and norm.bias is None:
        return "LayerNorm without bias is not supported by LayerNormMLP"
    if norm.normalized_shape[0] != width:
        return f"LayerNorm width {norm.normalized_shape[0]} != the Linear's in_features {width}"
    return hook_reason(norm)


def fusable(pattern, modules, labels=None):
    """None when `modules` (one per role of `pattern`; several Linears for LayerNormLinear) are
    exactly what remat's fused op computes, else why not. `labels` name the modules in reasons
    (default: their class names)."""
    labels = labels or [type(m).__name__ for m in modules]
    roles = pattern.roles if pattern is not LAYER_NORM_LINEAR else ("norm",) + ("linear",) * (len(modules) - 1)
    linears = [(m, label) for m, role, label in zip(modules, roles, labels, strict=True) if role == "linear"]
    for module, label in linears:
        if widths(module) is None:
            return f"{label} is {type(module).__name__}, not exactly nn.Linear"
        reason = projection(module, label)[1]
        if reason:
            return reason
    for module, role in zip(modules, roles):
        if role == "activation":
            reason = activation_reason(module)
            if reason:
                return reason
    if pattern is not LAYER_NORM_LINEAR:
        (h_in, f_out), (f_in, h_out) = widths(linears[0][0]), widths(linears[1][0])
        if f_in != f_out or h_out != h_in:
            return f"widths do not chain: {h_in}->{f_out} then {f_in}->{h_out} (MLP needs hidden->ffn->hidden)"
    if roles[0] == "norm":
        reason = layer_norm_fusable(modules[0], widths(linears[0][0])[0], need_bias=pattern is LAYER_NORM_MLP)
        if reason:
            return reason
    return uniform_reason(*modules)


def unsupported_reason(module):
    """Why a module remat recognises is not converted (RMSNorm, gated MLPs), or None."""
    if type(module).__name__.endswith(("RMSNorm", "T5LayerNorm")):  # torch.nn.RMSNorm, LlamaRMSNorm, (M)T5's, ...
        return ("RMSNorm: no fusion with a Linear after it applies here (remat fuses an RMSNorm whose output only "
                "projections read, in Hugging Face models and remat.nn.RMSNormLinear and GatedMLP); it runs as it "
                "is and saves nothing")
    children = set(module._modules)
    if any(names <= children for names in GATED_MLP_NAMES):
        return ("gated MLP (act(gate) * up -> down): not fused outside the Hugging Face models remat "
                "converts (found there by structure; remat.nn.GatedMLP.from_modules builds one); it runs as it is "
                "and saves nothing")
    return None


GATED_MLP_NAMES = ({"gate_proj", "up_proj", "down_proj"}, {"gate_up_proj", "down_proj"}, {"w1", "w2", "w3"})


# ---------------------------------------------------------------------------------------------
# Fused modules that share the original submodules (nn.Sequential runs)
# ---------------------------------------------------------------------------------------------


def fused_module(pattern, modules, recompute):
    """The remat.nn module for a fusable run, holding the very modules of the run (made with its own
    parameters on the meta device: they are replaced right after)."""
    if pattern is LAYER_NORM_LINEAR:
        norm, linear = modules
        new = remat_nn.LayerNormLinear(*widths(linear), recompute=recompute, device="meta")
        new.norm, new.linear = norm, linear
        return new
    norm, (fc1, act, fc2) = (modules[0], modules[1:]) if pattern is LAYER_NORM_MLP else (None, modules)
    activation = "gelu_tanh" if gelu_approximate(act) == "tanh" else "gelu"
    cls = remat_nn.LayerNormMLP if norm is not None else remat_nn.MLP
    new = cls(*widths(fc1), activation, recompute=recompute, device="meta")
    if norm is not None:
        new.norm = norm
    new.fc1, new.fc2 = fc1, fc2
    new.__dict__["remat_activation"] = act  # not a submodule (keys unchanged): for revert, and fallbacks
    return new
