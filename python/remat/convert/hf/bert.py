"""BERT and RoBERTa: self-attention on remat.attention (post-LN: no LayerNorm to fuse in front), and
the FFN, split over the intermediate and output modules, fused into the output: the intermediate
returns its input while the output computes LayerNorm(dropout(dense(gelu(intermediate.dense(x)))) + x)."""

from .modules import CACHE_ARGS, _RematAttention, split_heads
from .registry import Family, register


class _RematBertSelfAttention(_RematAttention):
    """BertSelfAttention / RobertaSelfAttention: q, k, v Linears; the out-projection is BertSelfOutput's."""

    remat_cache_arg = CACHE_ARGS  # past_key_values in transformers 5.17
    remat_head_dim_attr = "attention_head_size"
    remat_projections = ("query", "key", "value")

    def remat_dropout(self):
        return self.dropout.p

    def remat_qkv(self, outputs, call):
        return (split_heads(t, self.num_attention_heads, self.attention_head_size) for t in outputs)

    def remat_output(self, o):
        return o


for prefix, memory_models in (("Bert", {"bert-base": ("bert", {})}), ("Roberta", {})):
    register(Family(
        name=prefix.lower(),
        attention={f"{prefix}SelfAttention": _RematBertSelfAttention},
        pairs={f"{prefix}Layer": ("intermediate", f"{prefix}Intermediate", "output", f"{prefix}Output")},
        memory_models=memory_models,
    ))
