"""remat: fused Triton and CUDA kernels whose backward passes recompute instead of store."""

import importlib
import os
import sys

__version__ = "0.1.0"

# Public name -> (module of this package, attribute of it; None: the module itself). Imported by
# `import remat` (which registers the custom ops), in this order.
_EAGER = {
    "nn": ("nn", None), "ops": ("ops", None),
    "backends": ("_backend", "backends"), "get_backend": ("_backend", "get_backend"),
    "set_backend": ("_backend", "set_backend"), "use_backend": ("_backend", "use_backend"),
    "convert": ("convert", "convert"), "revert": ("convert", "revert"),
    "attention": ("ops.attention", "attention"), "attention_varlen": ("ops.attention_varlen", "attention_varlen"),
    "layer_norm_linear": ("ops.fused", "layer_norm_linear"), "mlp": ("ops.fused", "mlp"),
    "experts": ("ops.experts", "experts"),
    "gated_activation": ("ops.gated", "gated_activation"), "gelu": ("ops.gelu", "gelu"),
    "layer_norm": ("ops.layer_norm", "layer_norm"),
    "linear_cross_entropy": ("ops.linear_cross_entropy", "linear_cross_entropy"),
    "rms_norm": ("ops.rms_norm", "rms_norm"),
}
# Imported on first use: the planner pulls in torch's compiler stack (torch._dynamo, through
# torch.compiler.disable in planner/offload.py), which most users of the kernels never need.
_ON_FIRST_USE = {"Plan": ("planner", "Plan"), "plan": ("planner", "plan"),
                 "calibrate": ("planner.calibrate", "calibrate")}


def _import(name, table):
    module, attribute = table[name]
    found = importlib.import_module(f".{module}", __name__)
    return found if attribute is None else getattr(found, attribute)


def _load():
    """Import the kernels, layers and conversion and bind their public names (what `import remat` does)."""
    for name in _EAGER:
        globals()[name] = _import(name, _EAGER)


def _run_as_command():
    """True when this process is the `remat` command (its launcher is named remat): the command
    parses its arguments first and calls _load() after, so that `remat --help` and a mistyped
    argument answer before torch is imported (remat.cli)."""
    launcher = os.path.basename(getattr(sys, "argv", [""])[0] or "")
    return launcher.removesuffix(".exe") == "remat"


def __getattr__(name):
    if name in _ON_FIRST_USE:
        value = globals()[name] = _import(name, _ON_FIRST_USE)
        return value
    if name in _EAGER:  # the `remat` command before it loaded the package
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EAGER) | set(_ON_FIRST_USE))


def register_attention():
    """Make "remat" an attention implementation of transformers: then
    `AutoModel.from_pretrained(..., attn_implementation="remat")` or `model.set_attn_implementation("remat")`
    run every attention that calls transformers' attention interface on remat's kernels
    (remat.convert does this itself)."""
    from .convert.hf.interface import register

    register()


def register_experts():
    """Make "remat" an experts implementation of transformers: then
    `AutoModelForCausalLM.from_pretrained(..., experts_implementation="remat")` or
    `model.set_experts_implementation("remat")` run the experts of every mixture-of-experts family
    that calls transformers' experts interface on remat.experts (remat.convert does this itself)."""
    from .convert.hf.experts import register

    register()


if not _run_as_command():
    _load()

__all__ = [
    "attention", "attention_varlen", "backends", "calibrate", "convert", "experts", "gated_activation", "gelu",
    "get_backend", "layer_norm", "layer_norm_linear", "linear_cross_entropy", "mlp", "nn", "ops", "Plan", "plan",
    "register_attention", "register_experts", "revert", "rms_norm", "set_backend", "use_backend",
]
