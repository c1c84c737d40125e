"""Hugging Face transformers support for remat.convert (tested with transformers 5.24).

remat.convert applies these rules, besides the generic ones (every other nn.LayerNorm becomes
remat.nn.LayerNorm), when the model is a transformers PreTrainedModel (a peft model is converted
through the transformers model it wraps). Class swaps only: no forward function of a transformers
class is patched; a swapped module is the stock instance with a remat subclass of its class, so
it holds the very submodules and parameters of the original (same state_dict keys, in the same
order) and isinstance checks still hold.

    family           swapped (class -> remat class)                  LayerNorms fused (pre-LN)
    GPT-2            GPT2Attention -> RematGPT2Attention             ln_1 into c_attn
                     GPT2MLP -> RematGPT2MLP                         ln_2 into c_fc
    ViT              ViTAttention -> RematViTAttention               layernorm_before into q/k/v_proj
                     ViTMLP -> RematViTMLP                           layernorm_after into fc1
    GPT-NeoX/Pythia  GPTNeoXAttention -> RematGPTNeoXAttention       input_layernorm into
                       (rotary embedding included)                     query_key_value
                     GPTNeoXMLP -> RematGPTNeoXMLP                   post_attention_layernorm into
                                                                       dense_h_to_4h
    BERT, RoBERTa    Bert/RobertaSelfAttention ->                    none: post-LN, the LayerNorm
                       RematBert/RobertaSelfAttention                  follows the residual add
                     Bert/RobertaIntermediate -> Remat...Intermediate (returns its input),
                     Bert/RobertaOutput -> Remat...Output (the FFN, fused)
    CLIP             CLIPMLP -> RematCLIPMLP, with a GELU only       none
                       (CLIP's default quick_gelu is not one)

Memory (design.md §1), per layer and token, in bytes of the activation dtype: the fused MLPs keep
the fc1 output, never the GELU output (ffn less); a fused pre-LN LayerNorm keeps its input x and
fp32 mean/rstd, never its output, because the projection(s) after it rebuild LN(x) for their
weight gradients (hidden less per LayerNorm, two per pre-LN layer; ViT's three q/k/v Linears read
one LayerNorm computed once). Each saving holds only where the weight whose gradient needs the
tensor is trained (a frozen Linear keeps no input in stock PyTorch either): the report computes
them under the model's requires_grad at the time it is printed. remat.attention keeps q, k, v,
the output and an fp32 log-sum-exp per row, as SDPA's flash and efficient kernels do, and lays its
output out as (batch, seq, heads, head_dim), so the out-projection keeps that same storage (stock
SDPA's output takes q's layout on some backends, CPU, and transformers' .contiguous() then copies
it: GPT-NeoX on CPU keeps hidden more in stock).

LoRA (peft). Projections wrapped by peft's LoRA layers (before or after convert) run inside the
fused ops: base + Σ B(A(x))·scale, in peft's order and dtypes, keeping only each adapter's rank-r
A(x) besides what the fused op keeps anyway; A's gradient gets the rebuilt input. Each LoRA layer
is checked once against its own forward. A LoRA variant (DoRA, ...), LoRA dropout in training,
or a wrapper remat does not know runs the module's own forward for that call.

Every fused path checks at each call that the modules it computes are still the plain ones fused
(exact classes, no hooks or parametrizations, plain tensors as weights); where one is not, that
call runs the modules' own forwards, with a RematFallbackWarning once per module and reason
(counts: ConversionReport.fallbacks()). The same holds for the calls the remat path does not
compute exactly; the attention classes run the stock forward (with the fused LayerNorm applied
first) when:

- config._attn_implementation is not "sdpa" or "eager" (flash_attention_* and flex_attention read
  packing information from the call);
- attention weights are requested (output_attentions by argument, by config, or by transformers'
  output collector for a model-level output_attentions=True call);
- dropout is in effect (training with an attention dropout above 0);
- a KV cache holds past keys, or is not a plain DynamicCache (an empty one, as in a prefill or in
  training with use_cache=True, stays on remat: its update() returns the new keys as given);
- the mask is neither none nor plain: a 4-D mask must be exactly all-visible or exactly causal
  (bool True = visible, or float with 0 = visible and -inf or the dtype's minimum = hidden); the
  check compares on the device (one synchronisation per layer) and only runs for materialised
  masks (eager, or padding); any padding makes the mask neither;
- an argument that changes the math has a value (cross-attention's encoder_hidden_states, a
  position bias, softcap, sliding windows, ...). The keyword arguments transformers passes through
  every layer (TransformersKwargs: num_items_in_batch from the Trainer, position_ids, cu_seq_lens,
  output_hidden_states, ...), which sdpa and eager attention ignore, stay on remat; is_causal is
  honoured as sdpa honours it;
- the input is not (batch, seq, hidden), or the arguments do not bind to the stock forward's
  signature (a deprecated name it renames).

Not swapped: cross-attention (GPT-2's crossattention, BertCrossAttention), head dims outside
remat's kernel head dims (remat.ops.attention.HEAD_DIMS), modules whose forward was replaced on
the instance, and classes without a rule (the report says "no remat rule").

LayerNorm fusion. A fused LayerNorm becomes RematFusedLayerNorm: still an nn.LayerNorm with its
own weight, bias and eps (same keys), whose forward returns its input while the module after it
applies it inside the fused op (a Handoff between the two, checked by both at every call: each
must still sit in its place in the layer without hooks; otherwise the LayerNorm computes itself
and the next module takes its output, as stock). Only exact nn.LayerNorms over the last dimension
with affine parameters (and a bias, for the MLP) are fused.

GELU variants accepted: GELUActivation (erf), nn.GELU, GELUTanh/PytorchGELUTanh,
NewGELUActivation and FastGELUActivation (the tanh approximation, FastGELU's constant rounded
at 1e-10). Not: QuickGELU, clipped or other activations. Dropout after fc2 (GPT-2) and after
the attention's out-projection is torch's nn.Dropout exactly as the original, so training with
those dropouts stays equivalent (same random stream).

Every rule is checked when it is applied: the original and the swapped modules run on one small
random input (eval mode, a private generator, no autograd) and must agree, the remat path must be
what ran, and a fused LayerNorm is checked by running the whole layer, which also proves its
output feeds nothing else. A mismatch (a transformers version whose forward differs) leaves the
modules alone and says so in the report. Models on the meta device are not probed.

remat.revert gives the stock classes back (same objects inside).
"""

import collections
import contextlib
import inspect
import sys
import weakref

import torch
from torch import nn

from ._guards import fallback, hook_reason, tensor_reason
from ._linears import fused_saved_bytes, projection, widths
from .convert import _join, _with_class, layer_norm_fusable, uniform_reason
from .convert import gelu_approximate as _generic_gelu_approximate
from .ops.attention import HEAD_DIMS, attention
from .ops.fused import layer_norm_linears, mlp

TESTED_TRANSFORMERS = ">=5.24,<6"

# A transformers MLP module: the names of its fc1, activation, fc2 and (or None) dropout after fc2.
MLPParts = collections.namedtuple("MLPParts", "fc1 act fc2 dropout")
MLP_RULES = {
    "GPT2MLP": MLPParts("c_fc", "act", "c_proj", "dropout"),
    "ViTMLP": MLPParts("fc1", "activation_fn", "fc2", None),
    "GPTNeoXMLP": MLPParts("dense_h_to_4h", "act", "dense_4h_to_h", None),
    "CLIPMLP": MLPParts("fc1", "activation_fn", "fc2", None),
}

# FFNs split over two siblings: layer class -> (intermediate attr and class, output attr and class)
PAIR_RULES = {
    "BertLayer": ("intermediate", "BertIntermediate", "output", "BertOutput"),
    "RobertaLayer": ("intermediate", "RobertaIntermediate", "output", "RobertaOutput"),
}

ATTENTION_SUFFIXES = ("Attention",)

_TANH_ACTIVATIONS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")


def _from_transformers(module):
    return type(module).__module__.startswith("transformers.")


def is_hf_model(model):
    """True when `model` is a transformers PreTrainedModel (transformers not imported: False)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def activation_approximate(module):
    """"none" or "tanh" for transformers' GELU activation modules remat computes, else None."""
    if not _from_transformers(module):
        return None
    name = type(module).__name__
    if name == "GELUActivation":
        return "none"  # F.gelu or its erf formula in Python
    if name in _TANH_ACTIVATIONS:
        return "tanh"
    return None


def _gelu(module):
    return _generic_gelu_approximate(module) if isinstance(module, nn.Module) else None


def _activation_reason(act, label="activation"):
    """Why the activation module `act` is not a GELU the fused MLP computes in its place, or None."""
    if _gelu(act) is None:
        return f"{label} {type(act).__name__} is not a GELU remat computes (exact or tanh)"
    reason = hook_reason(act)
    return f"{label} {reason}" if reason else None


def _mlp_reason(fc1, act, fc2):
    """None when fc1 -> act -> fc2 is remat.mlp (fc1 and fc2 Linear-like, peft's LoRA included), else why not."""
    for name, fc in (("fc1", fc1), ("fc2", fc2)):
        reason = projection(fc, name)[1]
        if reason:
            return reason
    reason = _activation_reason(act)
    if reason:
        return reason
    (h_in, f_out), (f_in, h_out) = widths(fc1), widths(fc2)
    if f_in != f_out or h_out != h_in:
        return f"widths do not chain: {h_in}->{f_out} then {f_in}->{h_out}"
    return uniform_reason(fc1, fc2)


@contextlib.contextmanager
def _eval_mode(*modules):
    """Every submodule of `modules` in eval mode (no dropout) for the duration, then as it was."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    for m, _ in flags:
        m.training = False
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


def _probe(before, after, width, param, modules):
    """None when before(x) == after(x) on a small random x (or when it cannot run), else why not."""
    if param.is_meta:
        return None
    generator = torch.Generator().manual_seed(0)  # private: the caller's RNG stream is untouched
    x = torch.randn(2, 3, width, generator=generator).to(param.device, param.dtype)
    try:
        with torch.no_grad(), _eval_mode(*modules):
            want, got = before(x), after(x)
    except Exception as error:  # noqa: BLE001 - a forward this rule does not know how to call: leave it alone
        return f"probe failed ({type(error).__name__}: {error})"
    error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
    tolerance = 1e-4 if param.dtype in (torch.float32, torch.float64) else 3e-2
    if not error <= tolerance:
        return f"probe mismatch (relative error {error:.2g}): this transformers version's forward differs"
    return None


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


def _strip(module, stock_class):
    """`module` as `stock_class` again, without the remat_* entries conversion added to its __dict__."""
    stock = _with_class(module, stock_class)
    for name in [n for n in vars(stock) if n.startswith("remat_")]:
        del stock.__dict__[name]
    return stock


_REMAT_CLASSES = {}


def remat_class(mixin, stock_class):
    """Remat<Stock>(mixin, stock): the class a stock transformers module is swapped to."""
    cls = _REMAT_CLASSES.get((mixin, stock_class))
    if cls is None:
        name = f"Remat{stock_class.__name__}"
        # Read at every call: computed here, once, outside any torch.compile trace.
        fixed = {"remat_stock": stock_class, "remat_signature": inspect.signature(stock_class.forward),
                 "remat_passthrough": _passthrough_kwargs()}
        cls = type(name, (mixin, stock_class), {**fixed, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # importable by name, so a converted model pickles
        _REMAT_CLASSES[(mixin, stock_class)] = cls
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
        return _strip(self, self.remat_stock)


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
    for name in ("weight", "bias"):
        reason = tensor_reason(name, getattr(norm, name, None))
        if reason:
            return reason
    return None


def _normed_outputs(x, norm, modules, recompute, labels):
    """([module(norm(x)) for each module], None), with the LayerNorm fused into the projections when
    `norm` is given, or (None, why they cannot be fused at this call)."""
    if norm is None:
        return [m(x) for m in modules], None
    linears = []
    for module, label in zip(modules, labels):
        linear, reason = projection(module, label)
        if reason:
            return None, reason
        linears.append(linear)
    reason = _layer_norm_reason(norm)
    if reason:
        return None, reason
    return layer_norm_linears(x, norm.weight, norm.bias, linears, norm.eps, recompute), None


# ---------------------------------------------------------------------------------------------
# The swapped MLP modules
# ---------------------------------------------------------------------------------------------


class _RematMLP(_RematModule):
    """A transformers MLP module (GPT2MLP, ViTMLP, GPTNeoXMLP, CLIPMLP) on remat.mlp:
    dropout(fc2(gelu(fc1(x)))) keeping x and the fc1 output only, with the LayerNorm before it
    fused in when it was handed over. Any call remat cannot compute runs the stock forward."""

    def forward(self, hidden_states):
        parts = MLP_RULES[self.remat_stock.__name__]
        norm, norm_reason = _handed_over(self)
        fc1, reason = projection(self._modules[parts.fc1], parts.fc1)
        fc2, reason2 = projection(self._modules[parts.fc2], parts.fc2)
        reason = reason or reason2 or _activation_reason(self._modules[parts.act], parts.act) \
            or (_layer_norm_reason(norm) if norm is not None else None)
        if reason:
            self._remat_fallback(reason)
            if norm is not None:
                hidden_states = nn.LayerNorm.forward(norm, hidden_states)
            return self.remat_stock.forward(self, hidden_states)
        self._remat_fallback(norm_reason)
        norm_args = {} if norm is None else dict(norm_weight=norm.weight, norm_bias=norm.bias, eps=norm.eps,
                                                 layer_norm=True)
        out = mlp(hidden_states, fc1.weight, fc1.bias, fc2.weight, fc2.bias, _gelu(self._modules[parts.act]),
                  self.remat_recompute, fc1_adapters=fc1.adapters, fc2_adapters=fc2.adapters, **norm_args)
        return self._modules[parts.dropout](out) if parts.dropout else out

    def remat_saved_bytes(self):
        """Bytes per token this module keeps less than stock: the GELU output, where fc2 trains."""
        fc2 = self._modules[MLP_RULES[self.remat_stock.__name__].fc2]
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
        fc1, reason = projection(intermediate.dense, "intermediate.dense")
        fc2, reason2 = projection(self.dense, "dense")
        act = intermediate.intermediate_act_fn
        reason = reason or reason2 or _activation_reason(act, "intermediate.intermediate_act_fn")
        if reason:
            self._remat_fallback(reason)
            hidden_states = intermediate.remat_stock.forward(intermediate, hidden_states)
            return self.remat_stock.forward(self, hidden_states, input_tensor)
        self._remat_fallback(None)
        out = mlp(hidden_states, fc1.weight, fc1.bias, fc2.weight, fc2.bias, _gelu(act), self.remat_recompute,
                  fc1_adapters=fc1.adapters, fc2_adapters=fc2.adapters)
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


def _heads(t, heads, head_dim):
    """(B, S, heads * head_dim) -> (B, heads, S, head_dim), a strided view."""
    return t.unflatten(-1, (heads, head_dim)).transpose(1, 2)


def _merge_heads(o):
    """(B, H, S, D) laid out (B, S, H, D), as remat.attention returns it -> (B, S, H * D), a view:
    the output projection keeps the very storage attention keeps."""
    return o.transpose(1, 2).flatten(2)


def _rotary(q, k, cos, sin):
    """Rotary embeddings on the first cos.shape[-1] dims of q and k, as GPT-NeoX applies them
    (rotate_half convention; cos and sin (B, S, rotary_dims) from the model's rotary_emb)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dims = cos.shape[-1]

    def rotate(t):
        t_rot, t_pass = t[..., :dims], t[..., dims:]
        half = t_rot.shape[-1] // 2
        rotated = torch.cat((-t_rot[..., half:], t_rot[..., :half]), dim=-1)
        return torch.cat([(t_rot * cos) + (rotated * sin), t_pass], dim=-1)

    return rotate(q), rotate(k)


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
    remat_projections = ()

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


class _RematGPT2Attention(_RematAttention):
    remat_cache_arg = "cache"
    remat_projections = ("c_attn",)

    def remat_dropout(self):
        return self.attn_dropout.p

    def remat_qkv(self, outputs, call):
        (qkv,) = outputs
        return (_heads(t, self.num_heads, self.head_dim) for t in qkv.split(self.split_size, dim=2))

    def remat_output(self, o):
        return self.resid_dropout(self.c_proj(o))


class _RematBertSelfAttention(_RematAttention):
    """BertSelfAttention / RobertaSelfAttention: q, k, v Linears; the out-projection is BertSelfOutput's."""

    remat_cache_arg = "cache"
    remat_head_dim_attr = "attention_head_size"
    remat_projections = ("query", "key", "value")

    def remat_dropout(self):
        return self.dropout.p

    def remat_qkv(self, outputs, call):
        return (_heads(t, self.num_attention_heads, self.attention_head_size) for t in outputs)

    def remat_output(self, o):
        return o


class _RematViTAttention(_RematAttention):
    # Three Linears read one LayerNorm: fused, it is computed once and x kept once.
    remat_projections = ("q_proj", "k_proj", "v_proj")

    def remat_dropout(self):
        return self.attention_dropout

    def remat_qkv(self, outputs, call):
        return (_heads(t, self.num_attention_heads, self.head_dim) for t in outputs)

    def remat_output(self, o):
        return self.o_proj(o)


class _RematGPTNeoXAttention(_RematAttention):
    remat_cache_arg = "layer_past"
    remat_extra_args = ("position_embeddings",)
    remat_head_dim_attr = "head_size"
    remat_projections = ("query_key_value",)

    def remat_dropout(self):
        return self.attention_dropout

    def remat_fallback_reason(self, hidden_states, call):
        if call is not None and call.get("position_embeddings") is None:
            return "no position_embeddings (rotary cos, sin)"
        return super().remat_fallback_reason(hidden_states, call)

    def remat_qkv(self, outputs, call):
        (qkv,) = outputs
        # GPT-NeoX packs q, k, v per head: (B, S, H, 3 * D)
        qkv = qkv.unflatten(-1, (-1, 3 * self.head_size)).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        cos, sin = call["position_embeddings"]
        q, k = _rotary(q, k, cos, sin)
        return q, k, v

    def remat_output(self, o):
        return self.dense(o)


# Attention classes with a remat path: class name -> the mixin that computes it. The swapped class
# is built on first use (it subclasses the stock one, which needs transformers imported).
ATTENTION_RULES = {
    "GPT2Attention": _RematGPT2Attention,
    "BertSelfAttention": _RematBertSelfAttention,
    "RobertaSelfAttention": _RematBertSelfAttention,
    "ViTAttention": _RematViTAttention,
    "GPTNeoXAttention": _RematGPTNeoXAttention,
}

# The output projection each attention class ends with (for its width and parameter checks).
_OUTPUT_PROJECTIONS = {_RematGPT2Attention: "c_proj", _RematViTAttention: "o_proj",
                       _RematGPTNeoXAttention: "dense", _RematBertSelfAttention: None}

# Pre-LN blocks: layer class -> ((LayerNorm, attention), (LayerNorm, MLP)) child names. Each
# LayerNorm's output feeds only that consumer (checked by the probe, which runs the whole layer).
LAYER_RULES = {
    "GPT2Block": (("ln_1", "attn"), ("ln_2", "mlp")),
    "ViTLayer": (("layernorm_before", "attention"), ("layernorm_after", "mlp")),
    "GPTNeoXLayer": (("input_layernorm", "attention"), ("post_attention_layernorm", "mlp")),
}


# ---------------------------------------------------------------------------------------------
# The rules, called by remat.convert for each module of a PreTrainedModel
# ---------------------------------------------------------------------------------------------


def _instance_reason(module):
    """Why a stock module must keep its class: hooks, or a forward replaced on the instance."""
    if "forward" in vars(module):
        return "its forward is replaced on the instance"
    return hook_reason(module)


def _swapped(module, mixin, recompute, path):
    new = _with_class(module, remat_class(mixin, type(module)))
    new.__dict__["remat_recompute"], new.__dict__["remat_path"] = recompute, path
    return new


def _attention_reason(module):
    """None when `module` can take the remat path, else why it is left alone."""
    mixin = ATTENTION_RULES[type(module).__name__]
    reason = _instance_reason(module)
    if reason:
        return reason
    if getattr(module, "is_cross_attention", False):
        return "cross-attention (keys and values from the encoder)"
    output = _OUTPUT_PROJECTIONS[mixin]
    expected = (mixin.remat_head_dim_attr, "scaling", "config", "is_causal", *mixin.remat_projections,
                *filter(None, [output]))
    missing = [n for n in expected if not hasattr(module, n)]
    if missing:
        return f"lacks the expected attributes {', '.join(missing)}"
    if any(widths(getattr(module, n)) is None for n in mixin.remat_projections):
        return "its q/k/v projections are not Linear-like (nn.Linear, Conv1D or peft's LoRA around one)"
    head_dim = getattr(module, mixin.remat_head_dim_attr)
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} is not one of remat's kernel head dims {HEAD_DIMS}"
    parameters = inspect.signature(type(module).forward).parameters
    needed = ["attention_mask", *filter(None, [mixin.remat_cache_arg]), *mixin.remat_extra_args]
    if any(n not in parameters for n in needed):
        return f"the forward's arguments are not {', '.join(needed)}: this transformers version differs"
    return None


def _fused_layer_norm(norm, path):
    new = _with_class(norm, RematFusedLayerNorm)
    new.__dict__["remat_path"] = path
    return new


def _probe_kwargs(module, param):
    """Arguments a probe call of `module` (a layer or an attention) needs besides the input: no
    mask, and GPT-NeoX's rotary cos and sin, which the model computes (random angles check the
    rotation for any of them)."""
    parameters = inspect.signature(module.forward).parameters
    kwargs = {"attention_mask": None} if "attention_mask" in parameters else {}
    attention = module if hasattr(module, "rotary_ndims") else getattr(module, "attention", None)
    dims = getattr(attention, "rotary_ndims", None)
    if "position_embeddings" in parameters and dims is not None:
        angles = torch.randn(2, 3, dims, generator=torch.Generator().manual_seed(1))
        angles = angles.to(param.device, param.dtype)
        kwargs["position_embeddings"] = (angles.cos(), angles.sin())
    return kwargs


def _first_output(output):
    return output[0] if isinstance(output, tuple) else output


def _swap_probe(owner, swaps, width, param, traced=None, call=None):
    """None when owner(x) (or call(owner, x)) is unchanged with `swaps` ({child name: new module})
    in place, and the remat path of `traced` (a swapped module, when given) is what ran; else why not."""
    if param.is_meta:
        return None  # nothing to run on: not probed, as _probe
    originals = {name: owner._modules[name] for name in swaps}
    extra = _probe_kwargs(owner, param)
    call = call or (lambda module, x: _first_output(module(x, **extra)))
    trace = []

    def after(x):
        owner._modules.update(swaps)
        if traced is not None:
            traced.__dict__["remat_trace"] = trace
        try:
            return call(owner, x)
        finally:
            owner._modules.update(originals)
            if traced is not None:
                del traced.__dict__["remat_trace"]

    reason = _probe(lambda x: call(owner, x), after, width, param, [owner, *swaps.values()])
    if reason is None and traced is not None and trace != [None]:
        reason = f"the probe call did not take the remat path ({trace[0] if trace else 'not called'})"
    return reason


def _self_probe(module, new, width, param):
    """Probe of a swapped module on its own: its remat path against the stock forward."""
    if param.is_meta:
        return None
    extra = _probe_kwargs(module, param)
    trace = []

    def after(x):
        new.__dict__["remat_trace"] = trace
        try:
            return _first_output(new(x, **extra))
        finally:
            del new.__dict__["remat_trace"]

    reason = _probe(lambda x: _first_output(module(x, **extra)), after, width, param, [module])
    if reason is None and trace != [None]:
        reason = f"the probe call did not take the remat path ({trace[0] if trace else 'not called'})"
    return reason


def _attention_width(module):
    first = getattr(module, ATTENTION_RULES[type(module).__name__].remat_projections[0])
    return widths(first)[0], first.weight


def _attention_row(path, name, module, new, norm_name=None):
    fused = f"; {norm_name} fused into its q/k/v projection" if norm_name else ""
    return (_join(path, name), module, f"swapped to {type(new).__name__}",
            "remat.attention" + fused + "; the stock forward for padding masks, KV caches with past keys, "
            "output_attentions, dropout in training and other implementations than sdpa/eager",
            new.remat_saved_bytes)


def _attention_rule(parent, name, module, recompute, path, report):
    """Swap a stock attention module (no LayerNorm fused); returns the reason when it is not swapped."""
    reason = _attention_reason(module)
    if reason is None:
        new = _swapped(module, ATTENTION_RULES[type(module).__name__], recompute, _join(path, name))
        width, param = _attention_width(module)
        reason = _self_probe(module, new, width, param)
    if reason:
        return reason
    parent._modules[name] = new
    report.add(*_attention_row(path, name, module, new))
    return None


def _fusable_norm(layer, norm_name, width, layers):
    norm = layer._modules.get(norm_name)
    if "layernorm" not in layers:
        return None, "layers excludes layernorm"
    if type(norm) is not nn.LayerNorm:
        return None, f"{norm_name} is {type(norm).__name__}, not exactly nn.LayerNorm"
    return norm, layer_norm_fusable(norm, width) or _instance_reason(norm) or hook_reason(layer)


def _add_norm_row(report, path, norm_name, norm, new_norm, consumer_name, consumer, into):
    report.add(_join(path, norm_name), norm, "swapped to RematFusedLayerNorm",
               f"applied inside {consumer_name}, fused into {into}; returns its input",
               lambda: 0 if not consumer.remat_recompute else
               fused_saved_bytes(new_norm, [consumer._modules[n] for n in consumer.remat_norm_consumers]))


def _layer_attention(layer, norm_name, attn_name, layers, recompute, path, report):
    """Swap the attention of a pre-LN layer, with its LayerNorm fused in; the names handled."""
    module = layer._modules.get(attn_name)
    if type(module).__name__ not in ATTENTION_RULES or not _from_transformers(module):
        return set()
    if "attention" not in layers:
        return set()
    reason = _attention_reason(module)
    if reason:
        report.add(_join(path, attn_name), module, "skipped", reason)
        return {attn_name}
    mixin = ATTENTION_RULES[type(module).__name__]
    width, param = _attention_width(module)
    norm, norm_reason = _fusable_norm(layer, norm_name, width, layers)
    if norm_reason is None:
        norm_reason = next(filter(None, (projection(getattr(module, n), n)[1] for n in mixin.remat_projections)),
                           None)
    if norm_reason is None:
        fused_norm = _fused_layer_norm(norm, _join(path, norm_name))
        new = _swapped(module, mixin, recompute, _join(path, attn_name))
        _link(layer, norm_name, fused_norm, attn_name, new)
        norm_reason = _swap_probe(layer, {norm_name: fused_norm, attn_name: new}, width, param, new)
        if norm_reason is None:
            layer._modules[norm_name], layer._modules[attn_name] = fused_norm, new
            new.__dict__["remat_norm_consumers"] = mixin.remat_projections
            report.add(*_attention_row(path, attn_name, module, new, norm_name))
            _add_norm_row(report, path, norm_name, norm, fused_norm, attn_name, new, "its q/k/v projection")
            return {norm_name, attn_name}
    if norm is not None and norm_reason != "layers excludes layernorm":
        report.add(_join(path, norm_name), norm, "skipped", f"fusion into {attn_name}: {norm_reason}")
    reason = _attention_rule(layer, attn_name, module, recompute, path, report)
    if reason:
        report.add(_join(path, attn_name), module, "skipped", reason)
    return {attn_name}


def _mlp_candidate(module, recompute, path):
    """(the swapped MLP for `module`, None) or (None, why not)."""
    parts = MLP_RULES[type(module).__name__]
    fc1, act, fc2 = (getattr(module, n, None) for n in (parts.fc1, parts.act, parts.fc2))
    if fc1 is None or fc2 is None or act is None:
        return None, f"{type(module).__name__} lacks the expected submodules {parts.fc1}, {parts.act}, {parts.fc2}"
    reason = _instance_reason(module) or _mlp_reason(fc1, act, fc2)
    if reason:
        return None, reason
    return _swapped(module, _RematMLP, recompute, path), None


def _mlp_row(path, name, module, new, norm_name=None):
    parts = MLP_RULES[type(module).__name__]
    chain = f"{parts.fc1} -> {type(getattr(module, parts.act)).__name__} -> {parts.fc2}"
    if parts.dropout:
        chain += f" (+ {parts.dropout})"
    if norm_name:
        chain = f"{norm_name} -> {chain}"
    kept = "the GELU output is not kept" + (f", nor {norm_name}'s output" if norm_name else "")
    return _join(path, name), module, f"swapped to {type(new).__name__}", f"fused {chain}: {kept}", \
        new.remat_saved_bytes


def _layer_mlp(layer, norm_name, mlp_name, layers, recompute, path, report):
    """Swap the MLP of a pre-LN layer with its LayerNorm fused in; the names handled (none when the
    plain MLP rule should run instead)."""
    module = layer._modules.get(mlp_name)
    if type(module).__name__ not in MLP_RULES or not _from_transformers(module) or "mlp" not in layers:
        return set()
    parts = MLP_RULES[type(module).__name__]
    fc1 = getattr(module, parts.fc1, None)
    if fc1 is None or widths(fc1) is None:
        return set()
    width = widths(fc1)[0]
    norm, reason = _fusable_norm(layer, norm_name, width, layers)
    if reason is None:
        reason = layer_norm_fusable(norm, width, need_bias=True)
    if reason is None:
        new, reason = _mlp_candidate(module, recompute, _join(path, mlp_name))
        if reason is None:
            fused_norm = _fused_layer_norm(norm, _join(path, norm_name))
            _link(layer, norm_name, fused_norm, mlp_name, new)
            reason = _swap_probe(layer, {norm_name: fused_norm, mlp_name: new}, width, fc1.weight, new)
        if reason is None:
            layer._modules[norm_name], layer._modules[mlp_name] = fused_norm, new
            new.__dict__["remat_norm_consumers"] = (parts.fc1,)
            report.add(*_mlp_row(path, mlp_name, module, new, norm_name))
            _add_norm_row(report, path, norm_name, norm, fused_norm, mlp_name, new, parts.fc1)
            return {norm_name, mlp_name}
    if norm is not None and reason != "layers excludes layernorm":
        report.add(_join(path, norm_name), norm, "skipped", f"fusion into {mlp_name}: {reason}")
    return set()  # the MLP on its own, by the plain rule


def _mlp_rule(parent, name, module, recompute, path, report):
    new, reason = _mlp_candidate(module, recompute, _join(path, name))
    if reason:
        return reason
    fc1 = getattr(module, MLP_RULES[type(module).__name__].fc1)
    reason = _self_probe(module, new, widths(fc1)[0], fc1.weight)
    if reason:
        return reason
    parent._modules[name] = new
    report.add(*_mlp_row(path, name, module, new))
    return None


def _layer_rule(layer, layers, recompute, path, report):
    (norm1, attn), (norm2, mlp_name) = LAYER_RULES[type(layer).__name__]
    if hook_reason(layer):
        report.add(path, layer, "skipped", f"{hook_reason(layer)}: no fusion across its children")
        return set()
    handled = _layer_attention(layer, norm1, attn, layers, recompute, path, report)
    return handled | _layer_mlp(layer, norm2, mlp_name, layers, recompute, path, report)


def _pair_rule(layer, recompute, path, report):
    inter_name, inter_class, out_name, out_class = PAIR_RULES[type(layer).__name__]
    inter, out = getattr(layer, inter_name, None), getattr(layer, out_name, None)
    if type(inter).__name__ != inter_class or type(out).__name__ != out_class:
        return None  # already converted, or not the expected structure
    row_path = _join(path, inter_name)
    fc1, act = getattr(inter, "dense", None), getattr(inter, "intermediate_act_fn", None)
    fc2, dropout, norm = (getattr(out, n, None) for n in ("dense", "dropout", "LayerNorm"))
    reason = _instance_reason(inter) or _instance_reason(out) or hook_reason(layer)
    if reason is None and not callable(getattr(layer, "feed_forward_chunk", None)):
        reason = f"{type(layer).__name__} has no feed_forward_chunk to check the FFN wiring against"
    if reason is None:
        reason = _mlp_reason(fc1, act, fc2) if isinstance(fc1, nn.Module) and \
            isinstance(fc2, nn.Module) else "dense layers missing"
    if reason is None and not isinstance(dropout, nn.Module):
        reason = "output.dropout is not a module"
    if reason is None and not isinstance(norm, nn.LayerNorm):
        reason = "output.LayerNorm is not an nn.LayerNorm"
    if reason is None:
        new_inter = _swapped(inter, _RematIntermediate, recompute, row_path)
        new_out = _swapped(out, _RematOutput, recompute, _join(path, out_name))
        _link(layer, inter_name, new_inter, out_name, new_out)
        reason = _swap_probe(layer, {inter_name: new_inter, out_name: new_out}, widths(fc1)[0], fc1.weight,
                             new_out, call=lambda owner, x: owner.feed_forward_chunk(x))
    if reason:
        report.add(row_path, inter, "skipped", f"{inter_name} + {out_name} FFN: {reason}")
        return set()
    layer._modules[inter_name], layer._modules[out_name] = new_inter, new_out
    report.add(row_path, inter, f"swapped to {type(new_inter).__name__}",
               f"FFN fused into {out_name}; returns its input", lambda: 0)
    report.add(_join(path, out_name), out, f"swapped to {type(new_out).__name__}",
               f"LayerNorm(dropout(dense(gelu({inter_name}.dense(x)))) + input): the GELU output is not kept",
               new_out.remat_saved_bytes)
    return {inter_name}  # output is recursed into: its LayerNorm becomes remat.nn.LayerNorm


def _holds_ruled_attention(module):
    return any(type(m).__name__ in ATTENTION_RULES and _from_transformers(m) for m in module.modules())


def convert_children(parent, layers, recompute, path, report):
    """Apply the family rules to `parent`'s children; returns the names convert must not touch."""
    handled = set()
    kind = type(parent).__name__
    if kind in PAIR_RULES and _from_transformers(parent) and "mlp" in layers:
        handled |= _pair_rule(parent, recompute, path, report) or set()
    if kind in LAYER_RULES and _from_transformers(parent):
        handled |= _layer_rule(parent, layers, recompute, path, report)
    for name, child in list(parent._modules.items()):
        if child is None or name in handled or not _from_transformers(child):
            continue
        kind = type(child).__name__
        if kind in MLP_RULES and "mlp" in layers:
            reason = _mlp_rule(parent, name, child, recompute, path, report)
            if reason:
                report.add(_join(path, name), child, "skipped", reason)
            handled.add(name)
        elif kind in ATTENTION_RULES and "attention" in layers:
            reason = _attention_rule(parent, name, child, recompute, path, report)
            if reason:
                report.add(_join(path, name), child, "skipped", reason)
            handled.add(name)
        elif kind.endswith(ATTENTION_SUFFIXES) and "attention" in layers and not _holds_ruled_attention(child):
            report.add(_join(path, name), child, "skipped", f"no remat rule for {kind}: it runs as it is")
        elif _unruled_layer(child):
            report.add(_join(path, name), child, "skipped",
                       f"no remat rule for {kind}: its norms are not fused into the projections after "
                       "them, and its MLP is not fused")
    return handled


def _unruled_layer(module):
    """True for a transformers block (…Layer, …Block) holding a norm, that no family rule covers."""
    kind = type(module).__name__
    if kind in LAYER_RULES or kind in PAIR_RULES or not kind.endswith(("Layer", "Block")):
        return False
    return any(isinstance(m, nn.LayerNorm) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
               for m in module.children())
