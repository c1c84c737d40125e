"""SigLIP, vision and text towers: attention on remat.attention with layer_norm1 fused into q, k and
v, the MLP (gelu_pytorch_tanh by default) fused with layer_norm2 in front; the vision tower's
pooling head fuses its layernorm into its MLP. Both towers attend bidirectionally (is_causal
False); the text tower's padding masks run remat.attention_varlen."""

from .modules import MLPParts, _RematSplitAttention
from .registry import Family, register
from .vit import image_input


class _RematSiglipAttention(_RematSplitAttention):
    remat_scale_attr = "scale"


register(Family(
    name="siglip",
    attention={"SiglipAttention": _RematSiglipAttention},
    mlps={"SiglipMLP": MLPParts("fc1", "activation_fn", "fc2", None)},
    layers={"SiglipEncoderLayer": ((("layer_norm1", "self_attn"), ("layer_norm2", "mlp")),),
            "SiglipMultiheadAttentionPoolingHead": ((("layernorm", "mlp"),),)},
    memory_input=image_input(0),
    model_types=("siglip_vision_model",),
))
