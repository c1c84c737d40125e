"""T5, and its copies mT5 and UMT5 (the same modules under their own prefix): each sub-layer's
T5LayerNorm (an RMSNorm, the "t5" style) fused into what it feeds; the attention stays stock.

  <P>LayerSelfAttention   layer_norm -> SelfAttention.q, .k and .v: three Linears inside the stock
                          attention, each applying the norm (x and the fp32 rstd kept once)
  <P>LayerCrossAttention  layer_norm -> EncDecAttention.q (k and v read the encoder's states)
  <P>LayerFF              the gated FFN (act(wi_0(x)) * wi_1(x) -> dropout -> wo, T5 v1.1, flan-T5,
                          mT5, UMT5) fused with layer_norm in front; the non-gated one (wi -> ReLU ->
                          wo, the original T5) runs stock, layer_norm fused into its wi alone.

The attention adds a relative position bias (and the mask, folded into it) to unscaled scores:
remat.attention adds no bias. Dropout (dropout_rate, 0.1 by default) matters for the gated FFN only,
between the product and wo: in training with p > 0 that call runs stock. A wo kept in another dtype
than wi_0/wi_1 (T5's _keep_in_fp32_modules, when loaded in half precision) leaves the FFN stock."""

import inspect

from torch import nn

from ..._linears import base_layer, projection
from ..patterns import gelu_approximate
from .modules import MLPParts, _RematGatedMLP
from .registry import Family, probe_tensor, register

SELF_ATTENTION = ((("layer_norm", "SelfAttention.q"), ("layer_norm", "SelfAttention.k"),
                   ("layer_norm", "SelfAttention.v")),)
CROSS_ATTENTION = ((("layer_norm", "EncDecAttention.q"),),)
# The non-gated FFN first: only it has a wi; the gated one takes the norm whole.
FF = ((("layer_norm", "DenseReluDense.wi"),), (("layer_norm", "DenseReluDense"),))

ATTENTION_REASON = ("relative position bias added to unscaled scores: remat.attention has no attention bias, so "
                    "T5's attention runs as it is (layer_norm is fused into its q, k and v)")


class _RematT5GatedMLP(_RematGatedMLP):
    """T5DenseGatedActDense: wo(dropout(act(wi_0(x)) * wi_1(x))), fused while the dropout does nothing."""

    @classmethod
    def remat_parts_reason(cls, module, parts):
        names = (*parts.fc1, parts.fc2)
        if type(module._modules.get("dropout")) is not nn.Dropout:
            return f"{type(module).__name__} lacks the expected dropout (nn.Dropout) before {parts.fc2}"
        if all(projection(module._modules[n], n)[1] is None for n in names):
            wi, wo = (base_layer(module._modules[n]).weight.dtype for n in (parts.fc1[0], parts.fc2))
            if wi != wo:
                return (f"{parts.fc2} is kept in {wo}, {parts.fc1[0]} and {parts.fc1[1]} are {wi} (T5's "
                        f"_keep_in_fp32_modules): the stock forward casts the product to {parts.fc2}'s dtype, "
                        "which remat's fused gated MLP does not")
        return super().remat_parts_reason(module, parts)

    def remat_call_reason(self):
        dropout = self._modules.get("dropout")
        if type(dropout) is not nn.Dropout:
            return "its dropout before wo is no longer an nn.Dropout"
        if self.training and dropout.p > 0:
            return f"dropout (p={dropout.p}) between act(wi_0) * wi_1 and wo in training"
        return None


def _dense_act_dense_reason(module):
    """Why T5's non-gated FFN (T5DenseActDense: wi -> act -> dropout -> wo) runs as it is."""
    act = module._modules.get("act")
    if gelu_approximate(act) is None:
        why = f"{type(act).__name__} between wi and wo: remat.mlp fuses GELU MLPs only"
    else:
        why = "remat fuses T5's gated FFN, not the non-gated one"
    return f"the non-gated FFN wi -> act -> wo runs as it is ({why}); layer_norm may still fuse into its wi"


def _probe_kwargs(module, param):
    """Encoder states for a probe call of a cross-attention sub-layer: T5's and mT5's key_value_states,
    UMT5's encoder_hidden_states."""
    if not type(module).__name__.endswith("LayerCrossAttention"):
        return {}
    parameters = inspect.signature(module.forward).parameters
    name = next((n for n in ("key_value_states", "encoder_hidden_states") if n in parameters), None)
    norm = module._modules.get("layer_norm")
    if name is None or norm is None:
        return {}
    return {name: probe_tensor(param, 2, 3, norm.weight.shape[0])}


def t5_like(name, prefix):
    """The Family of T5 or one of its copies, whose classes are named <prefix>LayerNorm, <prefix>LayerFF, ..."""
    return Family(
        name=name,
        mlps={f"{prefix}DenseGatedActDense": MLPParts(("wi_0", "wi_1"), "act", "wo", None, _RematT5GatedMLP)},
        layers={f"{prefix}LayerSelfAttention": SELF_ATTENTION, f"{prefix}LayerCrossAttention": CROSS_ATTENTION,
                f"{prefix}LayerFF": FF},
        norms={f"{prefix}LayerNorm": "t5"},
        stock_attention={f"{prefix}Attention": ATTENTION_REASON},
        stock_mlps={f"{prefix}DenseActDense": _dense_act_dense_reason},
        cross_attention={f"{prefix}LayerCrossAttention": ("EncDecAttention",)},
        probe_kwargs=_probe_kwargs,
    )


register(t5_like("t5", "T5"))
register(t5_like("mt5", "MT5"))
register(t5_like("umt5", "UMT5"))
