"""BLOOM's attention, the one attention remat swaps by its class: BLOOM hands it an ALiBi bias as a
tensor and a materialised mask, which no structure says how to read. The rest of a BLOOM block is
converted by structure, as any family's: input_layernorm fused into query_key_value, and the MLP
BloomMLP holds (dense_h_to_4h -> BloomGelu -> dense_4h_to_h, then dropout_add with the residual)
fused with post_attention_layernorm in front. apply_residual_connection_post_layernorm=True makes
the LayerNorms' outputs the residuals too: the structure then leaves them stock (the MLP still fuses).

BLOOM's ALiBi adds slope_h · j (key position j) to the scores, relying on softmax's invariance to a
constant per row: under its causal mask that is remat.attention's -slope_h · (i - j), FlashAttention's
convention. The model passes the bias, (batch · heads, 1, seq) in the model's dtype: each call checks
that it is the slopes times the key positions, the slopes read from a key at position 1. A padded
batch restarts the positions at each sequence's first real token: the same bias, per sequence, as
remat.attention_varlen's ALiBi on the real tokens. remat adds the bias in fp32, where the stock
forward adds it rounded to the model's dtype (in bf16 exact up to key position 256)."""

import inspect
import sys

import torch
from torch import nn

from ..._guards import EXCLUDED, from_transformers
from ..._linears import base_layer
from ...ops.attention import HEAD_DIMS, attention
from ..swap import join
from .interface import attention_weights_requested
from .masks import Packing, causal_pattern, packed_attention
from .modules import _RematModule, stock_function
from .probe import self_probe
from .rules import _instance_reason, _swapped

# The stock forward's parameters, in order: the remat forward takes the same (checked at convert time).
FORWARD = ("self", "hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache",
           "output_attentions", "kwargs")
# Arguments that may have any value without changing what the stock forward computes: transformers'
# TransformersKwargs, passed through its models' layers (the Trainer's num_items_in_batch, ...).
_PASSTHROUGH = frozenset({"num_items_in_batch", "output_hidden_states", "position_ids", "cache_position",
                          "return_dict"})


def _passthrough():
    """_PASSTHROUGH and whatever else this transformers version declares in TransformersKwargs."""
    from transformers.utils.generic import TransformersKwargs

    return _PASSTHROUGH | frozenset(getattr(TransformersKwargs, "__annotations__", {}))


def _empty_cache(cache, layer_idx):
    """True when `cache` (dynamic, static, ...) holds nothing yet for this layer: a prefill, or
    training with use_cache=True. The keys this call attends to are then exactly its own, whatever
    the cache's update() returns; False when that cannot be told without reading the device (a
    static layer's length is a tensor) while torch.compile traces."""
    layers = getattr(cache, "layers", None)
    if layers is None or not isinstance(layer_idx, int):
        return False
    if layer_idx >= len(layers):  # created by its first update
        return getattr(cache, "layer_class_to_replicate", None) is not None
    layer = layers[layer_idx]
    if not getattr(layer, "is_initialized", True):
        return True
    length = layer.get_seq_length()
    if isinstance(length, torch.Tensor):
        return not torch.compiler.is_compiling() and int(length) == 0
    return length == 0


class _RematBloomAttention(_RematModule):
    """BloomAttention(hidden_states, residual, alibi, attention_mask, layer_past, ...) on remat.attention:
    q, k, v from query_key_value (heads interleaved: (batch, seq, heads, 3, head_dim); input_layernorm
    applied inside it where the structure fused it there); causal remat.attention with the ALiBi slopes
    (attention_varlen on the real tokens of a padded or packed batch) and the training dropout (remat's own Philox mask:
    the distribution of the stock dropout, not its draws); dense, and dropout_add with the residual, as
    the stock forward. Any call it does not compute exactly runs the stock forward, with the reason."""

    def __init_subclass__(cls, **kwargs):  # the class made at convert time (remat_class), outside any trace
        super().__init_subclass__(**kwargs)
        cls.remat_passthrough = _passthrough()

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        reason, pattern, slopes = self._remat_call(hidden_states, residual, alibi, attention_mask, layer_past,
                                                   output_attentions, kwargs)
        self._remat_fallback(reason)
        if reason is not None:
            return self.remat_stock.forward(self, hidden_states, residual, alibi, attention_mask, layer_past,
                                            use_cache, output_attentions, **kwargs)
        batch, seq, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(batch, seq, self.num_heads, 3, self.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        if layer_past is not None:  # empty (_remat_call): filled as the stock forward fills it; the
            layer_past.update(k, v, self.layer_idx)  # keys attended to are this call's own
        features = {"alibi_slopes": slopes}
        if self.training and self.attention_dropout.p > 0:
            features["dropout_p"] = float(self.attention_dropout.p)
        scale = float(self.inv_norm_factor)
        if isinstance(pattern, Packing):
            out = packed_attention(q, k, v, pattern, scale, self.dense, features)
        else:  # o: (B, H, S, D) laid out (B, S, H, D): dense keeps the very storage attention keeps
            o = attention(q, k, v, causal=True, softmax_scale=scale, **features)
            out = self.dense(o.transpose(1, 2).flatten(2))
        return stock_function(self, "dropout_add")(out, residual, self.hidden_dropout, self.training), None

    def _remat_call(self, hidden_states, residual, alibi, mask, cache, output_attentions, kwargs):
        """(None, the mask's pattern, the ALiBi slopes) when remat computes this call exactly, else
        (why not, None, None)."""
        reason, pattern = self._remat_reason(hidden_states, residual, alibi, mask, cache, output_attentions, kwargs)
        if reason:
            return reason, None, None
        batch, seq = hidden_states.shape[:2]
        positions = _key_positions(pattern, batch, seq) if isinstance(pattern, Packing) else None
        slopes = _alibi_slopes(alibi, batch, self.num_heads, seq, positions)
        if slopes is None:
            return "an ALiBi bias other than the slopes times the key positions", None, None
        return None, pattern, slopes

    def _remat_reason(self, hidden_states, residual, alibi, mask, cache, output_attentions, kwargs):
        """(None, the mask's pattern) when remat.attention takes this call, else (why not, None)."""
        if self.pretraining_tp > 1 and self.slow_but_exact:
            return "pretraining_tp > 1 with slow_but_exact: the stock forward sums dense in slices", None
        if hidden_states.dim() != 3:
            return "input is not (batch, seq, hidden)", None
        if residual is None or alibi is None:
            return "no residual or alibi", None
        others = sorted(n for n, value in kwargs.items() if n not in self.remat_passthrough
                        and value is not None and value is not False)
        if others:
            return f"arguments that change the attention: {', '.join(others)}", None
        if attention_weights_requested(self, {"output_attentions": output_attentions}, "eager"):
            return "attention weights requested (output_attentions)", None
        if cache is not None and not _empty_cache(cache, self.layer_idx):
            return "a KV cache with past keys (decoding)", None
        if mask is None:
            return "no mask: BLOOM's ALiBi bias equals remat.attention's under a causal mask only", None
        if mask.is_meta:  # no values to read (remat memory, remat.plan on meta): counted as an unpadded batch's
            return None, "causal"
        if torch.compiler.is_compiling():
            return "a materialised mask under torch.compile (reading it would break the graph)", None
        pattern = causal_pattern(mask, hidden_states.shape[1])  # last: it synchronises with the device
        if pattern is None:
            return ("an attention mask that is no causal mask of padded or packed sequences (BLOOM's ALiBi bias "
                    "equals remat.attention's under a causal mask only)"), None
        return None, pattern

    def extra_repr(self):
        return "BloomAttention on remat.attention"


def _key_positions(packing, batch, seq):
    """(batch, seq) fp32: each kept key's position in its sequence, 0 for the others, as the stock
    model's positions (the attention mask's cumulative sum less one, times the mask) give them."""
    lengths = packing.cu_seqlens[1:] - packing.cu_seqlens[:-1]
    starts = torch.repeat_interleave(packing.cu_seqlens[:-1], lengths)
    within = torch.arange(starts.numel(), device=starts.device) - starts
    positions = torch.zeros(batch, seq, device=starts.device)
    return positions.index_put(packing.rows, within.float())


def _alibi_slopes(alibi, batch, heads, seq, positions=None):
    """The fp32 slopes (heads,) when the bias `alibi` (batch · heads, 1, seq) is slope_h · p_j for the
    key positions p (batch, seq) in every row (default: p_j = j), as rounded to its dtype; else None.
    The slopes are read where a key's position is 1. One comparison on the device."""
    if not isinstance(alibi, torch.Tensor) or tuple(alibi.shape) != (batch * heads, 1, seq):
        return None
    bias = alibi.view(batch, heads, seq)
    if positions is None:
        positions = torch.arange(seq, device=alibi.device, dtype=torch.float32).expand(batch, seq)
    ones = (positions == 1).nonzero()
    if ones.shape[0] == 0:  # no sequence of two tokens: any slopes give every key the same bias
        slopes = torch.zeros(heads, device=alibi.device)
    else:
        slopes = bias[ones[0, 0], :, ones[0, 1]].float().contiguous()
    expected = (slopes[None, :, None] * positions[:, None, :]).to(alibi.dtype)
    return slopes if bool(torch.equal(bias, expected)) else None


def is_bloom_attention(module):
    """Whether `module` is transformers' BloomAttention (the class this file swaps)."""
    return type(module).__name__ == "BloomAttention" and from_transformers(type(module))


# The stock module's attributes the remat forward reads.
_ATTRIBUTES = ("head_dim", "inv_norm_factor", "query_key_value", "dense", "num_heads", "beta", "pretraining_tp",
               "slow_but_exact", "hidden_dropout", "attention_dropout", "layer_idx")


def swap_reason(module):
    """Why the BloomAttention `module` cannot be swapped to _RematBloomAttention, or None (convert time)."""
    missing = [name for name in _ATTRIBUTES if not hasattr(module, name)]
    if missing:
        return f"lacks the expected attributes {', '.join(missing)}"
    if not isinstance(base_layer(module.query_key_value), nn.Linear):  # its norm fused in: a subclass
        return "its query_key_value is not an nn.Linear (or peft's LoRA around one)"
    if module.head_dim not in HEAD_DIMS:
        return f"head dim {module.head_dim} is not one of remat's kernel head dims {HEAD_DIMS}"
    parameters = tuple(inspect.signature(type(module).forward).parameters)
    if parameters != FORWARD:
        return f"its forward takes ({', '.join(parameters)}), not ({', '.join(FORWARD)}): this transformers " \
               "version differs"
    if module.beta != 1.0:
        return f"beta={module.beta}: the stock forward scales its ALiBi bias"
    return None


def probe_kwargs(module, param):
    """What a probe call of the BloomAttention `module` needs besides its input: the model's own ALiBi bias
    and causal mask over (2, 3) tokens (a random bias would run the attention stock), and a residual."""
    alibi = sys.modules[type(module).__module__].build_alibi_tensor(
        torch.ones(2, 3, device=param.device), module.num_heads, param.dtype)
    hidden = torch.full((3, 3), torch.finfo(param.dtype).min, device=param.device, dtype=param.dtype)
    residual = torch.randn(2, 3, module.dense.out_features, generator=torch.Generator().manual_seed(2))
    return {"alibi": alibi, "attention_mask": hidden.triu(1)[None, None].expand(2, 1, 3, 3),
            "residual": residual.to(param.device, param.dtype)}


# ---------------------------------------------------------------------------------------------
# BLOOM's plan: its attention swapped by class
# ---------------------------------------------------------------------------------------------


def swap_attention(model, path, report, options, attention_modules):
    """Swap each BloomAttention of the Hugging Face `model` (at `path`) to _RematBloomAttention, after the
    rules by structure (its query_key_value may have taken input_layernorm in), each checked by a probe call;
    a row each, swapped or skipped. attention_modules: (path, module) of the attention modules convert
    leaves as they are (interface.convert_attention gives each a row); those this reports leave it. Modules
    convert's filter_fn rejects are left to the row convert gives them."""
    found = [(parent, name, child, join(path, join(parent_path, name)))
             for parent_path, parent in model.named_modules() for name, child in parent._modules.items()
             if child is not None and is_bloom_attention(child) and EXCLUDED not in vars(child)]
    for parent, name, module, module_path in found:
        reason = _instance_reason(module) or swap_reason(module)
        if reason is None:
            new = _swapped(module, _RematBloomAttention, options, module_path)
            weight = base_layer(module.query_key_value).weight
            extra = {} if weight.is_meta else probe_kwargs(module, weight)
            reason = self_probe(module, new, weight.shape[1], weight, extra)
        if reason:
            report.add(module_path, module, "skipped", reason)
            continue
        parent._modules[name] = new
        # saves nothing per token by the attention itself: SDPA's flash and efficient kernels keep what
        # remat.attention keeps (q, k, v, output, lse)
        report.add(module_path, module, f"swapped to {type(new).__name__}",
                   "remat.attention with its ALiBi slopes (attention_varlen for padding and packed sequences); the "
                   "stock forward for other masks, KV caches with past keys, attention weights", lambda: 0)
    reported = {id(module) for _, _, module, _ in found}
    attention_modules[:] = [(p, m) for p, m in attention_modules if id(m) not in reported]
