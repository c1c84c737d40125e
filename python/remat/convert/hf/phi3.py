"""Phi-3: as Llama (llama.py) with the q/k/v projections fused in one qkv_proj (q, then k, then v,
k and v of num_key_value_heads) and the gate and up projections in one gate_up_proj (gate first);
its rotary embedding may cover part of each head (its own apply_rotary_pos_emb)."""

from .llama import _RematRotaryAttention, llama_like
from .modules import MLPParts, _RematGatedMLP
from .registry import register


class _RematPhi3Attention(_RematRotaryAttention):
    remat_projections = ("qkv_proj",)

    def remat_qkv(self, outputs, call):
        (qkv,) = outputs
        heads, kv_heads = self.config.num_attention_heads, self.num_key_value_heads
        q, k, v = qkv.split([heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim], dim=-1)
        q, k, v = super().remat_qkv([q, k, v], call)
        return q, k, v.contiguous()  # as a view, v would keep all of qkv for the backward (q, k are copies)


register(llama_like("phi3", "Phi3", _RematPhi3Attention,
                    mlp=MLPParts("gate_up_proj", "activation_fn", "down_proj", None, _RematGatedMLP)))
