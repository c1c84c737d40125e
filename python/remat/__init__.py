"""remat: fused Triton and CUDA kernels whose backward passes recompute instead of store."""

from . import nn, ops
from ._backend import backends, get_backend, set_backend, use_backend
from .convert import convert, revert
from .ops.attention import attention
from .ops.attention_varlen import attention_varlen
from .ops.fused import layer_norm_linear, mlp
from .ops.gated import gated_activation
from .ops.gelu import gelu
from .ops.layer_norm import layer_norm
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.rms_norm import rms_norm
from .planner import Plan, plan
from .planner.calibrate import calibrate

__version__ = "0.1.0"


def register_attention():
    """Make "remat" an attention implementation of transformers: then
    `AutoModel.from_pretrained(..., attn_implementation="remat")` or `model.set_attn_implementation("remat")`
    run every attention that calls transformers' attention interface on remat's kernels
    (remat.convert does this itself)."""
    from .convert.hf.interface import register

    register()

__all__ = [
    "attention", "attention_varlen", "backends", "calibrate", "convert", "gated_activation", "gelu", "get_backend",
    "layer_norm", "layer_norm_linear", "linear_cross_entropy", "mlp", "nn", "ops", "Plan", "plan", "register_attention",
    "revert", "rms_norm", "set_backend", "use_backend",
]
