"""Mistral: as Llama (llama.py). A sliding window shorter than the sequence runs the stock attention
function for that call (its mask hides more than the future), on the fused norm and projections."""

from .llama import _RematRotaryAttention, llama_like
from .registry import register


class _RematMistralAttention(_RematRotaryAttention):
    pass


register(llama_like("mistral", "Mistral", _RematMistralAttention))
