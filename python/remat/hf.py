"""Hugging Face transformers support for remat.convert (tested with transformers 5.24).

remat.convert applies these rules, besides the generic ones (every other nn.LayerNorm becomes
remat.nn.LayerNorm), when the model is a transformers PreTrainedModel. Module swaps only: no
forward function of a transformers class is patched, and a swapped module holds the very
submodules and parameters of the original (same state_dict keys, in the same order).

    family           swapped (class -> remat class)                  LayerNorms fused (pre-LN)
    GPT-2            GPT2Attention -> RematGPT2Attention             ln_1 into c_attn
                     GPT2MLP -> RematHFMLP                           ln_2 into c_fc
    ViT              ViTAttention -> RematViTAttention               layernorm_before into q/k/v_proj
                     ViTMLP -> RematHFMLP                            layernorm_after into fc1
    GPT-NeoX/Pythia  GPTNeoXAttention -> RematGPTNeoXAttention       input_layernorm into
                       (rotary embedding included)                     query_key_value
                     GPTNeoXMLP -> RematHFMLP                        post_attention_layernorm into
                                                                       dense_h_to_4h
    BERT, RoBERTa    Bert/RobertaSelfAttention ->                    none: post-LN, the LayerNorm
                       RematBert/RobertaSelfAttention                  follows the residual add
                     intermediate -> RematPassthroughIntermediate,
                     output -> RematBertOutput (the FFN, fused)
    CLIP             CLIPMLP -> RematHFMLP, with a GELU only         none
                       (CLIP's default quick_gelu is not one)

Memory (design.md §1), per layer and token, in bytes of the activation dtype: the fused MLPs keep
the fc1 output, never the GELU output (ffn less); a fused pre-LN LayerNorm keeps its input x and
fp32 mean/rstd, never its output, because the projection after it rebuilds LN(x) for its weight
gradient (hidden less per LayerNorm, two per pre-LN layer). ViT's q, k and v are three Linears:
its LayerNorm is fused into each, which keeps x once and three fp32 mean/rstd pairs (two more
than stock, 16 bytes). remat.attention keeps q, k, v, the output and an fp32 log-sum-exp per
row, and lays its output out as (batch, seq, heads, head_dim), so the out-projection keeps that
same storage; stock SDPA's output takes q's layout on some backends (CPU), and transformers'
transpose(1, 2).contiguous() then copies it (GPT-NeoX on CPU: hidden more kept by stock).

Attention. The remat classes are the stock classes with a remat path mixed in: the instance is
the stock module with its class changed, so isinstance checks (transformers' output recorders,
weight init) and attributes stay, and every call the remat path does not compute exactly runs
the stock forward (with the fused LayerNorm applied first). The remat path computes q, k, v with
the module's own projections (GPT-NeoX's rotary embedding as transformers applies it), then
remat.attention and the module's output projection. It runs when:

- config._attn_implementation is "sdpa" or "eager" (flash_attention_* and flex_attention read
  packing information from the call: stock);
- no attention weights are requested (output_attentions by argument, by config, or by
  transformers' output collector for a model-level output_attentions=True call);
- no dropout in effect (eval, or an attention dropout of 0);
- no KV cache, or a plain DynamicCache that holds nothing yet for this layer (a prefill, and
  training with use_cache=True): its update() stores and returns the new keys and values as
  given. A cache with past keys (a generation step) runs stock;
- the mask is none or plain: None (sdpa passes None when nothing is masked; with sdpa the call
  is then causal when the module is, with eager it is not masked), or a 4-D tensor that is
  exactly all-visible or exactly causal: bool (True = visible), or float added to the scores
  with 0 = visible and -inf or the dtype's minimum = hidden. That check compares on the device
  (one synchronisation per layer) and only runs for materialised masks (eager, or padding);
  any padding makes the mask neither, and the call runs stock;
- no other argument with a value (cross-attention's encoder_hidden_states, head masks, packing
  arguments), the input (batch, seq, hidden), and the arguments bind to the stock forward's
  signature (a deprecated name it renames runs stock).

Not swapped: cross-attention (GPT-2's crossattention, BertCrossAttention), head dims outside
remat's kernel head dims (remat.ops.attention.HEAD_DIMS), projections that are not exactly
nn.Linear / transformers Conv1D, modules with hooks, and attention classes without a rule (the
report says "no remat rule").

LayerNorm fusion. A fused LayerNorm becomes RematFusedLayerNorm: still an nn.LayerNorm with its
own weight, bias and eps (same keys), whose forward returns its input; the attention or MLP
after it applies it inside the fused op. Only exact nn.LayerNorms over the last dimension with
affine parameters (and a bias, for the MLP) are fused.

GELU variants accepted: GELUActivation (erf), nn.GELU, GELUTanh/PytorchGELUTanh,
NewGELUActivation and FastGELUActivation (the tanh approximation, FastGELU's constant rounded
at 1e-10). Not: QuickGELU, clipped or other activations. Dropout after fc2 (GPT-2) and after
the attention's out-projection is torch's nn.Dropout exactly as the original, so training with
those dropouts stays equivalent (same random stream).

Every rule is checked when it is applied: the original and the swapped modules run on one small
random input (eval mode, a private generator, no autograd) and must agree, the attention's
remat path must be what ran, and a fused LayerNorm is checked by running the whole layer, which
also proves its output feeds nothing else. A mismatch (a transformers version whose forward
differs) leaves the modules alone and says so in the report. Models on the meta device are not
probed.

remat.revert gives the stock classes back (same objects inside).
"""

import contextlib
import functools
import inspect
import sys

import torch
from torch import nn

from .convert import _join, _with_class, hook_reason, layer_norm_fusable, uniform_reason
from .convert import gelu_approximate as _generic_gelu_approximate
from .ops.attention import HEAD_DIMS, attention
from .ops.fused import layer_norm_linear, mlp

TESTED_TRANSFORMERS = ">=5.24,<6"

# MLP modules: class name -> (fc1, activation, fc2, dropout or None, Conv1D weights (in, out))
MLP_RULES = {
    "GPT2MLP": ("c_fc", "act", "c_proj", "dropout", True),
    "ViTMLP": ("fc1", "activation_fn", "fc2", None, False),
    "GPTNeoXMLP": ("dense_h_to_4h", "act", "dense_4h_to_h", None, False),
    "CLIPMLP": ("fc1", "activation_fn", "fc2", None, False),
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


def _is_conv1d(module):
    return type(module).__name__ == "Conv1D" and _from_transformers(module)


def _widths(fc, transposed):
    """(in_features, out_features) of an nn.Linear, or of a transformers Conv1D (weight (in, out))."""
    if transposed:
        return tuple(fc.weight.shape)
    return fc.in_features, fc.out_features


def _mlp_reason(fc1, act, fc2, dropout, transposed):
    """None when fc1 -> act -> fc2 [-> dropout] is remat.mlp [+ dropout], else why not."""
    for name, fc in (("fc1", fc1), ("fc2", fc2)):
        if transposed and not _is_conv1d(fc):
            return f"{name} is {type(fc).__name__}, not transformers Conv1D"
        if not transposed and type(fc) is not nn.Linear:
            return f"{name} is {type(fc).__name__}, not exactly nn.Linear"
    if _gelu(act) is None:
        return f"activation {type(act).__name__} is not a GELU remat computes (exact or tanh)"
    (h_in, f_out), (f_in, h_out) = _widths(fc1, transposed), _widths(fc2, transposed)
    if f_in != f_out or h_out != h_in:
        return f"widths do not chain: {h_in}->{f_out} then {f_in}->{h_out}"
    if (fc1.bias is None) != (fc2.bias is None):
        return "one projection has a bias and the other none"
    if dropout is not None and type(dropout) is not nn.Dropout:
        return f"dropout is {type(dropout).__name__}, not nn.Dropout"
    for m in (fc1, act, fc2, dropout):
        if m is not None and hook_reason(m):
            return f"{type(m).__name__} {hook_reason(m)}"
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
# The swapped modules
# ---------------------------------------------------------------------------------------------


class RematHFMLP(nn.Module):
    """A transformers MLP module (GPT2MLP, ViTMLP, GPTNeoXMLP, CLIPMLP) on remat.mlp.

    Holds the original's submodules under their original names (same parameters, same
    state_dict keys), computes dropout(fc2(gelu(fc1(x)))) keeping x and the fc1 output only,
    and remat_revert() gives the original module back.
    """

    remat_fused = True

    def __init__(self, original, fc1, act, fc2, dropout, transposed, approximate, recompute, norm=None):
        super().__init__()
        self.names = (fc1, act, fc2, dropout)
        for name in self.names:
            if name is not None:
                setattr(self, name, getattr(original, name))
        self.transposed, self.approximate, self.recompute = transposed, approximate, recompute
        self.__dict__["remat_original"] = original  # not a submodule: kept for remat_revert()
        # The sibling LayerNorm in front (a RematFusedLayerNorm that passes its input through),
        # or None. Not a submodule: its parameters keep their place and keys in the layer.
        self.__dict__["remat_norm"] = norm

    def forward(self, hidden_states):
        fc1, _, fc2, dropout = (self._modules[n] if n is not None else None for n in self.names)
        w1, w2 = fc1.weight, fc2.weight
        if self.transposed:  # Conv1D: y = x @ weight + bias, weight (in, out)
            w1, w2 = w1.t(), w2.t()
        norm = self.remat_norm
        if norm is None:
            out = mlp(hidden_states, w1, fc1.bias, w2, fc2.bias, self.approximate, self.recompute)
        else:
            out = mlp(hidden_states, w1, fc1.bias, w2, fc2.bias, self.approximate, self.recompute,
                      norm_weight=norm.weight, norm_bias=norm.bias, eps=norm.eps, layer_norm=True)
        return dropout(out) if dropout is not None else out

    def extra_repr(self):
        fused = ", LayerNorm fused in front" if self.remat_norm is not None else ""
        return f"{type(self.remat_original).__name__} on remat.mlp, approximate={self.approximate!r}, " \
               f"recompute={self.recompute}{fused}"

    def remat_revert(self):
        original = self.remat_original
        for name in self.names:
            if name is not None:
                original._modules[name] = self._modules[name]
        original.train(self.training)
        return original


class RematFusedLayerNorm(nn.LayerNorm):
    """A pre-LN block's LayerNorm whose consumer (the attention's q/k/v projection or the MLP's
    fc1) now applies it, fused: forward returns its input. Still an nn.LayerNorm with its own
    weight, bias and eps (same objects, same state_dict keys, found by isinstance checks such as
    weight-decay groups); remat_revert() gives the stock module back."""

    remat_fused = True

    def forward(self, hidden_states):
        return hidden_states

    def extra_repr(self):
        return f"{super().extra_repr()}, applied fused by the next projection: returns its input"

    def remat_revert(self):
        return _with_class(self, nn.LayerNorm)


class RematPassthroughIntermediate(nn.Module):
    """BertIntermediate's place in a converted layer: holds dense and the activation (same
    parameters and keys) and returns its input; RematBertOutput computes the whole FFN."""

    remat_fused = True

    def __init__(self, original):
        super().__init__()
        self.dense = original.dense
        self.intermediate_act_fn = original.intermediate_act_fn
        self.__dict__["remat_original"] = original

    def forward(self, hidden_states):
        return hidden_states

    def remat_revert(self):
        original = self.remat_original
        original._modules["dense"] = self._modules["dense"]
        original.train(self.training)
        return original


class RematBertOutput(nn.Module):
    """BertOutput (and RobertaOutput) with the FFN fused in:
    LayerNorm(dropout(dense(gelu(intermediate.dense(x)))) + input_tensor) on remat.mlp.

    Holds dense, LayerNorm and dropout (same parameters and keys); the intermediate dense is
    the sibling's (not registered here, so the keys do not change).
    """

    def __init__(self, original, intermediate, approximate, recompute):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = original.dense, original.LayerNorm, original.dropout
        self.approximate, self.recompute = approximate, recompute
        self.__dict__["remat_fc1"] = intermediate.dense
        self.__dict__["remat_original"] = original

    def forward(self, hidden_states, input_tensor):
        fc1, fc2 = self.remat_fc1, self.dense
        out = mlp(hidden_states, fc1.weight, fc1.bias, fc2.weight, fc2.bias, self.approximate, self.recompute)
        return self.LayerNorm(self.dropout(out) + input_tensor)

    def remat_revert(self):
        original = self.remat_original
        for name in ("dense", "LayerNorm", "dropout"):
            original._modules[name] = self._modules[name]
        original.train(self.training)
        return original


# ---------------------------------------------------------------------------------------------
# Attention: the stock classes with a remat path (class swap, same objects inside)
# ---------------------------------------------------------------------------------------------

# Arguments of the stock forwards that may be given with any value without changing what the
# remat path computes: position_ids only matter to flash-attention packing (not run here), and
# use_cache only says whether a cache was made (the cache itself is checked).
HARMLESS_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions",
                             "output_hidden_states", "return_dict"})

# The attention implementations whose result is fully determined by q, k, v, the mask, the
# scale and dropout. flash_attention_* and flex_attention also read packing information from the
# call (cu_seq_lens, position_ids) and run the stock forward.
REMAT_IMPLEMENTATIONS = ("sdpa", "eager")


@functools.cache
def _signature(stock_class):
    return inspect.signature(stock_class.forward)


def _layer_norm(norm, x):
    """What the stock nn.LayerNorm computes, for a LayerNorm whose module now passes its input through."""
    return nn.LayerNorm.forward(norm, x)


def _project(x, norm, linear, recompute, transposed=False):
    """linear(norm(x)), with the LayerNorm fused into the Linear when there is one (keeps x, not norm(x))."""
    weight = linear.weight.t() if transposed else linear.weight  # Conv1D holds (in, out)
    if norm is None:
        return linear(x)
    return layer_norm_linear(x, norm.weight, norm.bias, weight, linear.bias, norm.eps, recompute)


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


class _RematAttention:
    """The remat path shared by the swapped attention classes (mixed in before the stock class).

    The instance is the stock module with its class changed: same submodules, parameters and
    attributes, so state_dict keys, isinstance checks (transformers' output recorders and weight
    init) and the stock forward (every call the remat path does not take) are unchanged.
    Subclasses say how to build q, k, v and how to project the output; `remat_norm` is the
    preceding LayerNorm fused into the q/k/v projection (None when nothing is fused).
    """

    remat_fused = True
    remat_stock: type  # the stock class
    remat_cache_arg = None  # the stock forward's KV-cache argument
    remat_extra_args = ()  # further stock arguments the remat path reads (rotary cos/sin)

    def forward(self, hidden_states, *args, **kwargs):
        call = self._remat_bind(hidden_states, args, kwargs)
        reason = self.remat_fallback_reason(hidden_states, call)
        trace = self.__dict__.get("remat_trace")
        if trace is not None:  # set by the conversion probe only
            trace.append(reason)
        if reason is not None:
            if self.remat_norm is not None:
                hidden_states = _layer_norm(self.remat_norm, hidden_states)
            return self.remat_stock.forward(self, hidden_states, *args, **kwargs)
        return self.remat_forward(hidden_states, call, self.remat_causal(call, hidden_states.shape[1]))

    def _remat_bind(self, hidden_states, args, kwargs):
        """The call's arguments by the stock forward's names (**kwargs merged in), or None when
        they do not bind."""
        signature = _signature(self.remat_stock)
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
        known = {"attention_mask", self.remat_cache_arg, *self.remat_extra_args}
        others = [name for name, value in call.items() if name not in known and name not in HARMLESS_KWARGS
                  and value is not None and value is not False]
        if others:
            return f"arguments the remat path does not take: {', '.join(sorted(others))}"
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
        implementation reads none (sdpa: the module's is_causal; eager: nothing is masked)."""
        if call.get("attention_mask") is not None:
            pattern = call.get("remat_mask_pattern") or _mask_pattern(call["attention_mask"], seq, seq)
            return pattern == "causal"
        return bool(self.is_causal) and self.config._attn_implementation == "sdpa"

    def remat_forward(self, hidden_states, call, causal):
        """(output, None) by remat.attention; the caller has checked remat_fallback_reason."""
        q, k, v = self.remat_qkv(hidden_states, call)
        cache = call.get(self.remat_cache_arg) if self.remat_cache_arg else None
        if cache is not None:  # empty: update() stores and returns these very keys and values
            k, v = cache.update(k, v, self.layer_idx)
        o = attention(q, k, v, causal=causal, softmax_scale=float(self.scaling))
        return self.remat_output(_merge_heads(o)), None

    def remat_revert(self):
        stock = _with_class(self, self.remat_stock)
        for name in ("remat_norm", "remat_recompute", "remat_trace"):
            stock.__dict__.pop(name, None)
        return stock

    def extra_repr(self):
        fused = ", the LayerNorm before it fused into the q/k/v projection" if self.remat_norm is not None else ""
        return f"{self.remat_stock.__name__} on remat.attention{fused}"


class _RematGPT2Attention(_RematAttention):
    remat_cache_arg = "cache"

    def remat_dropout(self):
        return self.attn_dropout.p

    def remat_qkv(self, x, call):
        qkv = _project(x, self.remat_norm, self.c_attn, self.remat_recompute, transposed=True)
        return (_heads(t, self.num_heads, self.head_dim) for t in qkv.split(self.split_size, dim=2))

    def remat_output(self, o):
        return self.resid_dropout(self.c_proj(o))


class _RematBertSelfAttention(_RematAttention):
    """BertSelfAttention / RobertaSelfAttention: q, k, v Linears; the out-projection is BertSelfOutput's."""

    remat_cache_arg = "cache"

    def remat_dropout(self):
        return self.dropout.p

    def remat_qkv(self, x, call):
        return (_heads(linear(x), self.num_attention_heads, self.attention_head_size)
                for linear in (self.query, self.key, self.value))

    def remat_output(self, o):
        return o


class _RematViTAttention(_RematAttention):
    def remat_dropout(self):
        return self.attention_dropout

    def remat_qkv(self, x, call):
        # Three separate Linears: the LayerNorm is fused into each (recomputed three times, and three
        # fp32 mean/rstd pairs kept), which keeps x once instead of LN(x).
        return (_heads(_project(x, self.remat_norm, linear, self.remat_recompute), self.num_attention_heads,
                       self.head_dim) for linear in (self.q_proj, self.k_proj, self.v_proj))

    def remat_output(self, o):
        return self.o_proj(o)


class _RematGPTNeoXAttention(_RematAttention):
    remat_cache_arg = "layer_past"
    remat_extra_args = ("position_embeddings",)

    def remat_dropout(self):
        return self.attention_dropout

    def remat_fallback_reason(self, hidden_states, call):
        if call is not None and call.get("position_embeddings") is None:
            return "no position_embeddings (rotary cos, sin)"
        return super().remat_fallback_reason(hidden_states, call)

    def remat_qkv(self, x, call):
        qkv = _project(x, self.remat_norm, self.query_key_value, self.remat_recompute)
        # GPT-NeoX packs q, k, v per head: (B, S, H, 3 * D)
        qkv = qkv.unflatten(-1, (-1, 3 * self.head_size)).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        cos, sin = call["position_embeddings"]
        q, k = _rotary(q, k, cos, sin)
        return q, k, v

    def remat_output(self, o):
        return self.dense(o)


# ---------------------------------------------------------------------------------------------
# The rules, called by remat.convert for each module of a PreTrainedModel
# ---------------------------------------------------------------------------------------------


def _mlp_candidate(module, recompute, norm=None):
    """(RematHFMLP for `module`, None) or (None, why not); `norm` is fused in front when given."""
    fc1_name, act_name, fc2_name, dropout_name, transposed = MLP_RULES[type(module).__name__]
    fc1, act, fc2 = (getattr(module, n, None) for n in (fc1_name, act_name, fc2_name))
    dropout = getattr(module, dropout_name, None) if dropout_name else None
    if fc1 is None or fc2 is None or act is None:
        return None, f"{type(module).__name__} lacks the expected submodules {fc1_name}, {act_name}, {fc2_name}"
    reason = hook_reason(module) or _mlp_reason(fc1, act, fc2, dropout, transposed)
    if reason:
        return None, reason
    new = RematHFMLP(module, fc1_name, act_name, fc2_name, dropout_name, transposed, _gelu(act), recompute,
                     norm)
    new.train(module.training)
    return new, None


def _mlp_row(path, name, module, new, norm_name=None):
    fc1_name, act_name, fc2_name, dropout_name, _ = MLP_RULES[type(module).__name__]
    chain = f"{fc1_name} -> {type(getattr(module, act_name)).__name__} -> {fc2_name}"
    if dropout_name:
        chain += f" (+ {dropout_name})"
    if norm_name:
        chain = f"{norm_name} -> {chain}"
    kept = "the GELU output is not kept" + (f", nor {norm_name}'s output" if norm_name else "")
    return _join(path, name), module, "swapped to RematHFMLP", f"fused {chain}: {kept}"


def _mlp_rule(parent, name, module, recompute, path, report):
    new, reason = _mlp_candidate(module, recompute)
    if reason:
        return reason
    fc1_name, _, _, _, transposed = MLP_RULES[type(module).__name__]
    fc1 = getattr(module, fc1_name)
    reason = _probe(module, new, _widths(fc1, transposed)[0], fc1.weight, [module])
    if reason:
        return reason
    parent._modules[name] = new
    report.add(*_mlp_row(path, name, module, new))
    return None


# Attention classes with a remat path: class name -> the mixin that computes it. The swapped class
# is built on first use (it subclasses the stock one, which needs transformers imported).
ATTENTION_RULES = {
    "GPT2Attention": _RematGPT2Attention,
    "BertSelfAttention": _RematBertSelfAttention,
    "RobertaSelfAttention": _RematBertSelfAttention,
    "ViTAttention": _RematViTAttention,
    "GPTNeoXAttention": _RematGPTNeoXAttention,
}

# What each mixin reads from the stock module: head dim attribute, projections (Conv1D or Linear).
_ATTENTION_PARTS = {
    _RematGPT2Attention: ("head_dim", ("c_attn", "c_proj"), True),
    _RematBertSelfAttention: ("attention_head_size", ("query", "key", "value"), False),
    _RematViTAttention: ("head_dim", ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    _RematGPTNeoXAttention: ("head_size", ("query_key_value", "dense"), False),
}

# Pre-LN blocks: layer class -> ((LayerNorm, attention), (LayerNorm, MLP)) child names. Each
# LayerNorm's output feeds only that consumer (checked by the probe, which runs the whole layer).
LAYER_RULES = {
    "GPT2Block": (("ln_1", "attn"), ("ln_2", "mlp")),
    "ViTLayer": (("layernorm_before", "attention"), ("layernorm_after", "mlp")),
    "GPTNeoXLayer": (("input_layernorm", "attention"), ("post_attention_layernorm", "mlp")),
}

_REMAT_CLASSES = {}


def remat_attention_class(stock_class):
    """The remat class of a stock transformers attention class: Remat<Name>(mixin, stock)."""
    cls = _REMAT_CLASSES.get(stock_class)
    if cls is None:
        name = f"Remat{stock_class.__name__}"
        cls = type(name, (ATTENTION_RULES[stock_class.__name__], stock_class),
                   {"remat_stock": stock_class, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # importable by name, so a converted model pickles
        _REMAT_CLASSES[stock_class] = cls
    return cls


def _attention_reason(module):
    """None when `module` can take the remat path, else why it is left alone."""
    mixin = ATTENTION_RULES[type(module).__name__]
    head_dim_attr, projections, transposed = _ATTENTION_PARTS[mixin]
    if hook_reason(module):
        return hook_reason(module)
    if getattr(module, "is_cross_attention", False):
        return "cross-attention (keys and values from the encoder)"
    expected = (head_dim_attr, "scaling", "config", "is_causal", *projections)
    missing = [n for n in expected if not hasattr(module, n)]
    if missing:
        return f"lacks the expected attributes {', '.join(missing)}"
    layers = [getattr(module, n) for n in projections]
    for n, m in zip(projections, layers, strict=True):
        if transposed and not _is_conv1d(m):
            return f"{n} is {type(m).__name__}, not transformers Conv1D"
        if not transposed and type(m) is not nn.Linear:
            return f"{n} is {type(m).__name__}, not exactly nn.Linear"
        if hook_reason(m):
            return f"{n} {hook_reason(m)}"
    head_dim = getattr(module, head_dim_attr)
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} is not one of remat's kernel head dims {HEAD_DIMS}"
    parameters = _signature(type(module)).parameters
    needed = ["attention_mask", *filter(None, [mixin.remat_cache_arg]), *mixin.remat_extra_args]
    if any(n not in parameters for n in needed):
        return f"the forward's arguments are not {', '.join(needed)}: this transformers version differs"
    return uniform_reason(*layers)


def _remat_attention(module, norm, recompute):
    new = _with_class(module, remat_attention_class(type(module)))
    new.__dict__["remat_norm"], new.__dict__["remat_recompute"] = norm, recompute
    return new


def _fused_layer_norm(norm):
    return _with_class(norm, RematFusedLayerNorm)


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


def _swap_probe(owner, swaps, width, param, remat_attention=None):
    """None when owner(x) is unchanged with `swaps` ({child name: new module}) in place, and the
    remat path of `remat_attention` (when given) is what ran; else why not."""
    if param.is_meta:
        return None  # nothing to run on: not probed, as _probe
    originals = {name: owner._modules[name] for name in swaps}
    extra = _probe_kwargs(owner, param)
    trace = []

    def after(x):
        owner._modules.update(swaps)
        if remat_attention is not None:
            remat_attention.__dict__["remat_trace"] = trace
        try:
            return _first_output(owner(x, **extra))
        finally:
            owner._modules.update(originals)
            if remat_attention is not None:
                del remat_attention.__dict__["remat_trace"]

    reason = _probe(lambda x: _first_output(owner(x, **extra)), after, width, param,
                    [owner, *swaps.values()])
    if reason is None and remat_attention is not None and trace != [None]:
        reason = f"the probe call did not take the remat path ({trace[0] if trace else 'not called'})"
    return reason


def _attention_probe(module, new, width, param):
    """Probe of a swapped attention on its own (no LayerNorm fused): its remat path against the stock forward."""
    if param.is_meta:
        return None  # nothing to run on: not probed, as _probe
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
    first = getattr(module, _ATTENTION_PARTS[ATTENTION_RULES[type(module).__name__]][1][0])
    return _widths(first, _is_conv1d(first))[0], first.weight


def _attention_row(path, name, module, norm_name=None):
    fused = f"; {norm_name} fused into its q/k/v projection (its output is not kept)" if norm_name else ""
    return (_join(path, name), module, f"swapped to Remat{type(module).__name__}",
            "remat.attention" + fused + "; the stock forward for padding masks, KV caches with past keys, "
            "output_attentions, dropout in training and other implementations than sdpa/eager")


def _attention_rule(parent, name, module, recompute, path, report):
    """Swap a stock attention module (no LayerNorm fused); returns the reason when it is not swapped."""
    reason = _attention_reason(module)
    if reason is None:
        new = _remat_attention(module, None, recompute)
        new.train(module.training)
        width, param = _attention_width(module)
        reason = _attention_probe(module, new, width, param)
    if reason:
        return reason
    parent._modules[name] = new
    report.add(*_attention_row(path, name, module))
    return None


def _fusable_norm(layer, norm_name, width, layers):
    norm = layer._modules.get(norm_name)
    if "layernorm" not in layers:
        return None, "layers excludes layernorm"
    if type(norm) is not nn.LayerNorm:
        return None, f"{norm_name} is {type(norm).__name__}, not exactly nn.LayerNorm"
    return norm, layer_norm_fusable(norm, width) or hook_reason(layer)


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
    width, param = _attention_width(module)
    norm, norm_reason = _fusable_norm(layer, norm_name, width, layers)
    if norm_reason is None:
        fused_norm = _fused_layer_norm(norm)
        new = _remat_attention(module, fused_norm, recompute)
        new.train(module.training)
        norm_reason = _swap_probe(layer, {norm_name: fused_norm, attn_name: new}, width, param, new)
        if norm_reason is None:
            layer._modules[norm_name], layer._modules[attn_name] = fused_norm, new
            report.add(*_attention_row(path, attn_name, module, norm_name))
            report.add(_join(path, norm_name), norm, "swapped to RematFusedLayerNorm",
                       f"applied inside {attn_name}, fused into its q/k/v projection; returns its input")
            return {norm_name, attn_name}
    if norm is not None and norm_reason != "layers excludes layernorm":
        report.add(_join(path, norm_name), norm, "skipped", f"fusion into {attn_name}: {norm_reason}")
    reason = _attention_rule(layer, attn_name, module, recompute, path, report)
    if reason:
        report.add(_join(path, attn_name), module, "skipped", reason)
    return {attn_name}


def _layer_mlp(layer, norm_name, mlp_name, layers, recompute, path, report):
    """Swap the MLP of a pre-LN layer with its LayerNorm fused in; the names handled (none when the
    plain MLP rule should run instead)."""
    module = layer._modules.get(mlp_name)
    if type(module).__name__ not in MLP_RULES or not _from_transformers(module) or "mlp" not in layers:
        return set()
    fc1_name, _, _, _, transposed = MLP_RULES[type(module).__name__]
    fc1 = getattr(module, fc1_name, None)
    if fc1 is None:
        return set()
    width = _widths(fc1, transposed)[0]
    norm, reason = _fusable_norm(layer, norm_name, width, layers)
    if reason is None:
        reason = layer_norm_fusable(norm, width, need_bias=True)
    if reason is None:
        fused_norm = _fused_layer_norm(norm)
        new, reason = _mlp_candidate(module, recompute, fused_norm)
        if reason is None:
            reason = _swap_probe(layer, {norm_name: fused_norm, mlp_name: new}, width, fc1.weight)
        if reason is None:
            layer._modules[norm_name], layer._modules[mlp_name] = fused_norm, new
            report.add(*_mlp_row(path, mlp_name, module, new, norm_name))
            report.add(_join(path, norm_name), norm, "swapped to RematFusedLayerNorm",
                       f"applied inside {mlp_name}, fused into {fc1_name}; returns its input")
            return {norm_name, mlp_name}
    if norm is not None and reason != "layers excludes layernorm":
        report.add(_join(path, norm_name), norm, "skipped", f"fusion into {mlp_name}: {reason}")
    return set()  # the MLP on its own, by the plain rule


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
    reason = hook_reason(inter) or hook_reason(out) or hook_reason(layer)
    if reason is None and not callable(getattr(layer, "feed_forward_chunk", None)):
        reason = f"{type(layer).__name__} has no feed_forward_chunk to check the FFN wiring against"
    if reason is None:
        reason = _mlp_reason(fc1, act, fc2, dropout, False) if isinstance(fc1, nn.Module) and \
            isinstance(fc2, nn.Module) else "dense layers missing"
    if reason is None and not isinstance(norm, nn.LayerNorm):
        reason = "output.LayerNorm is not an nn.LayerNorm"
    if reason is None:
        new_inter = RematPassthroughIntermediate(inter)
        new_out = RematBertOutput(out, inter, _gelu(act), recompute)
        new_inter.train(inter.training)
        new_out.train(out.training)
        before = layer.feed_forward_chunk

        def after(x):
            layer._modules[inter_name], layer._modules[out_name] = new_inter, new_out
            try:
                return layer.feed_forward_chunk(x)
            finally:
                layer._modules[inter_name], layer._modules[out_name] = inter, out

        reason = _probe(before, after, fc1.in_features, fc1.weight, [layer])
    if reason:
        report.add(row_path, inter, "skipped", f"{inter_name} + {out_name} FFN: {reason}")
        return set()
    layer._modules[inter_name], layer._modules[out_name] = new_inter, new_out
    report.add(row_path, inter, "swapped to RematPassthroughIntermediate",
               f"FFN fused into {out_name}; returns its input")
    report.add(_join(path, out_name), out, "swapped to RematBertOutput",
               f"LayerNorm(dropout(dense(gelu({inter_name}.dense(x)))) + input): the GELU output is not kept")
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
    return handled
