"""OPT: attention on remat.attention with self_attn_layer_norm fused into q, k and v, and
final_layer_norm fused into fc1, which the layer holds itself. OPT's MLP is fc1 -> ReLU -> fc2:
remat fuses GELU MLPs only, so the MLP stays stock (its fc1 with the LayerNorm fused in). OPT-350m's
do_layer_norm_before=False (post-LN) leaves the LayerNorms stock."""

from .modules import CACHE_ARGS, _RematSplitAttention
from .registry import Family, LayerMLP, register


class _RematOPTAttention(_RematSplitAttention):
    remat_cache_arg = CACHE_ARGS
    remat_query_scaled = True


def _layer_reason(layer):
    return None if layer.do_layer_norm_before else \
        "do_layer_norm_before=False (post-LN): the LayerNorm follows the residual add"


register(Family(
    name="opt",
    attention={"OPTAttention": _RematOPTAttention},
    layers={"OPTDecoderLayer": ((("self_attn_layer_norm", "self_attn"), ("final_layer_norm", "fc1")),)},
    layer_mlps={"OPTDecoderLayer": LayerMLP("fc1", "activation_fn", "fc2", None)},
    layer_reason=_layer_reason,
))
