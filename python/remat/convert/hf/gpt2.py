"""GPT-2: attention on remat.attention with ln_1 fused into c_attn, the MLP fused with ln_2 in front.

transformers' Conv1D projections hold their weights (in, out); the fused ops read them transposed.
"""

from .modules import CACHE_ARGS, MLPParts, _RematAttention, split_heads
from .registry import Family, register


class _RematGPT2Attention(_RematAttention):
    remat_cache_arg = CACHE_ARGS  # past_key_values in transformers 5.17
    remat_projections = ("c_attn",)
    remat_output_projection = "c_proj"

    def remat_dropout(self):
        return self.attn_dropout.p

    def remat_qkv(self, outputs, call):
        (qkv,) = outputs
        return (split_heads(t, self.num_heads, self.head_dim) for t in qkv.split(self.split_size, dim=2))

    def remat_output(self, o):
        return self.resid_dropout(self.c_proj(o))


register(Family(
    name="gpt2",
    attention={"GPT2Attention": _RematGPT2Attention},
    mlps={"GPT2MLP": MLPParts("c_fc", "act", "c_proj", "dropout")},
    layers={"GPT2Block": ((("ln_1", "attn"), ("ln_2", "mlp")),)},
    memory_models={"hf-gpt2-small": ("gpt2", {}),
                   "hf-gpt2-medium": ("gpt2", {"n_embd": 1024, "n_layer": 24, "n_head": 16})},
))
