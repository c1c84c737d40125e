"""BLOOM: the attention on remat.attention, its ALiBi bias as remat.attention's alibi_slopes, with
input_layernorm fused into query_key_value; the MLP (BloomGelu: the tanh approximation, written by
hand) fused with post_attention_layernorm in front. apply_residual_connection_post_layernorm=True
makes the LayerNorms' outputs the residuals too: they then stay stock (the MLP still fuses).

BLOOM's ALiBi adds slope_h · j (key position j) to the scores, relying on softmax's invariance to a
constant per row: under its causal mask that is remat.attention's -slope_h · (i - j), FlashAttention's
convention. The model passes the bias, (batch · heads, 1, seq) in the model's dtype: each call checks
that it is the slopes times the key positions, the slopes read from a key at position 1. A padded
batch restarts the positions at each sequence's first real token: the same bias, per sequence, as
remat.attention_varlen's ALiBi on the real tokens. remat adds the bias in fp32, where the stock
forward adds it rounded to the model's dtype (in bf16 exact up to key position 256)."""

import sys

import torch

from .masks import Packing
from .modules import MLPParts, _RematAttention, _RematMLP, stock_function
from .registry import Family, probe_tensor, register


class _RematBloomAttention(_RematAttention):
    """BloomAttention(hidden_states, residual, alibi, attention_mask, layer_past, ...): q, k, v from
    query_key_value (heads interleaved: (batch, seq, heads, 3, head_dim)), remat.attention with the
    ALiBi slopes, dense, and dropout_add with the residual, as the stock forward."""

    remat_cache_arg = "layer_past"
    remat_extra_args = ("residual", "alibi")
    remat_scale_attr = "inv_norm_factor"
    remat_projections = ("query_key_value",)
    remat_output_projection = "dense"
    remat_attributes = ("num_heads", "beta", "pretraining_tp", "slow_but_exact", "hidden_dropout",
                        "attention_dropout")

    @classmethod
    def remat_refuse_reason(cls, module):
        if module.beta != 1.0:
            return f"beta={module.beta}: the stock forward scales its ALiBi bias"
        return None

    def remat_implementation(self):
        return "eager"  # BloomAttention computes its scores itself: no attention interface

    def remat_dropout(self):
        return self.attention_dropout.p

    def remat_fallback_reason(self, hidden_states, call):
        if self.pretraining_tp > 1 and self.slow_but_exact:
            return "pretraining_tp > 1 with slow_but_exact: the stock forward sums dense in slices"
        return super().remat_fallback_reason(hidden_states, call)

    def remat_core_reason(self, hidden_states, call):
        reason = super().remat_core_reason(hidden_states, call)
        pattern = call.get("remat_mask_pattern")
        packing = pattern if isinstance(pattern, Packing) and pattern.causal else None
        if reason is None and pattern != "causal" and packing is None:
            reason = "no causal mask: BLOOM's ALiBi bias equals remat.attention's under a causal mask only"
        if reason is None:
            batch, seq = hidden_states.shape[:2]
            positions = None if packing is None else _key_positions(packing, batch, seq)
            slopes = _alibi_slopes(call["alibi"], batch, self.num_heads, seq, positions)
            if slopes is None:
                return "an ALiBi bias other than the slopes times the key positions"
            call["remat_alibi_slopes"] = slopes
        return reason

    def remat_qkv(self, outputs, call):
        (fused,) = outputs
        batch, seq, _ = fused.shape
        fused = fused.view(batch, seq, self.num_heads, 3, self.head_dim)
        return tuple(fused[..., i, :].transpose(1, 2) for i in range(3))

    def remat_features(self, call):
        return {**super().remat_features(call), "alibi_slopes": call["remat_alibi_slopes"]}

    def remat_output(self, o):
        return self.dense(o)

    def remat_forward(self, outputs, call, causal):
        out, _ = super().remat_forward(outputs, call, causal)
        return stock_function(self, "dropout_add")(out, call["residual"], self.hidden_dropout, self.training), None


def _key_positions(packing, batch, seq):
    """(batch, seq) fp32: each kept key's position in its sequence, 0 for the others, as the stock
    model's positions (the attention mask's cumulative sum less one, times the mask) give them."""
    lengths = packing.cu_seqlens_k[1:] - packing.cu_seqlens_k[:-1]
    starts = torch.repeat_interleave(packing.cu_seqlens_k[:-1], lengths)
    within = torch.arange(starts.numel(), device=starts.device) - starts
    positions = torch.zeros(batch, seq, device=starts.device)
    return positions.index_put(packing.rows_k, within.float())


def _alibi_slopes(alibi, batch, heads, seq, positions=None):
    """The fp32 slopes (heads,) when the bias `alibi` (batch · heads, 1, seq) is slope_h · p_j for the
    key positions p (batch, seq) in every row (default: p_j = j), as rounded to its dtype; else None.
    The slopes are read where a key's position is 1. One comparison on the device."""
    if not isinstance(alibi, torch.Tensor) or tuple(alibi.shape) != (batch * heads, 1, seq):
        return None
    bias = alibi.view(batch, heads, seq)
    if positions is None:
        positions = torch.arange(seq, device=alibi.device, dtype=torch.float32).expand(batch, seq)
    ones = (positions == 1).nonzero()
    if ones.shape[0] == 0:  # no sequence of two tokens: any slopes give every key the same bias
        slopes = torch.zeros(heads, device=alibi.device)
    else:
        slopes = bias[ones[0, 0], :, ones[0, 1]].float().contiguous()
    expected = (slopes[None, :, None] * positions[:, None, :]).to(alibi.dtype)
    return slopes if bool(torch.equal(bias, expected)) else None


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
    """For a block or its attention, the model's own ALiBi bias and causal mask over (2, 3) tokens (a
    random bias would run the attention stock); the residual for the attention and the MLP."""
    kind = type(module).__name__
    if kind in ("BloomBlock", "BloomAttention"):
        heads = module.num_heads
        alibi = sys.modules[type(module).__module__].build_alibi_tensor(
            torch.ones(2, 3, device=param.device), heads, param.dtype)
        hidden = torch.full((3, 3), torch.finfo(param.dtype).min, device=param.device, dtype=param.dtype)
        kwargs = {"alibi": alibi, "attention_mask": hidden.triu(1)[None, None].expand(2, 1, 3, 3)}
        if kind == "BloomAttention":
            kwargs["residual"] = probe_tensor(param, 2, 3, module.dense.out_features)
        return kwargs
    if kind == "BloomMLP":
        return {"residual": probe_tensor(param, 2, 3, module.dense_4h_to_h.out_features)}
    return {}


register(Family(
    name="bloom",
    attention={"BloomAttention": _RematBloomAttention},
    mlps={"BloomMLP": MLPParts("dense_h_to_4h", "gelu_impl", "dense_4h_to_h", None, _RematBloomMLP)},
    layers={"BloomBlock": ((("input_layernorm", "self_attention"), ("post_attention_layernorm", "mlp")),)},
    layer_reason=_layer_reason,
    probe_kwargs=_probe_kwargs,
))
