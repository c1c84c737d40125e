"""Mistral: as Llama (llama.py); its sliding window (config.sliding_window) runs on remat.attention's
window_size."""

from .llama import _RematRotaryAttention, llama_like
from .registry import register


class _RematMistralAttention(_RematRotaryAttention):
    pass


register(llama_like("mistral", "Mistral", _RematMistralAttention))
