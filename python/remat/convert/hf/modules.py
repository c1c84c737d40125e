"""The swapped transformers modules: each is the stock instance with a remat class mixed in
(same submodules, parameters and attributes), computing what the stock forward computes on
remat's fused ops, and the stock forward itself for any call those do not compute exactly.

Handoff links a module whose work the next module does (a pre-LN LayerNorm, BERT's intermediate)
to that module; the family files (gpt2.py, vit.py, ...) subclass _RematAttention for their
attention classes.
"""

import collections
import inspect
import sys
import weakref

import torch
from torch import nn

from ..._guards import fallback, hook_reason, plain_reason
from ..._linears import fused_saved_bytes, projections
from ...ops.attention import attention
from ...ops.fused import fused_mlp, norm_linears
from ...specs import gelu, norm_of
from ..patterns import activation_reason, gelu_approximate
from ..swap import strip

# A transformers MLP module: the names of its fc1, activation, fc2 and (or None) dropout after fc2.
MLPParts = collections.namedtuple("MLPParts", "fc1 act fc2 dropout")


# ---------------------------------------------------------------------------------------------
# Handoffs: a module's work done, fused, by the module after it
# ---------------------------------------------------------------------------------------------


class Handoff:
    """Work moved from one module of a layer to the next: the producer at layer.<producer> returns
    its input unchanged, and the consumer at layer.<consumer> does the producer's work inside its
    own fused op (a pre-LN LayerNorm into the q/k/v projection or fc1; BERT's intermediate into
    its output).

    It holds only while both sit in their places in the layer without hooks (checked at every
    call, by both): otherwise the producer runs its own forward and the consumer takes what it
    gets, as stock. The layer is held by a weak reference; a deepcopy of the whole model points
    the copy at the copied layer, while a copy of one of the two modules alone keeps pointing at
    the original layer, where it does not sit, so the copy computes itself.
    """

    def __init__(self, layer, producer, consumer):
        self._layer = weakref.ref(layer)
        self.producer, self.consumer = producer, consumer

    def reason(self):
        """None while the handoff holds, else why not."""
        layer = self._layer()
        if layer is None:
            return "the layer holding it is gone"
        for name in (self.producer, self.consumer):
            module = layer._modules.get(name)
            if module is None or module.__dict__.get("remat_handoff") is not self:
                return f"{name} is no longer the module converted"
            reason = hook_reason(module)
            if reason:
                return f"{name} {reason}"
        return None

    def source(self):
        """The producer module (call only while reason() is None)."""
        return self._layer()._modules[self.producer]

    def __deepcopy__(self, memo):
        layer = self._layer()
        new = Handoff.__new__(Handoff)
        memo[id(self)] = new
        new._layer = weakref.ref(memo.get(id(layer), layer)) if layer is not None else self._layer
        new.producer, new.consumer = self.producer, self.consumer
        return new

    def __reduce__(self):  # pickling a model: the layer itself, which pickle keeps once
        return Handoff, (self._layer(), self.producer, self.consumer)


def _link(layer, producer_name, producer, consumer_name, consumer):
    handoff = Handoff(layer, producer_name, consumer_name)
    producer.__dict__["remat_handoff"] = consumer.__dict__["remat_handoff"] = handoff


def _handed_over(module):
    """(the producer whose work `module` does at this call, or None; why a handoff no longer holds, or None)."""
    handoff = module.__dict__.get("remat_handoff")
    if handoff is None:
        return None, None
    reason = handoff.reason()
    if reason:
        return None, f"{handoff.producer} is not fused any more: {reason}"
    return handoff.source(), None


_REMAT_CLASSES = {}


def remat_class(mixin, stock_class, **attributes):
    """Remat<Stock>(mixin, stock): the class a stock transformers module is swapped to, with the
    class `attributes` its family gives (an MLP's submodule names)."""
    key = (mixin, stock_class, tuple(sorted(attributes.items())))
    cls = _REMAT_CLASSES.get(key)
    if cls is None:
        name = f"Remat{stock_class.__name__}"
        # Read at every call: computed here, once, outside any torch.compile trace.
        fixed = {"remat_stock": stock_class, "remat_signature": inspect.signature(stock_class.forward),
                 "remat_passthrough": _passthrough_kwargs(), **attributes}
        cls = type(name, (mixin, stock_class), {**fixed, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # importable by name, so a converted model pickles
        _REMAT_CLASSES[key] = cls
    return cls


class _RematModule:
    """What every swapped transformers module shares: the probe's trace, fallbacks, revert."""

    remat_fused = True
    remat_stock: type  # the stock class

    def _remat_fallback(self, reason):
        """Record a call that runs stock (or the probe's trace of it)."""
        trace = self.__dict__.get("remat_trace")
        if trace is not None:  # set by the conversion probe only
            trace.append(reason)
        elif reason is not None:
            fallback(self, reason)

    def remat_revert(self):
        return strip(self, self.remat_stock)


class RematFusedLayerNorm(_RematModule, nn.LayerNorm):
    """A pre-LN block's LayerNorm whose consumer (the attention's q/k/v projection or the MLP's
    fc1) applies it, fused: while their handoff holds, forward returns its input. Still an
    nn.LayerNorm with its own weight, bias and eps (same objects, same state_dict keys, found by
    isinstance checks such as weight-decay groups); remat_revert() gives the stock module back."""

    remat_stock = nn.LayerNorm

    def forward(self, hidden_states):
        if self.remat_handoff.reason() is None:
            return hidden_states
        return nn.LayerNorm.forward(self, hidden_states)

    def extra_repr(self):
        return f"{super().extra_repr()}, applied fused by the next projection"


def _layer_norm_reason(norm):
    """Why a RematFusedLayerNorm's parameters cannot be read by a fused op at this call, or None."""
    return plain_reason(norm, (RematFusedLayerNorm,), "the fused LayerNorm")


def _normed_outputs(x, norm, modules, recompute, labels):
    """([module(norm(x)) for each module], None), with the LayerNorm fused into the projections when
    `norm` is given, or (None, why they cannot be fused at this call)."""
    if norm is None:
        return [m(x) for m in modules], None
    linears, reason = projections(modules, labels)
    reason = reason or _layer_norm_reason(norm)
    if reason:
        return None, reason
    return norm_linears(x, norm_of(norm), linears, recompute), None


# ---------------------------------------------------------------------------------------------
# The swapped MLP modules
# ---------------------------------------------------------------------------------------------


class _RematMLP(_RematModule):
    """A transformers MLP module (GPT2MLP, ViTMLP, GPTNeoXMLP, CLIPMLP) on remat.mlp:
    dropout(fc2(gelu(fc1(x)))) keeping x and the fc1 output only, with the LayerNorm before it
    fused in when it was handed over. Any call remat cannot compute runs the stock forward."""

    remat_parts: "MLPParts"  # the stock module's submodule names, given by its family

    def forward(self, hidden_states):
        parts = self.remat_parts
        norm, norm_reason = _handed_over(self)
        linears, reason = projections([self._modules[parts.fc1], self._modules[parts.fc2]], [parts.fc1, parts.fc2])
        reason = reason or activation_reason(self._modules[parts.act], parts.act) \
            or (_layer_norm_reason(norm) if norm is not None else None)
        if reason:
            self._remat_fallback(reason)
            if norm is not None:
                hidden_states = nn.LayerNorm.forward(norm, hidden_states)
            return self.remat_stock.forward(self, hidden_states)
        self._remat_fallback(norm_reason)
        act = gelu(gelu_approximate(self._modules[parts.act]))
        fc1, fc2 = linears
        out = fused_mlp(hidden_states, fc1, act, fc2, norm_of(norm) if norm is not None else None,
                        self.remat_recompute)
        return self._modules[parts.dropout](out) if parts.dropout else out

    def remat_saved_bytes(self):
        """Bytes per token this module keeps less than stock: the GELU output, where fc2 trains."""
        fc2 = self._modules[self.remat_parts.fc2]
        return fused_saved_bytes(fc2=fc2) if self.remat_recompute else 0

    def extra_repr(self):
        return f"on remat.mlp, recompute={self.remat_recompute}"


class _RematIntermediate(_RematModule):
    """BertIntermediate's place in a converted layer (dense + activation): returns its input while its
    handoff to the output holds, the output computing the whole FFN."""

    def forward(self, hidden_states):
        if self.remat_handoff.reason() is None:
            return hidden_states
        return self.remat_stock.forward(self, hidden_states)


class _RematOutput(_RematModule):
    """BertOutput (and RobertaOutput) with the FFN fused in:
    LayerNorm(dropout(dense(gelu(intermediate.dense(x)))) + input_tensor) on remat.mlp."""

    def forward(self, hidden_states, input_tensor):
        intermediate, reason = _handed_over(self)
        if intermediate is None:  # the intermediate computed itself
            self._remat_fallback(reason)
            return self.remat_stock.forward(self, hidden_states, input_tensor)
        linears, reason = projections([intermediate.dense, self.dense], ["intermediate.dense", "dense"])
        act = intermediate.intermediate_act_fn
        reason = reason or activation_reason(act, "intermediate.intermediate_act_fn")
        if reason:
            self._remat_fallback(reason)
            hidden_states = intermediate.remat_stock.forward(intermediate, hidden_states)
            return self.remat_stock.forward(self, hidden_states, input_tensor)
        self._remat_fallback(None)
        fc1, fc2 = linears
        out = fused_mlp(hidden_states, fc1, gelu(gelu_approximate(act)), fc2, recompute=self.remat_recompute)
        return self.LayerNorm(self.dropout(out) + input_tensor)

    def remat_saved_bytes(self):
        return fused_saved_bytes(fc2=self.dense) if self.remat_recompute else 0


# ---------------------------------------------------------------------------------------------
# Attention: the stock classes with a remat path (class swap, same objects inside)
# ---------------------------------------------------------------------------------------------

# The attention implementations whose result is fully determined by q, k, v, the mask, the
# scale and dropout. flash_attention_* and flex_attention also read packing information from the
# call (cu_seq_lens, position_ids) and run the stock forward.
REMAT_IMPLEMENTATIONS = ("sdpa", "eager")

# Arguments of the stock forwards that may have any value without changing what sdpa and eager
# attention compute. transformers passes its TransformersKwargs through every layer (the Trainer's
# num_items_in_batch, position_ids, packing's cu_seq_lens, which only flash attention reads; a
# packed batch reaches sdpa as a block-diagonal mask, which is read); use_cache only says whether
# a cache was made (the cache itself is checked). output_attentions and is_causal are read.
_PASSTHROUGH_KWARGS = frozenset({
    "num_items_in_batch", "output_hidden_states", "output_router_logits", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "position_ids", "seq_idx", "use_cache", "cache_position", "return_dict",
    "output_attentions", "is_causal",
})


def _passthrough_kwargs():
    """_PASSTHROUGH_KWARGS and whatever else this transformers version declares in TransformersKwargs."""
    try:
        from transformers.utils.generic import TransformersKwargs
    except ImportError:
        return _PASSTHROUGH_KWARGS
    return _PASSTHROUGH_KWARGS | frozenset(getattr(TransformersKwargs, "__annotations__", {}))


def split_heads(t, heads, head_dim):
    """(B, S, heads * head_dim) -> (B, heads, S, head_dim), a strided view."""
    return t.unflatten(-1, (heads, head_dim)).transpose(1, 2)


def _merge_heads(o):
    """(B, H, S, D) laid out (B, S, H, D), as remat.attention returns it -> (B, S, H * D), a view:
    the output projection keeps the very storage attention keeps."""
    return o.transpose(1, 2).flatten(2)


def _mask_pattern(mask, seq_q, seq_k):
    """"full" or "causal" when the 4-D mask hides nothing or exactly the future, else None.

    bool masks: True = visible (sdpa). Float masks are added to the scores (eager): 0 = visible,
    and a hidden entry must be -inf or the dtype's minimum, so that its probability is exactly 0.
    One comparison on the device (a synchronisation); HF's sdpa path passes None when there is
    nothing to mask, so unpadded sdpa calls never get here.
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (seq_q, seq_k):
        return None
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        hidden = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        if not bool((visible | hidden).all()):
            return None
    else:
        return None
    if bool(visible.all()):
        return "full"
    causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=mask.device).tril(seq_k - seq_q)
    return "causal" if bool(torch.equal(visible, causal.expand_as(visible))) else None


def _empty_dynamic_cache(cache, layer_idx):
    """True when `cache` is a plain DynamicCache holding nothing yet for this layer (a prefill,
    or training with use_cache=True): its update() then returns the new keys and values as given."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or getattr(cache, "offloading", False) or not isinstance(layer_idx, int):
        return False
    layers = cache.layers
    if layer_idx < len(layers):
        layer_type = type(layers[layer_idx])
    else:
        layer_type = getattr(cache, "layer_class_to_replicate", None)
    return layer_type is DynamicLayer and cache.get_seq_length(layer_idx) == 0


def _attention_weights_requested(module, kwargs):
    """True when this call may be asked for its attention weights (output_attentions)."""
    if kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False):
        return True
    # transformers >= 5 collects the weights with forward hooks while a model-level
    # output_attentions=True call runs; the active collector says whether this one does.
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    if collector is None:
        return module.config._attn_implementation == "eager"  # cannot tell: only eager returns weights
    collected = collector.get()
    return bool(collected) and "attentions" in collected


class _RematAttention(_RematModule):
    """The remat path shared by the swapped attention classes (mixed in before the stock class).

    Subclasses name their q/k/v projections (remat_projections, which read the hidden states,
    the handed-over LayerNorm fused in) and say how to form q, k, v from their outputs and how to
    project the output.
    """

    remat_cache_arg = None  # the stock forward's KV-cache argument
    remat_extra_args = ()  # further stock arguments the remat path reads (rotary cos/sin)
    remat_head_dim_attr = "head_dim"
    remat_projections = ()  # the q/k/v projections, reading the hidden states
    remat_output_projection = None  # the output projection (None: the module has none, as BERT's)

    def forward(self, hidden_states, *args, **kwargs):
        norm, norm_reason = _handed_over(self)
        call = self._remat_bind(hidden_states, args, kwargs)
        reason = self.remat_fallback_reason(hidden_states, call)
        if reason is None:
            modules = [self._modules[n] for n in self.remat_projections]
            outputs, reason = _normed_outputs(hidden_states, norm, modules, self.remat_recompute,
                                              self.remat_projections)
        if reason is not None:
            self._remat_fallback(reason)
            if norm is not None:
                hidden_states = nn.LayerNorm.forward(norm, hidden_states)
            return self.remat_stock.forward(self, hidden_states, *args, **kwargs)
        self._remat_fallback(norm_reason)
        return self.remat_forward(outputs, call, self.remat_causal(call, hidden_states.shape[1]))

    def _remat_bind(self, hidden_states, args, kwargs):
        """The call's arguments by the stock forward's names (**kwargs merged in), or None when
        they do not bind."""
        signature = self.remat_signature
        try:
            bound = signature.bind(self, hidden_states, *args, **kwargs)
        except TypeError:
            return None  # e.g. a deprecated argument name that the stock forward's wrapper renames
        arguments = dict(bound.arguments)
        for name in list(signature.parameters)[:2]:  # self, hidden_states
            arguments.pop(name, None)
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        return arguments

    def remat_fallback_reason(self, hidden_states, call):
        """None when remat.attention computes this call exactly, else why the stock forward runs."""
        if call is None:
            return "arguments the stock forward renames or rejects"
        if hidden_states.dim() != 3:
            return "input is not (batch, seq, hidden)"
        if self.config._attn_implementation not in REMAT_IMPLEMENTATIONS:
            return f"attention implementation {self.config._attn_implementation!r}"
        if self.training and self.remat_dropout() > 0:
            return "attention dropout in training"
        if _attention_weights_requested(self, call):
            return "attention weights requested (output_attentions)"
        cache = call.get(self.remat_cache_arg) if self.remat_cache_arg else None
        if cache is not None and not _empty_dynamic_cache(cache, getattr(self, "layer_idx", None)):
            return "a KV cache with past keys, or not a plain DynamicCache"
        known = {"attention_mask", self.remat_cache_arg, *self.remat_extra_args, *self.remat_passthrough}
        others = [name for name, value in call.items()
                  if name not in known and value is not None and value is not False]
        if others:
            return f"arguments that change the attention: {', '.join(sorted(others))}"
        mask = call.get("attention_mask")
        if mask is not None and torch.compiler.is_compiling():
            return "a materialised mask under torch.compile (reading it would break the graph)"
        if mask is not None:  # last: the pattern check synchronises with the device
            pattern = _mask_pattern(mask, hidden_states.shape[1], hidden_states.shape[1])
            if pattern is None:
                return "an attention mask that hides more than the future (padding)"
            call["remat_mask_pattern"] = pattern  # read by remat_causal: one check per call
        return None

    def remat_causal(self, call, seq):
        """Whether this call is causal: by the mask's pattern, or without a mask, as the
        implementation reads none (sdpa: the call's is_causal, else the module's; eager: nothing
        is masked)."""
        if call.get("attention_mask") is not None:
            pattern = call.get("remat_mask_pattern") or _mask_pattern(call["attention_mask"], seq, seq)
            return pattern == "causal"
        if self.config._attn_implementation != "sdpa":
            return False
        is_causal = call.get("is_causal")
        return bool(self.is_causal if is_causal is None else is_causal)

    def remat_forward(self, outputs, call, causal):
        """(output, None) by remat.attention; the caller has checked remat_fallback_reason."""
        q, k, v = self.remat_qkv(outputs, call)
        cache = call.get(self.remat_cache_arg) if self.remat_cache_arg else None
        if cache is not None:  # empty: update() stores and returns these very keys and values
            k, v = cache.update(k, v, self.layer_idx)
        o = attention(q, k, v, causal=causal, softmax_scale=float(self.scaling))
        return self.remat_output(_merge_heads(o)), None

    def remat_saved_bytes(self):
        """Bytes per token kept less than stock by the attention itself: none against SDPA's flash
        and efficient kernels, which keep what remat.attention keeps (q, k, v, output, lse)."""
        return 0

    def extra_repr(self):
        return f"{self.remat_stock.__name__} on remat.attention"
