"""ViT: attention on remat.attention with layernorm_before fused into q, k and v (one LayerNorm computed
once for the three), the MLP fused with layernorm_after in front."""

from .modules import MLPParts, _RematAttention, split_heads
from .registry import Family, register


class _RematViTAttention(_RematAttention):
    remat_projections = ("q_proj", "k_proj", "v_proj")
    remat_output_projection = "o_proj"

    def remat_dropout(self):
        return self.attention_dropout

    def remat_qkv(self, outputs, call):
        return (split_heads(t, self.num_attention_heads, self.head_dim) for t in outputs)

    def remat_output(self, o):
        return self.o_proj(o)


register(Family(
    name="vit",
    attention={"ViTAttention": _RematViTAttention},
    mlps={"ViTMLP": MLPParts("fc1", "activation_fn", "fc2", None)},
    layers={"ViTLayer": (("layernorm_before", "attention"), ("layernorm_after", "mlp"))},
    memory_models={"vit-base": ("vit", {"image_size": 384})},
))
