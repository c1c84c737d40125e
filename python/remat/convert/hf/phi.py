"""Phi-1 / Phi-2 (PhiForCausalLM): one LayerNorm, input_layernorm, feeds the attention and the MLP in
parallel; it is fused into both (the attention's q/k/v projections on remat.attention, rotary on
the partial head dim and the optional q/k LayerNorms included, and fc1 of the MLP, fused). Each of
the two keeps the same x, once, and its own fp32 mean/rstd."""

import torch

from .modules import CACHE_ARGS, MLPParts, _RematSplitAttention
from .registry import Family, register, rotary_probe_kwargs


def _rotary(q, k, cos, sin):
    """Rotary embeddings on the first cos.shape[-1] dims of q and k, as Phi applies them (rotate_half
    convention; cos and sin (B, S, rotary_dims) from the model's rotary_emb)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dims = cos.shape[-1]

    def rotate(t):
        t_rot, t_pass = t[..., :dims], t[..., dims:]
        half = t_rot.shape[-1] // 2
        rotated = torch.cat((-t_rot[..., half:], t_rot[..., :half]), dim=-1)
        return torch.cat([(t_rot * cos) + (rotated * sin), t_pass], dim=-1)

    return rotate(q), rotate(k)


def _probe_kwargs(module, param):
    """The rotary cos and sin the model computes for its layers and attentions (of rotary_ndims dims)."""
    return rotary_probe_kwargs(module, param, lambda m: getattr(m, "rotary_ndims", None))


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
    probe_kwargs=_probe_kwargs,
))
