"""remat's attention as a transformers attention implementation, named "remat".

transformers hands every attention that calls its attention interface (AttentionInterface, which
most model files use) q, k and v after the rotary embedding and the cache update, with the call's
scaling, dropout, sliding window, softcap, causality and attention sinks. `register()` adds "remat"
there and in AttentionMaskInterface, so that `from_pretrained(..., attn_implementation="remat")`,
`model.set_attn_implementation("remat")` and remat.convert run those calls on remat.attention and
remat.attention_varlen.

The mask. "remat"'s mask function is the flash-attention one wherever remat's kernels compute the
call: None when nothing is padded, else the 2-D (batch, keys) padding mask, never a (B, S, S) one.
Where they cannot (a query length other than the key length: decoding with past keys, a static
cache's padded buffer, cross-attention; a model's own overlay on the causal mask, such as image
tokens attending both ways), it is the sdpa mask, and the attention function hands such a call to
stock attention with that mask.

The attention function, per call:
- packed sequences (the cu_seq_lens_q/k and max_length_q/k a DataCollatorWithFlattening passes, or
  position_ids that restart in a batch of one), when no cache is made (with one, transformers
  builds sdpa's and eager's masks without the packing: stock attends across the sequences, and so
  does remat), and padding (unpad, remat.attention_varlen on the
  tokens, pad, with O(batch x seq) indices) run on attention_varlen, every other call on
  remat.attention; causal (or windowed) padding rows get zeros, as transformers' flash-attention
  path gives them; bidirectional ones see the kept keys, as in stock attention;
- q, k or v copied out of a fused qkv projection's output where the others are no views of it (_own_views);
- causal or not (the call's is_causal, else the module's), GQA/MQA, scaling, training dropout
  (remat's own Philox mask: the distribution of stock dropout, not its draws), a sliding window of
  W keys as FlashAttention takes it (W - 1 before, and after when not causal), softcap;
- stock attention (sdpa; the model's own eager function where sdpa cannot: softcap, attention
  sinks, attention weights), for a call with a 4-D mask, attention sinks (s_aux), attention
  weights requested, or on a GPU a head dim remat's Triton kernels lack, with the reason recorded
  (remat.convert's report, fallback_counts()).
"""

import collections
import sys

import torch

from ..._guards import fallback
from ..._tensor_memo import MISSING, TensorMemo
from ...ops.attention import _fallback_reason as kernels_reason
from ...ops.attention import attention
from ...ops.attention_varlen import attention_varlen
from ..swap import join

NAME = "remat"


def register():
    """Make "remat" an attention implementation of transformers (once; later calls do nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)


def convert_attention(model, path, report):
    """Make "remat" the attention implementation of the Hugging Face `model` (remat.convert), unless it is
    of a family remat has rules for (they decide its attention: their attention classes compute on
    sdpa's or eager's calls, and some rework the mask), the config names another implementation than
    sdpa and eager, or the model does not take flash-attention-style masks (a forward that reworks the
    (B, 1, S, S) mask itself, as Doge's, or adds ALiBi to it, as Falcon's with alibi=True); the report
    says which."""
    from .registry import family_of

    previous = model.config._attn_implementation
    if any(family_of(m) is not None for m in model.modules()):
        return  # a family with rules (some of its modules swapped, or kept stock by a rule) decides its attention
    if previous not in ("sdpa", "eager"):
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept (remat replaces sdpa "
                                           "and eager)")
        return
    if getattr(model.config, "alibi", False):  # Falcon's: added onto a materialised (B, 1, S, S) mask
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept: alibi=True (the model adds "
                                           "its ALiBi bias to a (B, 1, S, S) mask, which remat's masks are not)")
        return
    if not getattr(model, "_supports_flash_attn", False):  # its forward may read the mask as sdpa's (B, 1, S, S)
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept: the model does not take "
                                           "flash-attention-style masks (_supports_flash_attn), which remat's are")
        return
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError, AttributeError) as error:  # the model does not call the interface
        report.add(path, model, "skipped", f"attention implementation {previous!r} kept: {error}")
        return
    model.__dict__["remat_attention_implementation"] = previous
    for name, module in model.named_modules():  # what each goes back to when reverted apart from the model
        module.__dict__["remat_attention_previous"] = previous  # (revert_attention)
        module.__dict__["remat_attention_path"] = join(path, name) if name else path  # what its warnings name
        module.__dict__.pop("remat_attention_stock", None)
    report.add(path, model, f"attention implementation {previous!r} -> {NAME!r}", "every attention calling "
               "transformers' attention interface runs remat.attention")
    _keep_attention_rows(report, previous)


def _keep_attention_rows(report, previous):
    """The rows of the attention modules without a rule (rules.INTERFACE_ATTENTION) become "kept": each
    runs as it is, its attention function remat's now."""
    from ..report import ReportRow
    from .rules import INTERFACE_ATTENTION

    for i, row in enumerate(report):
        if row.action == "skipped" and row.reason.endswith(INTERFACE_ATTENTION):
            report[i] = ReportRow(row.path, row.type, "kept", f"it runs as it is, its attention function remat's "
                                  f"(the {NAME!r} implementation, was {previous!r})")


def revert_attention(module):
    """Give the model `module` back the attention implementation it had before convert_attention. A
    module below such a model, reverted apart from it (remat.revert of one layer, as a plan does for
    the layers it keeps stock), keeps the model's "remat" implementation, which every layer reads
    from the shared config: its attention calls run the previous implementation's attention instead."""
    previous = module.__dict__.pop("remat_attention_implementation", None)
    if previous is not None:
        module.set_attn_implementation(previous)
        for below in module.modules():
            for key in ("remat_attention_previous", "remat_attention_path", "remat_attention_stock"):
                below.__dict__.pop(key, None)
    elif "remat_attention_previous" in module.__dict__:
        module.__dict__["remat_attention_stock"] = module.__dict__["remat_attention_previous"]


# ---------------------------------------------------------------------------------------------
# The mask
# ---------------------------------------------------------------------------------------------


def attention_mask(**kwargs):
    """The mask transformers builds once per forward for "remat" (see the module's docstring)."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    if kwargs.get("use_vmap") or kwargs["q_length"] != kwargs["kv_length"]:
        return sdpa_mask(**kwargs)
    return flash_attention_mask(**kwargs)


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """(output (batch, seq, heads, head_dim), None) of one attention call, as transformers' attention
    functions return it; query (batch, heads, seq, head_dim), key and value (batch, kv_heads, ...)."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _window(sliding_window, key.shape[2], causal)
    packed = _packed_lengths(query, kwargs)
    reverted = module.__dict__.get("remat_attention_stock")  # its layer reverted alone: stock, asked for
    reason = _stock_reason(module, query, key, value, attention_mask, s_aux, kwargs) if reverted is None else None
    if reason is not None:
        path = module.__dict__.get("remat_attention_path")
        fallback(module, reason, where=f"{path} ({type(module).__name__})" if path else None, runs="stock attention")
    if reason is not None or reverted is not None:
        return _stock_attention(module, query, key, value, attention_mask, (packed, causal, window), dropout=dropout,
                                scaling=scaling, sliding_window=sliding_window, softcap=softcap, is_causal=is_causal,
                                s_aux=s_aux, eager=reverted == "eager", **kwargs)
    features = {"softmax_scale": scaling, "softcap": float(softcap or 0.0), "dropout_p": float(dropout),
                "window_size": window}
    if packed is not None:
        return _packed_attention(query, key, value, packed, causal, features), None
    if attention_mask is not None:
        return _padded_attention(query, key, value, attention_mask, causal, features), None
    query, key, value = _own_views(query, key, value)  # (the varlen paths above gather copies of their tokens)
    return attention(query, key, value, causal=causal, **features).transpose(1, 2), None


def _own_views(query, key, value):
    """q, k and v, each a copy of itself where it is a view of a larger tensor that the three views of
    it do not cover: a fused qkv projection's output whose other parts were copied (the rotary
    embedding copies q and k: Phi-3, GPT-NeoX; a cache being filled copies k and v: GPT-2 in training,
    whose use_cache defaults to True). The attention keeps q, k and v for its backward, and a view
    keeps the whole projection output alive with it; its copy keeps its own part only. No copy
    without grad (nothing is kept) or while torch.compile traces (the graph's views are its own)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return query, key, value
    tensors = (query, key, value)
    covered = collections.Counter()  # id of a base -> the elements of it q, k and v view
    for t in tensors:
        if t._base is not None:
            covered[id(t._base)] += t.numel()
    return tuple(t if t._base is None or t._base.numel() <= covered[id(t._base)]
                 else t.clone(memory_format=torch.contiguous_format) for t in tensors)


def _stock_reason(module, query, key, value, mask, s_aux, kwargs):
    """Why stock attention computes this call, or None."""
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        return "a mask remat's kernels do not take (past keys, a static cache, or the model's own pattern)"
    if value.shape[-1] != query.shape[-1]:
        return "v's head dim differs from q's (multi-head latent attention)"
    reason = kernels_reason(query, key, value)  # on a GPU: a head dim the kernels lack, an older GPU
    if reason is not None:  # (remat.attention would run SDPA, or its reference where it has features)
        return reason
    if mask is None and 1 < query.shape[2] != key.shape[2]:
        # sdpa aligns its causal mask top-left there (a static cache's prefill: the buffer's first
        # keys are the call's own); remat's kernels align it bottom-right, as FlashAttention
        return "more queries than one but fewer than the keys, without a mask (a static cache's prefill)"
    if s_aux is not None:
        return "attention sinks (s_aux)"
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


def _stock_attention(module, query, key, value, mask, pattern, softcap=None, s_aux=None, eager=False, **kwargs):
    """The call on transformers' sdpa attention, or on the model file's own eager attention function
    where sdpa cannot (softcap, sinks, weights requested) or `eager` asks for it. A flash-style mask
    (None or 2-D) and packed sequences are turned into the 4-D mask those take, where they need one:
    sdpa reads no mask as causal or not by itself, eager as all keys visible."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager_forward = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    use_eager = eager_forward is not None and (eager or softcap is not None or s_aux is not None
                                               or _weights_requested(module, kwargs))
    packed, causal, window = pattern
    if (mask is None and (use_eager or packed is not None)) or (mask is not None and mask.dim() == 2):
        mask = _dense_mask(query, key, mask, packed, causal, window)
    if not use_eager:
        return sdpa_attention_forward(module, query, key, value, mask, softcap=softcap, **kwargs)
    if mask.dtype == torch.bool:  # eager attention adds its mask to the scores
        mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~mask, torch.finfo(query.dtype).min)
    extra = {name: value for name, value in (("softcap", softcap), ("s_aux", s_aux)) if value is not None}
    return eager_forward(module, query, key, value, mask, **extra, **kwargs)


def _dense_mask(query, key, padding, packed, causal, window):
    """(batch, 1, seq_q, seq_k) bool, True where a query sees a key, as stock attention reads a call
    without a 4-D mask: one query sees every key; more are causal aligned top-left, as sdpa's is_causal
    (a static cache's buffer holds the call's keys first; with as many keys as queries both alignments
    agree), within the sliding window; within the query's packed sequence; on kept keys. Built for the
    stock fallbacks only (they materialise the scores anyway)."""
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
    if packed is not None:  # a batch of one: the same sequence only
        bounds = packed[0][1:].long()
        sequence = torch.bucketize(torch.arange(seq_q, device=query.device), bounds, right=True)
        visible = visible & (sequence[:, None] == sequence[None, :])
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


def _packed_lengths(query, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of packed sequences in a batch of one, or None:
    from the collator's cu_seq_lens_q/k and max_length_q/k, else from position_ids that restart
    (read on the device: not while torch.compile traces, as transformers' flash path, nor on meta,
    which holds no positions to read: counted as one sequence). None when the model made a cache
    (use_cache): transformers then builds sdpa's and eager's mask without the packing, and their
    queries attend across the sequences, as remat's do."""
    if kwargs.get("use_cache"):
        return None
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if all(kwargs.get(name) is not None for name in names):
        cu_q, cu_k, max_q, max_k = (kwargs[name] for name in names)
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    positions = kwargs.get("position_ids")
    if positions is None or positions.is_meta or query.shape[0] != 1 or query.shape[2] == 1 \
            or torch.compiler.is_compiling() or positions.numel() != query.shape[2]:
        return None
    packed = _LAST_POSITIONS.get(positions)  # every layer gets the same position_ids: read them once a forward
    if packed is MISSING:
        packed = _restarts(positions.reshape(-1))
        _LAST_POSITIONS.put(positions, packed)
    return packed


_LAST_POSITIONS = TensorMemo()  # _restarts of the last position_ids read


def _restarts(positions):
    """(cu_seqlens, cu_seqlens, longest, longest) of the sequences 1-D `positions` restarts, or None."""
    starts = (positions == positions.min()).nonzero().flatten()
    if starts.numel() <= 1:
        return None
    cu = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def _packed_attention(query, key, value, packed, causal, features):
    """remat.attention_varlen on a batch of one holding packed sequences: (1, seq, heads, head_dim)."""
    cu_q, cu_k, max_q, max_k = packed
    o = attention_varlen(*(t[0].transpose(0, 1) for t in (query, key, value)), cu_q, cu_k, max_q, max_k,
                         causal=causal, **features)
    return o.unsqueeze(0)


def _padded_attention(query, key, value, mask, causal, features):
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
        cu_q = torch.arange(0, (batch + 1) * seq_q, seq_q, dtype=torch.int32, device=query.device)
        o = attention_varlen(query.transpose(1, 2).flatten(0, 1), _gather(key, keys), _gather(value, keys), cu_q, cu_k,
                             seq_q, max_k, causal=False, **features)
        return o.view(batch, seq_q, *o.shape[1:])
    queries, cu_q, max_q = (keys, cu_k, max_k) if seq_q == seq_k else _kept_tokens(mask[:, -seq_q:])
    o = attention_varlen(_gather(query, queries), _gather(key, keys), _gather(value, keys), cu_q, cu_k, max_q, max_k,
                         causal=causal, **features)
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
