"""CLIP: the MLP fused where it runs a GELU (CLIP's default quick_gelu is not one remat computes)."""

from .modules import MLPParts
from .registry import Family, register

register(Family(
    name="clip",
    mlps={"CLIPMLP": MLPParts("fc1", "activation_fn", "fc2", None)},
))
