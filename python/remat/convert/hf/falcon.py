"""Falcon: attention on remat.attention (rotary embedding included; multi-query and the new decoder
architecture's grouped keys and values as GQA) with its LayerNorm(s) fused into query_key_value,
and the MLP fused with its LayerNorm in front. The layer comes in three wirings, by config:
sequential (input_layernorm -> attention, post_attention_layernorm -> MLP), parallel with two
LayerNorms (ln_attn, ln_mlp: the new decoder architecture's default) and parallel with one
LayerNorm feeding both (Falcon-7B's, or num_ln_in_parallel_attn=1): that one is fused into both,
each keeping the same x once and its own fp32 mean/rstd. FalconLinear (x @ W.T + b) is
Linear-like. ALiBi configs (alibi=True) keep the stock attention: remat.attention has no
position bias yet."""

import inspect

from .modules import MLPParts, _RematAttention, stock_function
from .registry import Family, register, rotary_probe_kwargs, stock_name


class _RematFalconAttention(_RematAttention):
    remat_cache_arg = "layer_past"
    remat_extra_args = ("position_embeddings",)
    remat_scale_attr = "inv_norm_factor"  # 1/sqrt(head_dim): SDPA's default scale, which the stock forward uses
    remat_projections = ("query_key_value",)
    remat_output_projection = "dense"

    @classmethod
    def remat_refuse_reason(cls, module):
        if getattr(module.config, "alibi", False):
            return "ALiBi position bias (alibi=True): remat.attention has no attention bias yet"
        return None

    def remat_dropout(self):
        return self.attention_dropout  # a probability, which the stock forward hands its attention function

    def remat_qkv(self, outputs, call):
        (qkv,) = outputs
        if self.new_decoder_architecture:
            q, k, v = self._remat_grouped_qkv(qkv)
        else:  # v alone copied out: a view would keep all of qkv (q and k are rotated copies)
            q, k, v = (t.transpose(1, 2) for t in self._remat_split_qkv(qkv))
            v = v.contiguous()
        cos, sin = call["position_embeddings"]
        q, k = stock_function(self, "apply_rotary_pos_emb")(q, k, cos, sin)
        return q, k, v

    def _remat_split_qkv(self, qkv):
        """q, k, v (B, S, heads, D) as views of qkv, in the stock layout: multi-query's queries, then its
        one key head and one value head; else query, key and value interleaved per head."""
        heads = qkv.unflatten(-1, (-1, self.head_dim))
        if self.multi_query:
            return heads.split([self.num_heads, 1, 1], dim=-2)
        return heads.unflatten(-2, (self.num_heads, 3)).unbind(-2)

    def _remat_grouped_qkv(self, qkv):
        """q (B, H, S, D) and each group's k and v once, (B, G, S, D), as GQA reads them; the stock
        forward copies them out to every head of the group."""
        batch, seq, _ = qkv.shape
        groups = qkv.view(batch, seq, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        q = groups[:, :, :, :-2].flatten(2, 3)
        k, v = groups[:, :, :, -2], groups[:, :, :, -1].contiguous()  # v alone: not a view keeping all of qkv
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def remat_output(self, o):
        return self.dense(o)


def _probe_kwargs(module, param):
    kwargs = rotary_probe_kwargs(module, param, lambda m: m.head_dim if stock_name(m) == "FalconAttention" else None)
    return {"alibi": None, **kwargs} if "alibi" in inspect.signature(module.forward).parameters else kwargs


register(Family(
    name="falcon",
    attention={"FalconAttention": _RematFalconAttention},
    mlps={"FalconMLP": MLPParts("dense_h_to_4h", "act", "dense_4h_to_h", None)},
    layers={"FalconDecoderLayer": (
        (("ln_attn", "self_attention"), ("ln_mlp", "mlp")),
        (("input_layernorm", "self_attention"), ("post_attention_layernorm", "mlp")),
        (("input_layernorm", "self_attention"), ("input_layernorm", "mlp")),
    )},
    probe_kwargs=_probe_kwargs,
))
