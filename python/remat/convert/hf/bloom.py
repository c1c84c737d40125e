"""BLOOM: the MLP (BloomGelu: the tanh approximation, written by hand) fused with
post_attention_layernorm in front; input_layernorm fused into the attention's query_key_value,
the attention itself kept stock: its ALiBi position bias is one remat.attention does not add yet.
apply_residual_connection_post_layernorm=True makes the LayerNorms' outputs the residuals too:
they then stay stock (the MLP still fuses)."""

from .modules import MLPParts, _RematMLP, stock_function
from .registry import Family, probe_tensor, register


class _RematBloomMLP(_RematMLP):
    """BloomMLP(hidden_states, residual): dropout_add(fc2(gelu(fc1(x))), residual), as the stock forward."""

    def remat_call_reason(self):
        if self.pretraining_tp > 1 and self.slow_but_exact:
            return "pretraining_tp > 1 with slow_but_exact: the stock forward sums dense_4h_to_h in slices"
        return None

    def remat_finish(self, out, residual):
        return stock_function(self, "dropout_add")(out, residual, self.hidden_dropout, self.training)


def _layer_reason(layer):
    if layer.apply_residual_connection_post_layernorm:
        return "apply_residual_connection_post_layernorm: its output is the residual too, not only the next input"
    return None


def _probe_kwargs(module, param):
    """A random ALiBi bias (batch * heads, 1, seq) for a block, the residual for the MLP."""
    kind = type(module).__name__
    if kind == "BloomBlock":
        return {"alibi": probe_tensor(param, 2 * module.num_heads, 1, 3)}
    if kind == "BloomMLP":
        return {"residual": probe_tensor(param, 2, 3, module.dense_4h_to_h.out_features)}
    return {}


register(Family(
    name="bloom",
    mlps={"BloomMLP": MLPParts("dense_h_to_4h", "gelu_impl", "dense_4h_to_h", None, _RematBloomMLP)},
    layers={"BloomBlock": ((("input_layernorm", "self_attention.query_key_value"),
                            ("post_attention_layernorm", "mlp")),)},
    stock_attention={"BloomAttention": "ALiBi position bias: remat.attention has no attention bias yet, so BLOOM's "
                                       "attention runs as it is (input_layernorm is fused into its query_key_value)"},
    layer_reason=_layer_reason,
    probe_kwargs=_probe_kwargs,
))
