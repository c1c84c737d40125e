"""DeiT: ViT's layer (vit.py) under DeiT's class names: attention on remat.attention with
layernorm_before fused into q, k and v, the MLP fused with layernorm_after in front."""

from .registry import register
from .vit import image_input, vit_family

register(vit_family("deit", "DeiT", memory_input=image_input(2), model_types=("deit",)))
