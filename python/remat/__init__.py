"""remat: fused Triton and CUDA kernels whose backward passes recompute instead of store."""

from . import nn, ops
from ._backend import backends, get_backend, set_backend, use_backend
from .ops import layer_norm

__version__ = "0.1.0"

__all__ = ["backends", "get_backend", "layer_norm", "nn", "ops", "set_backend", "use_backend"]
