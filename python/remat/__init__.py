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
from .ops.rms_norm import rms_norm
from .planner import Plan, plan
from .planner.calibrate import calibrate

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_varlen", "backends", "calibrate", "convert", "gated_activation", "gelu", "get_backend",
    "layer_norm", "layer_norm_linear", "mlp", "nn", "ops", "Plan", "plan", "revert", "rms_norm", "set_backend",
    "use_backend",
]
