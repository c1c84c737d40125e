"""remat's attention as a transformers attention implementation, named "remat".

transformers hands every attention that calls its attention interface (AttentionInterface, which
most model files use) q, k and v after the rotary embedding and the cache update, with the call's
scaling, dropout, sliding window, softcap, causality and attention sinks. `register()` adds "remat"
there and in AttentionMaskInterface, so that `from_pretrained(..., attn_implementation="remat")`,
`model.set_attn_implementation("remat")` and remat.convert run those calls on remat.attention and
remat.attention_varlen.

The mask. "remat"'s mask function is the flash-attention one wherever remat's kernels compute the
call: None when nothing is padded or packed, the 2-D (batch, keys) bool padding mask when something
is padded, and for packed sequences a 2-D (batch, seq) int32 tensor numbering each row's sequences
from 1 (never a (B, S, S) mask). Packing is what transformers' own mask says: it packs (its
find_packed_sequence_indices: a new sequence wherever a row's position_ids do not grow by 1, in
any row of any batch size) only without an attention_mask and without a cache, and then builds
its mask function from the sequences; remat's asks that mask function whether each token sees the
one before it, so that its sequences are exactly those sdpa's and eager's masks separate. Where
remat's kernels cannot compute the call (a query length other than the key length: decoding with
past keys, a static cache's padded buffer, cross-attention; a model's own overlay on the causal
mask, such as image tokens attending both ways), it is the sdpa mask, and the attention function
hands such a call to stock attention with that mask.

torch.compile: the varlen paths read sizes from the data (which tokens are kept, where sequences
start), which a graph cannot. While compiling, a call that may be padded or packed (an
attention_mask, or a mask transformers may have packed: no cache) gets sdpa's mask, and its
attention runs stock attention (fallbacks are not recorded inside a graph); a call with neither (a
cache made, as the config's default use_cache=True makes one, and no attention_mask) runs
remat.attention in the graph.

The attention function, per call:
- packed sequences (the mask's sequence numbers, over the whole batch: cu_seqlens over the
  flattened (batch x seq) tokens, a row's end always a sequence's end) and padding (unpad,
  remat.attention_varlen on the tokens, pad, with O(batch x seq) indices) run on attention_varlen,
  every other call on remat.attention; causal (or windowed) padding rows get zeros, as
  transformers' flash-attention path gives them; bidirectional ones see the kept keys, as in stock
  attention;
- q, k or v copied out of a fused qkv projection's output where the others are no views of it
  (ops/qk_norm_attention.own_views);
- causal or not (the call's is_causal, else the module's), GQA/MQA, scaling, training dropout
  (remat's own Philox mask: the distribution of stock dropout, not its draws), a sliding window of
  W keys as FlashAttention takes it (W - 1 before, and after when not causal), softcap;
- every keyword of the call is in KEYWORDS (implemented, refused or ignored, with why): one that is
  refused (attention sinks, T5's position_bias, sparse indices) or that remat does not know (a newer
  transformers') runs the call on stock attention, with the reason;
- stock attention (sdpa; the model's own eager function where sdpa cannot: softcap, attention
  sinks, attention weights, a keyword sdpa does not take), for a call with a 4-D mask, a refused or
  unknown keyword, attention weights requested, or on a GPU a head dim remat's Triton kernels lack,
  with the reason recorded (remat.convert's report, fallback_counts()).
A module's plain calls (no mask, its q/k norms not fused) keep remat.attention's flags, checked once for
the call's scalars (AttentionFlags, _kept_flags); the rest is asked at every call.
"""

import sys

import torch

from ..._guards import EXCLUDED, fallback
from ..._tensor_memo import MISSING, TensorMemo
from ...ops.attention import AttentionFlags, attention
from ...ops.attention import _fallback_reason as kernels_reason
from ...ops.attention_varlen import attention_varlen
from ...ops.qk_norm_attention import VarlenTokens, own_views
from ..swap import join
from . import head_norm

NAME = "remat"


def register():
    """Make "remat" an attention implementation of transformers (once; later calls do nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)


def convert_attention(model, path, report, attention_modules=()):
    """Make "remat" the attention implementation of the Hugging Face `model` (remat.convert), unless the
    config names another implementation than sdpa and eager, or the model does not take
    flash-attention-style masks (a forward that reworks the (B, 1, S, S) mask itself, as Doge's, or adds
    ALiBi to it, as Falcon's with alibi=True, or BLOOM's); the report says which.
    The q/k norms fuse_qk_norms fused (head_norm.py) need remat's attention function: where the
    model keeps another, they go back to stock, their rows saying why. attention_modules: (path,
    module) of the attention modules convert leaves as they are, a row each: kept where their attention
    function is remat's now, else skipped."""
    previous = model.config._attn_implementation
    switched = _switch_attention(model, path, report)
    for module_path, module in attention_modules:
        if switched:
            report.add(module_path, module, "kept", f"it runs as it is, its attention function remat's (the "
                                                    f"{NAME!r} implementation, was {previous!r})")
        else:
            report.add(module_path, module, "skipped", f"no remat rule for {type(module).__name__}: it runs as "
                                                       "it is, its attention function the model's attention "
                                                       "implementation")
    if not switched:
        head_norm.unfuse(model, report, f"the model's attention implementation stays "
                                        f"{model.config._attn_implementation!r}")


def _switch_attention(model, path, report):
    """convert_attention's switch: True when "remat" is the model's attention implementation now."""
    previous = model.config._attn_implementation
    if previous not in ("sdpa", "eager"):
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept (remat replaces sdpa "
                                           "and eager)")
        return False
    if getattr(model.config, "alibi", False):  # Falcon's: added onto a materialised (B, 1, S, S) mask
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept: alibi=True (the model adds "
                                           "its ALiBi bias to a (B, 1, S, S) mask, which remat's masks are not)")
        return False
    if not getattr(model, "_supports_flash_attn", False):  # its forward may read the mask as sdpa's (B, 1, S, S)
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept: the model does not take "
                                           "flash-attention-style masks (_supports_flash_attn), which remat's are")
        return False
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError, AttributeError) as error:  # the model does not call the interface
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept: {error}")
        return False
    model.__dict__["remat_attention_implementation"] = previous
    for name, module in model.named_modules():  # what each goes back to when reverted apart from the model
        module.__dict__["remat_attention_previous"] = previous  # (revert_attention)
        module.__dict__["remat_attention_path"] = join(path, name) if name else path  # what its warnings name
        module.__dict__.pop("remat_attention_stock", None)
        if EXCLUDED in vars(module):  # convert's filter_fn keeps it stock: its calls run the previous implementation
            module.__dict__["remat_attention_stock"] = previous
    report.add(path, model, f"attention implementation {previous!r} -> {NAME!r}", "every attention calling "
               "transformers' attention interface runs remat.attention")
    return True


def revert_attention(module):
    """Give the model `module` back the attention implementation it had before convert_attention. A
    module below such a model, reverted apart from it (remat.revert of one layer, as a plan does for
    the layers it keeps stock), keeps the model's "remat" implementation, which every layer reads
    from the shared config: its attention calls run the previous implementation's attention instead."""
    head_norm.unhook(module)
    previous = module.__dict__.pop("remat_attention_implementation", None)
    if previous is not None:
        module.set_attn_implementation(previous)
        for below in module.modules():
            for key in ("remat_attention_previous", "remat_attention_path", "remat_attention_stock",
                        "remat_attention_flags"):
                below.__dict__.pop(key, None)
    elif "remat_attention_previous" in module.__dict__:
        module.__dict__["remat_attention_stock"] = module.__dict__["remat_attention_previous"]
        module.__dict__.pop("remat_attention_flags", None)


# ---------------------------------------------------------------------------------------------
# The mask
# ---------------------------------------------------------------------------------------------


def attention_mask(**kwargs):
    """The mask transformers builds once per forward for "remat" (see the module's docstring)."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    if kwargs.get("use_vmap") or kwargs["q_length"] != kwargs["kv_length"]:
        return sdpa_mask(**kwargs)
    padding = kwargs.get("attention_mask")
    # transformers lets sdpa skip the mask (causal or bidirectional) unless its mask function holds
    # more than the causal or bidirectional pattern and the window: packed sequences, an overlay
    may_hold_more = not (kwargs.get("allow_is_causal_skip", True) or kwargs.get("allow_is_bidirectional_skip", False))
    if torch.compiler.is_compiling():  # the varlen paths' sizes are the data's: stock with sdpa's mask
        return None if padding is None and not may_hold_more else sdpa_mask(**kwargs)
    if not may_hold_more:
        return flash_attention_mask(**kwargs)
    sequences = _sequence_numbers(kwargs)
    if sequences is _OTHER_PATTERN or (sequences is not None and padding is not None):
        return sdpa_mask(**kwargs)
    return flash_attention_mask(**kwargs) if sequences is None else sequences


_OTHER_PATTERN = object()  # a mask function that is no causal or bidirectional pattern cut into sequences


def _sequence_numbers(kwargs):
    """(batch, seq) int32 numbers (from 1, per row) of the sequences transformers' mask function
    separates, None when it separates none, or _OTHER_PATTERN. A new sequence starts at each token
    that does not see the token before it; the pattern must be causal (no token sees the next one)
    or symmetric (each sees the next one exactly when the next sees it). The cu_seqlens of the
    numbers are remembered for the attention calls of this forward (_packing)."""
    batch, seq = kwargs["batch_size"], kwargs["q_length"]
    device = kwargs.get("device")
    if seq < 2 or (device is not None and torch.device(device).type == "meta"):
        return None  # (meta tensors hold no values to read: counted as one sequence, as transformers does)
    rows = torch.arange(batch, device=device)[:, None]
    heads = torch.arange(1, device=device)  # as sdpa_mask evaluates it: the head does not matter
    later = torch.arange(1, seq, device=device)[None, :]
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    mask_function = kwargs["mask_function"]
    sees_previous = mask_function(rows, heads, later + q_offset, later - 1 + kv_offset).expand(batch, seq - 1)
    sees_next = mask_function(rows, heads, later - 1 + q_offset, later + kv_offset).expand(batch, seq - 1)
    if sees_next.any() and not torch.equal(sees_next, sees_previous):
        return _OTHER_PATTERN
    if sees_previous.all():
        return None
    starts = torch.nn.functional.pad(~sees_previous, (1, 0), value=True)
    numbers = starts.cumsum(1, dtype=torch.int32)
    _remember_packing(numbers, _cu_seqlens(numbers))
    return numbers


# ---------------------------------------------------------------------------------------------
# The keywords of an attention call
# ---------------------------------------------------------------------------------------------

# Every keyword transformers' attention-interface calls pass (the model files' own, and the
# TransformersKwargs their forwards hand down), and what remat does with it, in one place:
# "implemented" (computed by remat's kernels), "refused" (the call runs stock attention: the reason,
# and whether sdpa takes the keyword, else the model's eager function computes it), "ignored" (it
# does not change the result: why). A keyword not here (a newer transformers') runs the call on
# stock attention too. A keyword given as None asks for nothing (a layer's arguments a forward hands
# down, as BERT's encoder_hidden_states in self-attention). tests/convert/hf/test_interface_keywords.py
# fails on a keyword of the installed transformers' model files missing here.
IMPLEMENTED = frozenset({"query", "key", "value", "attention_mask", "dropout", "scaling", "sliding_window", "softcap",
                         "is_causal",
                         "output_attentions"})  # weights requested: the model's eager attention (_weights_requested)
REFUSED = {  # keyword: (reason, sdpa takes it)
    "s_aux": ("attention sinks (s_aux)", False),
    "sinks": ("attention sinks (sinks)", False),
    "position_bias": ("an additive position bias (position_bias, as T5's relative attention)", True),
    "indices": ("sparse attention over selected keys (indices)", False),
    "block_indices": ("block-sparse attention (block_indices)", False),
}
IGNORED = {
    "position_ids": "packing is read from the mask transformers builds from them, as sdpa's and eager's",
    "cu_seq_lens_q": "sdpa and eager take packing from the mask (position_ids), not from these",
    "cu_seq_lens_k": "sdpa and eager take packing from the mask (position_ids), not from these",
    "max_length_q": "sdpa and eager take packing from the mask (position_ids), not from these",
    "max_length_k": "sdpa and eager take packing from the mask (position_ids), not from these",
    "seq_idx": "for state-space layers; attention takes packing from the mask",
    "use_cache": "the cache is updated before the call",
    "encoder_hidden_states": "a cross-attention's keys and values, which the call is handed, are made from it",
    "deterministic": "FlashAttention's choice of a deterministic backward, the same result",
    "num_items_in_batch": "for the loss",
    "output_hidden_states": "for the model's outputs",
    "output_router_logits": "for the model's outputs",
    "return_dict": "for the model's outputs",
}


def _keyword_reason(kwargs):
    """(why stock attention computes a call with these keywords, whether sdpa can), or None."""
    for name, value in kwargs.items():
        if value is None or name in IMPLEMENTED or name in IGNORED:
            continue
        if name in REFUSED:
            return REFUSED[name]
        return f"a keyword remat's attention does not know ({name}: a newer transformers'?)", False
    return None



# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """(output (batch, seq, heads, head_dim), None) of one attention call, as transformers' attention
    functions return it; query (batch, heads, seq, head_dim), key and value (batch, kv_heads, ...)."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _window(sliding_window, key.shape[2], causal)
    scalars = (causal, dropout, scaling, sliding_window, softcap)
    flags = _kept_flags(module, scalars) if attention_mask is None else None
    if flags is not None and _stock_reason_of_call(module, query, key, value, None, kwargs,
                                                   _keyword_reason(kwargs)) is None:
        return flags(*own_views(query, key, value), window).transpose(1, 2), None
    reverted = module.__dict__.get("remat_attention_stock")  # its layer reverted alone: stock, asked for
    reason, sdpa_can = (None, True) if reverted is not None else _stock_reason(module, query, key, value,
                                                                              attention_mask, kwargs)
    if reason is not None:
        path = module.__dict__.get("remat_attention_path")
        fallback(module, reason, where=f"{path} ({type(module).__name__})" if path else None, runs="stock attention")
    if reason is not None or reverted is not None:
        return _stock_attention(module, query, key, value, attention_mask, (causal, window), dropout=dropout,
                                scaling=scaling, sliding_window=sliding_window, softcap=softcap, is_causal=is_causal,
                                eager=reverted == "eager" or not sdpa_can, **kwargs)
    features = {"softmax_scale": scaling, "softcap": float(softcap or 0.0), "dropout_p": float(dropout),
                "window_size": window}
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return _packed_attention(module, query, key, value, _packing(attention_mask), causal, features), None
    if attention_mask is not None:
        return _padded_attention(module, query, key, value, attention_mask, causal, features), None
    fused = _fused(module, query, key, value, causal, features)
    if fused is not None:  # its q/k norms fused: q and k rebuilt from the projections' outputs in the backward
        return fused.transpose(1, 2), None
    query, key, value = own_views(query, key, value)  # (the varlen paths above gather copies)
    if torch.compiler.is_compiling():
        return attention(query, key, value, causal=causal, **features).transpose(1, 2), None
    kept = module.__dict__.get("remat_attention_flags")
    if kept is None or kept[0] != scalars:  # (kept ones for these scalars are reused: a q/k-norm module's calls)
        kept = module.__dict__["remat_attention_flags"] = scalars, AttentionFlags(
            causal, scaling, features["softcap"], features["dropout_p"])
    return kept[1](query, key, value, window).transpose(1, 2), None


def _kept_flags(module, scalars):
    """The AttentionFlags a plain call of `module` (no mask, its q/k norms not fused: remat.attention on
    the q, k and v it is handed) kept for these scalars (causal, dropout, scaling, sliding_window, softcap),
    else None: a call with other scalars, of a module reverted alone or whose q/k norms may be fused, or
    one torch.compile traces, takes the whole path. The call's tensors, keywords and the attention weights
    question are asked at every call (_stock_reason_of_call)."""
    kept = module.__dict__.get("remat_attention_flags")
    if kept is None or kept[0] != scalars or torch.compiler.is_compiling() or \
            "remat_attention_stock" in module.__dict__ or "remat_qk_call" in module.__dict__:
        return None
    return kept[1]


def _stock_reason(module, query, key, value, mask, kwargs):
    """(why stock attention computes this call, or None; whether sdpa can compute it: not with a
    keyword sdpa does not take, unless sdpa was the model's, which is then stock itself)."""
    keyword = _keyword_reason(kwargs)
    sdpa_can = keyword is None or keyword[1] or module.__dict__.get("remat_attention_previous") == "sdpa"
    return _stock_reason_of_call(module, query, key, value, mask, kwargs, keyword), sdpa_can


def _stock_reason_of_call(module, query, key, value, mask, kwargs, keyword):
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        if torch.compiler.is_compiling():
            return "while torch.compile traces, a padded batch or one transformers may pack (no cache): the " \
                   "varlen kernels' sizes depend on the data"
        return "a mask remat's kernels do not take (past keys, a static cache, or the model's own pattern)"
    if keyword is not None:
        return keyword[0]
    if value.shape[-1] != query.shape[-1]:
        return "v's head dim differs from q's (multi-head latent attention)"
    reason = kernels_reason(query, key, value)  # on a GPU: a head dim the kernels lack, an older GPU
    if reason is not None:  # (remat.attention would run SDPA, or its reference where it has features)
        return reason
    if mask is None and 1 < query.shape[2] != key.shape[2]:
        # sdpa aligns its causal mask top-left there (a static cache's prefill: the buffer's first
        # keys are the call's own); remat's kernels align it bottom-right, as FlashAttention
        return "more queries than one but fewer than the keys, without a mask (a static cache's prefill)"
    if _weights_requested(module, kwargs):
        return "attention weights requested (output_attentions)"
    return None


def attention_weights_requested(module, kwargs, implementation):
    """True when this attention call may be asked for its attention weights (output_attentions);
    `implementation`: the model's attention implementation before remat's, when known."""
    if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
        return True
    # transformers >= 5 collects the weights with forward hooks while a model-level
    # output_attentions=True call runs (and models may pop the argument before their layers, as
    # GPT-2 does); the active collector says whether this call's are collected.
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    if collector is None:
        return implementation == "eager"  # cannot tell: only eager returns weights
    collected = collector.get()
    return bool(collected) and "attentions" in collected


def _weights_requested(module, kwargs):
    """attention_weights_requested for an attention module of a model convert_attention converted."""
    return attention_weights_requested(module, kwargs, module.__dict__.get("remat_attention_previous"))


def _stock_attention(module, query, key, value, mask, pattern, softcap=None, eager=False, **kwargs):
    """The call on transformers' sdpa attention, or on the model file's own eager attention function
    where sdpa cannot (softcap, weights requested, a keyword sdpa does not take) or `eager` asks for
    it. A flash-style mask (None, 2-D padding or packed sequence numbers) is turned into the 4-D mask
    those take, where they need one: sdpa reads no mask as causal or not by itself, eager as all keys
    visible."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager_forward = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    use_eager = eager_forward is not None and (eager or softcap is not None or _weights_requested(module, kwargs))
    if eager and eager_forward is None and _keyword_reason(kwargs) is not None:
        raise NotImplementedError(f"{type(module).__name__}: {_keyword_reason(kwargs)[0]}, which sdpa does not take, "
                                  "and its model file has no eager attention function")
    causal, window = pattern
    if (mask is None and use_eager) or (mask is not None and mask.dim() == 2):
        mask = _dense_mask(query, key, mask, causal, window)
    if not use_eager:
        return sdpa_attention_forward(module, query, key, value, mask, softcap=softcap, **kwargs)
    if mask.dtype == torch.bool:  # eager attention adds its mask to the scores
        mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~mask, torch.finfo(query.dtype).min)
    extra = {"softcap": softcap} if softcap is not None else {}
    return eager_forward(module, query, key, value, mask, **extra, **kwargs)


def _dense_mask(query, key, flash_mask, causal, window):
    """(batch, 1, seq_q, seq_k) bool, True where a query sees a key, as stock attention reads a call
    without a 4-D mask: one query sees every key; more are causal aligned top-left, as sdpa's is_causal
    (a static cache's buffer holds the call's keys first; with as many keys as queries both alignments
    agree), within the sliding window; within the query's packed sequence (`flash_mask` int32
    sequence numbers); on kept keys (`flash_mask` bool). Built for the stock fallbacks only (they
    materialise the scores anyway)."""
    packed = flash_mask is not None and flash_mask.dtype != torch.bool
    padding = None if packed else flash_mask
    if padding is not None and key.shape[2] > padding.shape[1]:  # a static cache's buffer: its tokens first
        padding = torch.nn.functional.pad(padding, (0, key.shape[2] - padding.shape[1]))
    seq_q, seq_k = query.shape[2], key.shape[2]
    distance = torch.arange(seq_k, device=query.device)[None, :] - torch.arange(seq_q, device=query.device)[:, None]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=query.device)
    if causal and seq_q > 1:
        visible &= distance <= 0
    if window[0] >= 0:
        visible &= distance >= -window[0]
    if window[1] >= 0 and not causal:
        visible &= distance <= window[1]
    visible = visible.expand(query.shape[0], 1, seq_q, seq_k)
    if packed:  # the same sequence of the same row only
        visible = visible & (flash_mask[:, None, :, None] == flash_mask[:, None, None, :])
    if padding is not None:
        visible = visible & padding[:, -seq_k:].bool()[:, None, None, :]
    return visible



def _window(sliding_window, key_length, causal):
    """remat's window_size for transformers' sliding_window of W keys (a query sees itself and W - 1
    before; W - 1 after too when not causal), as FlashAttention takes it; none when every key fits."""
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


# ---------------------------------------------------------------------------------------------
# Packed sequences and padding: remat.attention_varlen on the tokens
# ---------------------------------------------------------------------------------------------


def _cu_seqlens(numbers):
    """(int32 cu_seqlens over the flattened (batch x seq) tokens, the longest sequence) of (batch, seq)
    sequence numbers: a sequence starts where a row's number changes, and at each row's start."""
    starts = torch.nn.functional.pad(numbers[:, 1:] != numbers[:, :-1], (1, 0), value=True).flatten()
    cu = torch.nn.functional.pad(starts.nonzero().flatten(), (0, 1), value=starts.numel()).to(torch.int32)
    return cu, int(cu.diff().max())


# The packing of the last masks built (a forward may build two: its full and its sliding-window
# layers' masks): every layer reads the same mask, whose cu_seqlens are read on the device once.
_LAST_PACKINGS = (TensorMemo(), TensorMemo())
_next_slot = [0]


def _remember_packing(numbers, packing):
    _LAST_PACKINGS[_next_slot[0]].put(numbers, packing)
    _next_slot[0] ^= 1


def _packing(numbers):
    """The (cu_seqlens, longest) of a mask's sequence numbers, remembered or read now."""
    for memo in _LAST_PACKINGS:
        packing = memo.get(numbers)
        if packing is not MISSING:
            return packing
    packing = _cu_seqlens(numbers)
    _remember_packing(numbers, packing)
    return packing


def _fused(module, query, key, value, causal, features, varlen=None):
    """head_norm.fused_attention of this call (None: its q/k norms are not fused into it)."""
    window = features["window_size"]
    return head_norm.fused_attention(module, query, key, value, causal, features["softmax_scale"],
                                     (*window, features["softcap"], features["dropout_p"]), varlen)


def _packed_attention(module, query, key, value, packing, causal, features):
    """remat.attention_varlen on packed sequences, over the tokens of every row: (batch, seq, heads, head_dim)."""
    cu, longest = packing
    batch, _, seq, _ = query.shape
    value_tokens = value.transpose(1, 2).flatten(0, 1)
    o = _fused(module, query, key, value_tokens, causal, features, VarlenTokens(None, cu, cu, longest,
                                                                                          longest))
    if o is None:
        o = attention_varlen(query.transpose(1, 2).flatten(0, 1), key.transpose(1, 2).flatten(0, 1), value_tokens, cu,
                             cu, longest, longest, causal=causal, **features)
    return o.view(batch, seq, *o.shape[1:])



def _padded_attention(module, query, key, value, mask, causal, features):
    """remat.attention_varlen on the tokens the 2-D mask (batch, keys) keeps. A padding row gets zeros
    where it is causal (as in transformers' flash-attention path) or windowed; else (bidirectional,
    every key in reach) it sees the kept keys, as in stock attention."""
    if key.shape[2] > mask.shape[1]:  # a static cache's buffer, longer than the tokens it holds
        key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
    batch, _, seq_q, _ = query.shape
    seq_k = key.shape[2]
    mask = mask[:, -seq_k:].bool()
    keys, cu_k, max_k = _kept_tokens(mask)
    if not causal and features["window_size"] == (-1, -1):
        # every row a query of its sequence (varlen aligns a window at the end of the keys: no window)
        head_norm.not_fused(module, "a padded batch attending both ways (its queries are every row)")
        cu_q = torch.arange(0, (batch + 1) * seq_q, seq_q, dtype=torch.int32, device=query.device)
        o = attention_varlen(query.transpose(1, 2).flatten(0, 1), _gather(key, keys), _gather(value, keys), cu_q, cu_k,
                             seq_q, max_k, causal=False, **features)
        return o.view(batch, seq_q, *o.shape[1:])
    value_tokens = _gather(value, keys)
    if seq_q != seq_k:
        head_norm.not_fused(module, "fewer queries than keys")
    o = _fused(module, query, key, value_tokens, causal, features,
               VarlenTokens(keys, cu_k, cu_k, max_k, max_k)) if seq_q == seq_k else None
    if o is None:
        queries, cu_q, max_q = (keys, cu_k, max_k) if seq_q == seq_k else _kept_tokens(mask[:, -seq_q:])
        o = attention_varlen(_gather(query, queries), _gather(key, keys), value_tokens, cu_q, cu_k, max_q, max_k,
                             causal=causal, **features)
    else:
        queries = keys
    out = o.new_zeros(batch * seq_q, *o.shape[1:]).index_copy(0, queries, o)
    return out.view(batch, seq_q, *o.shape[1:])


def _kept_tokens(mask):
    """(flat indices of the kept tokens, int32 cu_seqlens, the longest sequence) of a (batch, seq) mask."""
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return mask.flatten().nonzero().flatten(), cu, int(lengths.max()) if lengths.numel() else 0


def _gather(t, indices):
    """(batch, heads, seq, head_dim) -> the rows `indices` of its (batch * seq, heads, head_dim) tokens."""
    return t.transpose(1, 2).flatten(0, 1).index_select(0, indices)
