"""ViT: attention on remat.attention with layernorm_before fused into q, k and v (one LayerNorm computed
once for the three), the MLP fused with layernorm_after in front. DeiT (deit.py) is the same layer
under its own class names."""

import torch

from .modules import MLPParts, _RematSplitAttention
from .registry import Family, register


class _RematViTAttention(_RematSplitAttention):
    remat_output_projection = "o_proj"
    remat_dropout_attr = "attention_dropout"


def vit_family(name, prefix, **fields):
    """The Family of ViT's layer under the class names `prefix` + ViT's names without "ViT"."""
    return Family(
        name=name,
        attention={f"{prefix}Attention": _RematViTAttention},
        mlps={f"{prefix}MLP": MLPParts("fc1", "activation_fn", "fc2", None)},
        layers={f"{prefix}Layer": ((("layernorm_before", "attention"), ("layernorm_after", "mlp")),)},
        **fields,
    )


def image_input(extra_tokens):
    """memory_input for an image model: pixels, and its tokens per image (the patches and
    `extra_tokens` more: ViT's [CLS], DeiT's [CLS] and distillation token, none for SigLIP)."""

    def make(config, batch, seq, device, dtype):
        size = config.image_size
        pixels = torch.randn(batch, config.num_channels, size, size, device=device, dtype=dtype)
        return "pixel_values", pixels, (size // config.patch_size) ** 2 + extra_tokens

    return make


register(vit_family("vit", "ViT", memory_models={"vit-base": ("vit", {"image_size": 384})},
                    memory_input=image_input(1), model_types=("vit",)))
