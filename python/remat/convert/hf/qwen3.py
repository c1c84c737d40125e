"""Qwen3: as Qwen2 (qwen2.py), and q_norm, k_norm (Qwen3RMSNorm over each head's dims) applied to q
and k before the rotary embedding, as stock modules."""

from .llama import _RematRotaryAttention, llama_like
from .registry import register


class _RematQwen3Attention(_RematRotaryAttention):
    remat_qk_norms = True


register(llama_like("qwen3", "Qwen3", _RematQwen3Attention))
