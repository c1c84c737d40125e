"""remat: fused Triton and CUDA kernels whose backward passes recompute instead of store."""

from . import nn, ops
from ._backend import backends, get_backend, set_backend, use_backend
from .convert import convert, revert
from .ops.attention import attention
from .ops.fused import layer_norm_linear, mlp
from .ops.gelu import gelu
from .ops.layer_norm import layer_norm

__version__ = "0.1.0"

__all__ = [
    "attention", "backends", "convert", "gelu", "get_backend", "layer_norm", "layer_norm_linear", "mlp",
    "nn", "ops", "revert", "set_backend", "use_backend",
]
