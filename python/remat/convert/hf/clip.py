"""CLIP, vision and text towers: attention on remat.attention with layer_norm1 fused into q, k and v
(the text tower's causal mask read as causal), the MLP (QuickGELU, CLIP's default quick_gelu, or a GELU)
fused with layer_norm2 in front. The vision tower's pre/post LayerNorms feed no Linear: they stay stock."""

from .modules import MLPParts
from .registry import Family, register
from .siglip import _RematSiglipAttention  # the same attention: separate q, k, v, `scale`, is_causal False

register(Family(
    name="clip",
    attention={"CLIPAttention": _RematSiglipAttention},
    mlps={"CLIPMLP": MLPParts("fc1", "activation_fn", "fc2", None)},
    layers={"CLIPEncoderLayer": ((("layer_norm1", "self_attn"), ("layer_norm2", "mlp")),)},
))
