"""Llama: input_layernorm (LlamaRMSNorm) fused into q/k/v_proj, attention on remat.attention with the
module's own rotary embedding (rotate_half convention) and grouped keys and values (GQA), the gated
MLP (act(gate_proj(x)) * up_proj(x) -> down_proj) fused with post_attention_layernorm in front.

The attention class here is the one of every Llama-like family (Mistral, Qwen2, Qwen3, Phi-3, Gemma):
each family file subclasses it with what its stock forward reads differently."""

from .modules import CACHE_ARGS, MLPParts, _RematGatedMLP, _RematSplitAttention, stock_function
from .registry import Family, register, rotary_probe_kwargs


class _RematRotaryAttention(_RematSplitAttention):
    """q, k, v projections (k and v with num_key_value_heads, GQA), the rotary embedding the model
    passes as position_embeddings (cos, sin), applied by the module's own apply_rotary_pos_emb, the
    module's `scaling`, and o_proj."""

    remat_cache_arg = CACHE_ARGS
    remat_extra_args = ("position_embeddings",)
    remat_output_projection = "o_proj"
    remat_dropout_attr = "attention_dropout"
    remat_qk_norms = False  # Qwen3's, Gemma3's q_norm and k_norm over each head, before the rotary embedding

    # A sliding window (Mistral's, Qwen2's, Gemma2/3's local layers) reaches sdpa and eager attention
    # only through the mask (their attention functions ignore the sliding_window argument): a window
    # shorter than the sequence makes the mask hide more than the future, and that call runs stock.

    @classmethod
    def remat_refuse_reason(cls, module):
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap is not None:
            return f"attention logit softcapping ({softcap}): remat.attention has no softcap"
        if cls.remat_qk_norms and not all(hasattr(module, n) for n in ("q_norm", "k_norm")):
            return "lacks the expected q_norm and k_norm"
        return None

    def remat_qkv(self, outputs, call):
        q, k, v = super().remat_qkv(outputs, call)
        if self.remat_qk_norms:  # over each head's dims, as the stock forward applies them
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = call["position_embeddings"]
        q, k = stock_function(self, "apply_rotary_pos_emb")(q, k, cos, sin)
        return q, k, v


def probe_kwargs(module, param):
    """The rotary cos and sin (head_dim wide) the model computes for its layers and attentions."""
    return rotary_probe_kwargs(module, param, lambda m: getattr(m, "head_dim", None))


WIRING = ((("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),)


def llama_like(name, prefix, attention, style="llama", mlp=None, wiring=WIRING, **fields):
    """The Family of a Llama-like model: <prefix>Attention, <prefix>MLP (gate_proj, up_proj, down_proj
    and act_fn, or `mlp` parts), <prefix>DecoderLayer with its norms feeding self_attn and mlp as
    `wiring` says (input_layernorm and post_attention_layernorm), <prefix>RMSNorm rounded as `style`."""
    return Family(
        name=name,
        attention={f"{prefix}Attention": attention},
        mlps={f"{prefix}MLP": mlp or MLPParts(("gate_proj", "up_proj"), "act_fn", "down_proj", None, _RematGatedMLP)},
        layers={f"{prefix}DecoderLayer": wiring},
        norms={f"{prefix}RMSNorm": style},
        probe_kwargs=probe_kwargs,
        **fields,
    )


class _RematLlamaAttention(_RematRotaryAttention):
    pass


register(llama_like("llama", "Llama", _RematLlamaAttention))
