"""Qwen2: as Llama (llama.py), with q/k/v biases. Sliding-window layers (use_sliding_window) run the
stock attention for any call whose window is shorter than the sequence; the norms and MLPs fuse."""

from .llama import _RematRotaryAttention, llama_like
from .registry import register


class _RematQwen2Attention(_RematRotaryAttention):
    pass


register(llama_like("qwen2", "Qwen2", _RematQwen2Attention))
