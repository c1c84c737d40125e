"""What a Hugging Face attention mask asks of remat's attention, read from the 4-D mask itself.

transformers hands sdpa and eager attention a materialised (batch, 1, seq_q, seq_k) mask: bool
(True = visible) for sdpa, float (0 visible, -inf or the dtype's minimum hidden) for eager. Its
pattern decides the call:
- "full" or "causal": remat.attention, plain or causal;
- a Packing: padding (right or left), packed sequences (the block-diagonal mask transformers builds
  from position_ids that restart, as with DataCollatorWithFlattening), or both:
  remat.attention_varlen on the tokens the mask keeps;
- None: anything else (an arbitrary mask), which runs the stock attention.

Every pattern is checked exactly: the mask it implies is rebuilt and compared entry by entry with
the one given, so a call never computes what the stock attention would not. The one difference is
where the stock attention computes nothing anyone reads: rows of padding tokens in a causal mask
(queries that are no sequence's tokens) get a zero attention output, as in Hugging Face's
FlashAttention path (stock gives them some average of the keys they happen to see); loss and
gradients over the real tokens are the stock ones. A bidirectional padding mask loses nothing:
every query row, padding included, sees the kept keys as in stock.

The check synchronises with the device; the result is kept for the mask object (every layer of a
model is handed the same one), keyed on its version, so it runs once per forward.
"""

import collections
import weakref
from typing import NamedTuple

import torch

from ...ops.attention_varlen import attention_varlen


class Packing(NamedTuple):
    """The tokens a padding or packing mask lets attend, as packed sequences.

    rows_q / rows_k: (batch indices, positions) of the packed queries / keys, in order; rows_q None
    when every query row takes part (a bidirectional mask: each row of batch b is one query of
    sequence b). cu_seqlens_*: int32 cumulative lengths; max_seqlen_*: the longest."""

    causal: bool
    rows_q: tuple | None
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    rows_k: tuple
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int


def _visible_entries(mask, seq_q, seq_k):
    """The mask's visible entries as bool (B, heads, seq_q, seq_k), or None when it is no 4-D mask of
    that size that only shows or hides (a float mask with other values biases the scores)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (seq_q, seq_k):
        return None
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    visible = mask == 0
    hidden = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    return visible if bool((visible | hidden).all()) else None


def _causal(seq_q, seq_k, device):
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(seq_k - seq_q)


def _dense_pattern(visible, seq_q, seq_k):
    """"full" or "causal" when every batch row is that, else None."""
    if bool(visible.all()):
        return "full"
    causal = _causal(seq_q, seq_k, visible.device)
    if bool(torch.equal(visible, causal.expand_as(visible))):
        return "causal"
    return None


def _cu_seqlens(starts, total):
    """int32 cumulative lengths and the longest, for sequences starting at the packed rows `starts`."""
    bounds = torch.cat([starts, starts.new_tensor([total])])
    lengths = bounds[1:] - bounds[:-1]
    return bounds.to(torch.int32), int(lengths.max()) if lengths.numel() else 0


def _causal_packing(visible):
    """A causal Packing when `visible` (B, S, S) is, per batch row, causal attention within
    contiguous runs of kept tokens, else None."""
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
    causal = _causal(seq, seq, device)
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
    cu_seqlens, longest = _cu_seqlens(starts.nonzero().squeeze(1), position.numel())
    rows = (batch_index, position)
    return Packing(True, rows, cu_seqlens, longest, rows, cu_seqlens, longest)


def _bidirectional_packing(visible):
    """A Packing when every query row of a batch row sees the same keys (bidirectional padding): the
    kept keys of batch row b are sequence b's, and all of its query rows are sequence b's queries."""
    batch, seq_q, seq_k = visible.shape
    kept = visible[:, 0]
    if not bool(torch.equal(visible, kept[:, None, :].expand_as(visible))):
        return None
    counts = kept.sum(dim=1)
    device = visible.device
    cu_seqlens_k = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    cu_seqlens_q = (torch.arange(batch + 1, device=device) * seq_q).to(torch.int32)
    return Packing(False, None, cu_seqlens_q, seq_q, kept.nonzero(as_tuple=True), cu_seqlens_k, int(counts.max()))


def _pattern(mask, seq_q, seq_k):
    visible = _visible_entries(mask, seq_q, seq_k)
    if visible is None:
        return None
    pattern = _dense_pattern(visible, seq_q, seq_k)
    if pattern is not None or visible.shape[1] != 1 or seq_q != seq_k:
        return pattern
    visible = visible[:, 0]
    if not bool(visible.triu(1).any()):  # nothing right of the diagonal: a causal mask
        return _causal_packing(visible)
    return _bidirectional_packing(visible)


_RECENT = collections.OrderedDict()  # id(mask) -> (weak reference, version, sizes, pattern)
_RECENT_SIZE = 8


def mask_pattern(mask, seq_q, seq_k):
    """"full", "causal", a Packing, or None for a 4-D attention mask (see the module docstring)."""
    key = (seq_q, seq_k)
    recent = _RECENT.get(id(mask))
    if recent is not None and recent[0]() is mask and recent[1] == mask._version and recent[2] == key:
        return recent[3]
    pattern = _pattern(mask, seq_q, seq_k)
    if isinstance(mask, torch.Tensor):
        _RECENT[id(mask)] = (weakref.ref(mask), mask._version, key, pattern)
        while len(_RECENT) > _RECENT_SIZE:
            _RECENT.popitem(last=False)
    return pattern


def _gather(t, rows):
    """(B, H, S, D) -> (rows, H, D): the packed rows of t (every row, in order, when rows is None)."""
    by_position = t.transpose(1, 2)
    return by_position.flatten(0, 1) if rows is None else by_position[rows]


def packed_attention(q, k, v, packing, softmax_scale, output, features):
    """output(o) of remat.attention_varlen on the tokens `packing` keeps of q, k, v (B, H, S, D),
    as (B, S, width): output maps (1, tokens, H * D) to (1, tokens, width) (the output projection),
    and is applied to the packed rows only; the rows of no sequence get zeros (see the docstring)."""
    batch, heads, seq, head_dim = q.shape
    o = attention_varlen(_gather(q, packing.rows_q), _gather(k, packing.rows_k), _gather(v, packing.rows_k),
                         packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q, packing.max_seqlen_k,
                         causal=packing.causal, softmax_scale=softmax_scale, **features)
    if packing.rows_q is None:
        return output(o.view(batch, seq, heads * head_dim))
    out = output(o.flatten(1).unsqueeze(0))[0]
    return out.new_zeros(batch, seq, out.shape[-1]).index_put(packing.rows_q, out)
