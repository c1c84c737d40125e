"""GPT-NeoX / Pythia: attention on remat.attention (rotary embedding included, on a partial head dim
too) with input_layernorm fused into query_key_value, the MLP fused with post_attention_layernorm
in front."""

import inspect

import torch

from .modules import MLPParts, _RematAttention
from .registry import Family, register


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

    def remat_fallback_reason(self, hidden_states, call):
        if call is not None and call.get("position_embeddings") is None:
            return "no position_embeddings (rotary cos, sin)"
        return super().remat_fallback_reason(hidden_states, call)

    def remat_qkv(self, outputs, call):
        (qkv,) = outputs
        # GPT-NeoX packs q, k, v per head: (B, S, H, 3 * D)
        qkv = qkv.unflatten(-1, (-1, 3 * self.head_size)).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        cos, sin = call["position_embeddings"]
        q, k = _rotary(q, k, cos, sin)
        return q, k, v

    def remat_output(self, o):
        return self.dense(o)


def _probe_kwargs(module, param):
    """The rotary cos and sin the model computes for its layers and attentions: random angles check
    the rotation for any of them."""
    attention = module if hasattr(module, "rotary_ndims") else getattr(module, "attention", None)
    dims = getattr(attention, "rotary_ndims", None)
    if "position_embeddings" not in inspect.signature(module.forward).parameters or dims is None:
        return {}
    angles = torch.randn(2, 3, dims, generator=torch.Generator().manual_seed(1)).to(param.device, param.dtype)
    return {"position_embeddings": (angles.cos(), angles.sin())}


register(Family(
    name="gpt_neox",
    attention={"GPTNeoXAttention": _RematGPTNeoXAttention},
    mlps={"GPTNeoXMLP": MLPParts("dense_h_to_4h", "act", "dense_4h_to_h", None)},
    layers={"GPTNeoXLayer": (("input_layernorm", "attention"), ("post_attention_layernorm", "mlp"))},
    probe_kwargs=_probe_kwargs,
))
