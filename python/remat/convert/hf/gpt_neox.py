"""GPT-NeoX / Pythia: attention on remat.attention (rotary embedding included, on a partial head dim
too) with input_layernorm fused into query_key_value, the MLP fused with post_attention_layernorm
in front."""

import torch

from .modules import MLPParts, _RematAttention
from .registry import Family, register, rotary_probe_kwargs


def _rotary(q, k, cos, sin):
    """Rotary embeddings on the first cos.shape[-1] dims of q and k, as GPT-NeoX applies them
    (rotate_half convention; cos and sin (B, S, rotary_dims) from the model's rotary_emb)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dims = cos.shape[-1]

    def rotate(t):
        t_rot, t_pass = t[..., :dims], t[..., dims:]
        half = t_rot.shape[-1] // 2
        rotated = torch.cat((-t_rot[..., half:], t_rot[..., :half]), dim=-1)
        return torch.cat([(t_rot * cos) + (rotated * sin), t_pass], dim=-1)

    return rotate(q), rotate(k)


class _RematGPTNeoXAttention(_RematAttention):
    remat_cache_arg = "layer_past"
    remat_extra_args = ("position_embeddings",)
    remat_head_dim_attr = "head_size"
    remat_projections = ("query_key_value",)
    remat_output_projection = "dense"

    def remat_dropout(self):
        return self.attention_dropout

    def remat_qkv(self, outputs, call):
        (qkv,) = outputs
        # GPT-NeoX packs q, k, v per head: (B, S, H, 3 * D)
        qkv = qkv.unflatten(-1, (-1, 3 * self.head_size)).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        cos, sin = call["position_embeddings"]
        q, k = _rotary(q, k, cos, sin)
        return q, k, v.contiguous()  # as a view, v would keep all of qkv for the backward (q, k are copies)

    def remat_output(self, o):
        return self.dense(o)


def _probe_kwargs(module, param):
    """The rotary cos and sin the model computes for its layers and attentions."""
    return rotary_probe_kwargs(module, param, lambda m: getattr(m, "rotary_ndims", None))


register(Family(
    name="gpt_neox",
    attention={"GPTNeoXAttention": _RematGPTNeoXAttention},
    mlps={"GPTNeoXMLP": MLPParts("dense_h_to_4h", "act", "dense_4h_to_h", None)},
    layers={"GPTNeoXLayer": ((("input_layernorm", "attention"), ("post_attention_layernorm", "mlp")),)},
    probe_kwargs=_probe_kwargs,
))
