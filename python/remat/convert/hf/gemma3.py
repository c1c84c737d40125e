"""Gemma3 (text, Gemma3ForCausalLM): as Gemma2 (gemma2.py), with q_norm and k_norm (Gemma3RMSNorm over
each head's dims) before the rotary embedding, and its local (sliding-window) layers on
remat.attention's window_size."""

from .gemma2 import WIRING
from .llama import _RematRotaryAttention, llama_like
from .registry import register


class _RematGemma3Attention(_RematRotaryAttention):
    remat_qk_norms = True


register(llama_like("gemma3", "Gemma3", _RematGemma3Attention, style="gemma", wiring=WIRING))
