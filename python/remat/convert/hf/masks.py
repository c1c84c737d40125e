"""BLOOM's attention mask read as remat's attention calls (bloom.py): the one attention remat swaps
that is handed a materialised (batch, 1, seq, seq) mask (the others run through the attention
interface, whose masks are never (B, S, S), interface.py). Bool (True = visible) or float (0
visible, -inf or the dtype's minimum hidden). Its pattern decides the call:
- "causal": remat.attention, causal;
- a Packing: causal attention within runs of kept tokens: padding (right or left), packed sequences
  (position_ids that restart, as with DataCollatorWithFlattening), or both:
  remat.attention_varlen on the tokens the mask keeps;
- None: anything else, which runs the stock attention.

Every pattern is checked exactly: the mask it implies is rebuilt and compared entry by entry with
the one given, so a call never computes what the stock attention would not. The one difference is
where the stock attention computes nothing anyone reads: rows of padding tokens (queries that are
no sequence's tokens) get a zero attention output, as in Hugging Face's FlashAttention path (stock
gives them some average of the keys they happen to see); loss and gradients over the real tokens
are the stock ones.

The check synchronises with the device; the result is kept for the mask object (every layer of a
model is handed the same one), keyed on its version, so it runs once per forward.
"""

import collections
import weakref
from typing import NamedTuple

import torch

from ...ops.attention_varlen import attention_varlen


class Packing(NamedTuple):
    """The tokens a causal padding or packing mask lets attend, as packed sequences: rows, the
    (batch indices, positions) of the packed tokens, in order; cu_seqlens, int32 cumulative lengths;
    max_seqlen, the longest."""

    rows: tuple
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _visible_entries(mask, seq):
    """The mask's visible entries as bool (B, seq, seq), or None when it is no (B, 1, seq, seq) mask
    that only shows or hides (a float mask with other values biases the scores)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[1:]) != (1, seq, seq):
        return None
    entries = mask[:, 0]
    if mask.dtype == torch.bool:
        return entries
    if not mask.is_floating_point():
        return None
    visible = entries == 0
    hidden = (entries == float("-inf")) | (entries == torch.finfo(mask.dtype).min)
    return visible if bool((visible | hidden).all()) else None


def _causal_packing(visible):
    """A Packing when `visible` (B, S, S) is, per batch row, causal attention within contiguous
    runs of kept tokens, else None."""
    batch, seq, _ = visible.shape
    device = visible.device
    kept = visible.any(dim=1)  # (B, S): the tokens some query sees, i.e. the real ones
    # A sequence starts at every real token that does not see the token before it (inside a
    # sequence the token before is real, and visible to a causal row); the sequences are numbered
    # along each batch row. A padding row is named after the last key it sees (right padding sees
    # its sequence), or after nothing (-1 - its position).
    starts = torch.ones(batch, seq, dtype=torch.bool, device=device)
    starts[:, 1:] = ~visible.diagonal(offset=-1, dim1=1, dim2=2)
    numbers = starts.cumsum(dim=1)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    last_seen = seq - 1 - visible.flip(-1).to(torch.uint8).argmax(dim=-1)
    names = torch.where(kept, numbers,
                        torch.where(visible.any(dim=-1), numbers.gather(1, last_seen), -1 - positions))
    same = names[:, :, None] == names[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if not bool(torch.equal(visible, kept[:, None, :] & same & causal)):
        return None
    batch_index, position = kept.nonzero(as_tuple=True)  # row-major: each batch row's tokens in order
    sequence = names[batch_index, position]
    starts = torch.ones_like(position, dtype=torch.bool)
    starts[1:] = (batch_index[1:] != batch_index[:-1]) | (sequence[1:] != sequence[:-1])
    # Causal positions inside a sequence must be consecutive: a hole (a hidden token inside a
    # sequence) would shift them.
    if bool((~starts[1:] & (position[1:] != position[:-1] + 1)).any()):
        return None
    bounds = torch.cat([starts.nonzero().squeeze(1), position.new_tensor([position.numel()])])
    lengths = bounds[1:] - bounds[:-1]
    return Packing((batch_index, position), bounds.to(torch.int32), int(lengths.max()) if lengths.numel() else 0)


def _pattern(mask, seq):
    visible = _visible_entries(mask, seq)
    if visible is None or bool(visible.triu(1).any()):  # a key right of the diagonal: not causal
        return None
    if bool(torch.equal(visible, torch.ones_like(visible[0]).tril().expand_as(visible))):
        return "causal"
    return _causal_packing(visible)


_RECENT = collections.OrderedDict()  # id(mask) -> (weak reference, version, seq, pattern)
_RECENT_SIZE = 8


def causal_pattern(mask, seq):
    """"causal", a Packing, or None for the 4-D attention `mask` of a self-attention over `seq`
    tokens (see the module docstring)."""
    recent = _RECENT.get(id(mask))
    if recent is not None and recent[0]() is mask and recent[1] == mask._version and recent[2] == seq:
        return recent[3]
    pattern = _pattern(mask, seq)
    if isinstance(mask, torch.Tensor):
        _RECENT[id(mask)] = (weakref.ref(mask), mask._version, seq, pattern)
        while len(_RECENT) > _RECENT_SIZE:
            _RECENT.popitem(last=False)
    return pattern


def packed_attention(q, k, v, packing, softmax_scale, output, features):
    """output(o) of causal remat.attention_varlen on the tokens `packing` keeps of q, k, v (B, H, S, D),
    as (B, S, width): output maps (1, tokens, H * D) to (1, tokens, width) (the output projection),
    and is applied to the packed rows only; the rows of no sequence get zeros (see the docstring)."""
    batch, heads, seq, head_dim = q.shape
    q, k, v = (t.transpose(1, 2)[packing.rows] for t in (q, k, v))  # (tokens, H, D)
    o = attention_varlen(q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_seqlen, packing.max_seqlen,
                         causal=True, softmax_scale=softmax_scale, **features)
    out = output(o.flatten(1).unsqueeze(0))[0]
    return out.new_zeros(batch, seq, out.shape[-1]).index_put(packing.rows, out)
