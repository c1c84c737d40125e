"""Whisper (encoder and decoder): self-attention on remat.attention with self_attn_layer_norm fused
into q, k and v, and the MLP the layer holds itself (fc1 -> activation_fn -> fc2) fused with
final_layer_norm in front. The decoder's cross-attention (encoder_attn) runs stock, its q_proj
with encoder_attn_layer_norm fused in. activation_dropout in training runs the MLP stock."""

from .bart import LAYER_MLP, encoder_states_probe
from .modules import CACHE_ARGS, _RematSplitAttention
from .registry import Family, register


class _RematWhisperAttention(_RematSplitAttention):
    remat_cache_arg = CACHE_ARGS
    remat_query_scaled = True


register(Family(
    name="whisper",
    attention={"WhisperAttention": _RematWhisperAttention},
    layers={"WhisperEncoderLayer": ((("self_attn_layer_norm", "self_attn"), ("final_layer_norm", "fc1")),),
            "WhisperDecoderLayer": ((("self_attn_layer_norm", "self_attn"),
                                     ("encoder_attn_layer_norm", "encoder_attn.q_proj"),
                                     ("final_layer_norm", "fc1")),)},
    layer_mlps={"WhisperEncoderLayer": LAYER_MLP, "WhisperDecoderLayer": LAYER_MLP},
    cross_attention={"WhisperDecoderLayer": ("encoder_attn",)},
    probe_kwargs=encoder_states_probe,
))
