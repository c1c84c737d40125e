"""Qwen2: as Llama (llama.py), with q/k/v biases. Sliding-window layers (use_sliding_window) run on
remat.attention's window_size."""

from .llama import _RematRotaryAttention, llama_like
from .registry import register


class _RematQwen2Attention(_RematRotaryAttention):
    pass


register(llama_like("qwen2", "Qwen2", _RematQwen2Attention))
