"""BART (encoder and decoder): self-attention on remat.attention, and the MLP the layer holds itself
(fc1 -> activation_fn -> fc2) fused. BART is post-LN: each LayerNorm follows a residual add, so
none is fused into a projection. The decoder's cross-attention (encoder_attn) runs stock.
activation_dropout in training runs the MLP stock."""

from .modules import CACHE_ARGS, _RematSplitAttention
from .registry import Family, LayerMLP, probe_tensor, register

# The MLP BART's layers (and Whisper's, which copy them) hold themselves.
LAYER_MLP = LayerMLP("fc1", "activation_fn", "fc2", "activation_dropout")


class _RematBartAttention(_RematSplitAttention):
    remat_cache_arg = CACHE_ARGS


def encoder_states_probe(module, param):
    """Encoder states for a probe call of a decoder layer: its cross-attention runs too."""
    if type(module).__name__.endswith("DecoderLayer"):
        return {"encoder_hidden_states": probe_tensor(param, 2, 3, module.embed_dim)}
    return {}


register(Family(
    name="bart",
    attention={"BartAttention": _RematBartAttention},
    layer_mlps={"BartEncoderLayer": LAYER_MLP, "BartDecoderLayer": LAYER_MLP},
    cross_attention={"BartDecoderLayer": ("encoder_attn",)},
    probe_kwargs=encoder_states_probe,
))
