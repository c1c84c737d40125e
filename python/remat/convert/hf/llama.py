"""Llama: input_layernorm (LlamaRMSNorm) fused into q/k/v_proj, attention on remat.attention with the
module's own rotary embedding (rotate_half convention) and grouped keys and values (GQA), the gated
MLP (act(gate_proj(x)) * up_proj(x) -> down_proj) fused with post_attention_layernorm in front.

The attention class here is the one of every Llama-like family (Mistral, Qwen2, Qwen3, Phi-3, Gemma):
each family file subclasses it with what its stock forward reads differently."""

import inspect

from .modules import CACHE_ARGS, MLPParts, _RematGatedMLP, _RematSplitAttention, stock_function
from .registry import Family, register, rotary_probe_kwargs


class _RematRotaryAttention(_RematSplitAttention):
    """q, k, v projections (k and v with num_key_value_heads, GQA), the rotary embedding the model
    passes as position_embeddings (cos, sin), applied by the module's own apply_rotary_pos_emb, the
    module's `scaling`, and o_proj.

    A sliding window (its mask: the future and the keys a window back hidden), Gemma2's logit
    softcapping and dropout run on remat.attention's window_size, softcap and dropout_p; padding and
    packed sequences on remat.attention_varlen (masks.py). A call remat does not compute (another mask,
    attention weights requested, a KV cache with past keys) keeps the fused norm and
    projections and runs the stock forward's cache update and attention function on their q, k, v."""

    remat_cache_arg = CACHE_ARGS
    remat_stock_core = True
    remat_extra_args = ("position_embeddings",)
    remat_output_projection = "o_proj"
    remat_dropout_attr = "attention_dropout"
    remat_qk_norms = False  # Qwen3's, Gemma3's q_norm and k_norm over each head, before the rotary embedding

    # A sliding window (Mistral's, Qwen2's, Gemma2/3's local layers) reaches sdpa and eager attention
    # only through the mask (their attention functions ignore the sliding_window argument): a window
    # shorter than the sequence makes the mask hide the keys more than sliding_window - 1 before each
    # query too (transformers' sliding_window_overlay), which remat_windows lets the mask check find.

    @classmethod
    def remat_refuse_reason(cls, module):
        if cls.remat_qk_norms and not all(hasattr(module, n) for n in ("q_norm", "k_norm")):
            return "lacks the expected q_norm and k_norm"
        return None

    def remat_constant_core_reason(self):
        softcap = getattr(self, "attn_logit_softcapping", None)
        implementation = self.config._attn_implementation
        if softcap is not None and implementation != "eager":  # stock sdpa raises on a softcap: so does this
            return f"attention logit softcapping ({softcap}) with the {implementation!r} implementation"
        return None

    def remat_windows(self):
        # the module's window (Qwen2's, Gemma2/3's sliding layers), else the config's (Mistral's, Phi-3's)
        windows = {getattr(self, "sliding_window", None), getattr(self.config, "sliding_window", None)}
        return tuple(w - 1 for w in windows if isinstance(w, int) and w > 0)

    def remat_features(self, call):
        features = super().remat_features(call)
        softcap = getattr(self, "attn_logit_softcapping", None)
        if softcap is not None:  # eager attention's: tanh on the scaled scores before the mask
            features["softcap"] = float(softcap)
        return features

    def remat_stock_attention(self, outputs, call):
        """The stock forward after its projections: the rotary embedding, the cache's update,
        transformers' attention function for the config's implementation with the stock forward's
        arguments, and o_proj."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        q, k, v = self.remat_qkv(outputs, call)
        named = {n for n, p in self.remat_signature.parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        kwargs = {n: value for n, value in call.items() if n not in named and not n.startswith("remat_")}
        cache = self._remat_cache(call)
        if cache is not None:  # the stock forward's **kwargs go to the update too (transformers 5.17 passed
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # none; every cache ignores them)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          stock_function(self, "eager_attention_forward"))
        o, weights = interface(self, q, k, v, call.get("attention_mask"),
                               dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                               **kwargs, **self._remat_family_arguments())
        return self.remat_output(o.reshape(*o.shape[:2], -1).contiguous()), weights

    def _remat_family_arguments(self):
        """What the family's stock forward passes its attention function besides dropout and scaling:
        the sliding window (the module's, else the config's; Llama and Gemma pass none; sdpa and
        eager read the window from the mask only) and Gemma2's softcap."""
        arguments = {}
        if hasattr(self, "sliding_window") or hasattr(self.config, "sliding_window"):
            arguments["sliding_window"] = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
        if hasattr(self, "attn_logit_softcapping"):
            arguments["softcap"] = self.attn_logit_softcapping
        return arguments

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
