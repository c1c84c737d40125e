"""Gemma (1): as Llama (llama.py), with GemmaRMSNorm (x̂ · (1 + w), in fp32: the "gemma" style) and
the GELU (tanh) gated MLP."""

from .llama import _RematRotaryAttention, llama_like
from .registry import register


class _RematGemmaAttention(_RematRotaryAttention):
    pass


register(llama_like("gemma", "Gemma", _RematGemmaAttention, style="gemma"))
