"""GPT-J: one LayerNorm, ln_1, feeds the attention and the MLP in parallel; it is fused into both
(the attention's q/k/v projections on remat.attention, its interleaved rotary embedding on the
first rotary_dim dims included, and fc_in of the MLP, fused). Each keeps the same x, once, and its
own fp32 mean/rstd. transformers 5.17 writes GPT-J's attention without the attention interface
(no scaling attribute, no position_embeddings argument): there it is left stock, and ln_1 with
it, while the MLP still fuses."""

import torch

from .modules import CACHE_ARGS, MLPParts, _RematSplitAttention, split_heads, stock_function
from .registry import Family, register, rotary_probe_kwargs, stock_name


class _RematGPTJAttention(_RematSplitAttention):
    remat_cache_arg = CACHE_ARGS
    remat_extra_args = ("position_embeddings",)
    remat_dropout_attr = "attention_dropout"

    def remat_qkv(self, outputs, call):
        q, k, v = outputs
        # The stock rotation, on (B, S, H, D) as the stock forward applies it, then (B, H, S, D).
        q, k = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k))
        sin, cos = call["position_embeddings"]
        rotate = stock_function(self, "apply_rotary_pos_emb")
        if self.rotary_dim is not None:
            dims = self.rotary_dim
            q, k = (torch.cat([rotate(t[..., :dims], sin, cos), t[..., dims:]], dim=-1) for t in (q, k))
        else:
            q, k = rotate(q, sin, cos), rotate(k, sin, cos)
        return q.transpose(1, 2), k.transpose(1, 2), split_heads(v, self.num_attention_heads, self.head_dim)

    def remat_output(self, o):
        return self.resid_dropout(self.out_proj(o))


def _rotary_width(module):
    """The width of GPT-J's sin and cos: half the rotated dims (the stock forward repeats each twice)."""
    if stock_name(module) != "GPTJAttention":
        return None
    return (module.rotary_dim or module.embed_dim) // 2


def _probe_kwargs(module, param):
    return rotary_probe_kwargs(module, param, _rotary_width, sin_first=True)


register(Family(
    name="gptj",
    attention={"GPTJAttention": _RematGPTJAttention},
    mlps={"GPTJMLP": MLPParts("fc_in", "act", "fc_out", "dropout")},
    layers={"GPTJBlock": ((("ln_1", "attn"), ("ln_1", "mlp")),)},
    probe_kwargs=_probe_kwargs,
))
