"""Gemma2: GemmaRMSNorm-style norms around each block (post_attention_layernorm and
post_feedforward_layernorm normalise the block outputs before the residual add: they stay stock),
input_layernorm fused into q/k/v_proj, pre_feedforward_layernorm into the gated MLP. The attention
runs on remat.attention, scaled by query_pre_attn_scalar, with its logit softcapping (the default,
50.0) as remat.attention's softcap and its sliding layers' window as window_size."""

from .llama import _RematRotaryAttention, llama_like
from .registry import register

WIRING = ((("input_layernorm", "self_attn"), ("pre_feedforward_layernorm", "mlp")),)


class _RematGemma2Attention(_RematRotaryAttention):
    pass


register(llama_like("gemma2", "Gemma2", _RematGemma2Attention, style="gemma", wiring=WIRING))
