"""Phi-1 / Phi-2 (PhiForCausalLM): one LayerNorm, input_layernorm, feeds the attention and the MLP in
parallel; it is fused into both (the attention's q/k/v projections on remat.attention, rotary on
the partial head dim and the optional q/k LayerNorms included, and fc1 of the MLP, fused). Each of
the two keeps the same x, once, and its own fp32 mean/rstd."""

from .gpt_neox import _probe_kwargs, _rotary
from .modules import CACHE_ARGS, MLPParts, _RematSplitAttention
from .registry import Family, register


class _RematPhiAttention(_RematSplitAttention):
    remat_cache_arg = CACHE_ARGS
    remat_extra_args = ("position_embeddings",)
    remat_output_projection = "dense"
    remat_dropout_attr = "attention_dropout"

    def remat_qkv(self, outputs, call):
        q, k, v = super().remat_qkv(outputs, call)
        if self.qk_layernorm:  # over each head, as the stock forward applies them
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = _rotary(q, k, *call["position_embeddings"])
        return q, k, v


register(Family(
    name="phi",
    attention={"PhiAttention": _RematPhiAttention},
    mlps={"PhiMLP": MLPParts("fc1", "activation_fn", "fc2", None)},
    layers={"PhiDecoderLayer": ((("input_layernorm", "self_attn"), ("input_layernorm", "mlp")),)},
    probe_kwargs=_probe_kwargs,  # GPT-NeoX's: the rotary cos and sin of the attention's rotary_ndims
))
