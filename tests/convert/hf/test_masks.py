"""The causal mask patterns BLOOM's attention reads (remat.convert.hf.masks): each pattern recognised
exactly, everything else refused, the result kept per mask object, and packed attention's output
(tests/convert/hf/test_hf_families.py runs BLOOM on padded and packed batches)."""

import pytest
import torch

import remat
from remat.convert.hf import masks

SEQ = 8


def causal_mask(kept, segments=None, window=None):
    """(B, 1, S, S) bool as transformers builds it: causal, keys `kept` (B, S), within `segments` (B, S)
    (packing: equal ids attend), and `window` keys back at most (a sliding window: no pattern here)."""
    batch, seq = kept.shape
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    visible = (j <= i)[None] & kept[:, None, :]
    if segments is not None:
        visible &= segments[:, :, None] == segments[:, None, :]
    if window is not None:
        visible &= (i - j <= window)[None]
    return visible[:, None]


def as_float(mask):
    """The eager attention's form of a bool mask: 0 where visible, the dtype's minimum where hidden."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def lengths(packing):
    return (packing.cu_seqlens[1:] - packing.cu_seqlens[:-1]).tolist()


@pytest.mark.parametrize("dtype", ["bool", "float"])
def test_right_and_left_padding_are_causal_sequences_of_the_real_tokens(dtype):
    kept = torch.ones(3, SEQ, dtype=torch.bool)
    kept[0, 5:] = False  # right padding
    kept[1, :2] = False  # left padding
    mask = causal_mask(kept)
    packing = masks.causal_pattern(mask if dtype == "bool" else as_float(mask), SEQ)
    assert isinstance(packing, masks.Packing)
    assert lengths(packing) == [5, 6, 8] and packing.max_seqlen == 8
    assert packing.cu_seqlens.dtype == torch.int32
    batch_index, position = packing.rows
    assert torch.equal(torch.stack([batch_index, position]), torch.stack(kept.nonzero(as_tuple=True)))


def test_packed_sequences_are_causal_sequences_and_a_window_is_refused():
    """Sliding windows reach remat through the attention interface's sliding_window (interface.py),
    never through a mask: a windowed mask is no pattern BLOOM's attention computes."""
    kept = torch.ones(2, SEQ, dtype=torch.bool)
    kept[1, 6:] = False
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 2, 2]])
    assert lengths(masks.causal_pattern(causal_mask(kept, segments), SEQ)) == [3, 5, 2, 4]
    assert masks.causal_pattern(causal_mask(kept, segments, window=2), SEQ) is None
    assert masks.causal_pattern(causal_mask(torch.ones(2, SEQ, dtype=torch.bool), window=3), SEQ) is None


def test_a_causal_mask_stays_plain_and_a_bidirectional_one_is_refused():
    """BLOOM's ALiBi bias is remat.attention's under a causal mask only."""
    kept = torch.ones(2, SEQ, dtype=torch.bool)
    assert masks.causal_pattern(causal_mask(kept), SEQ) == "causal"
    assert masks.causal_pattern(as_float(causal_mask(kept)), SEQ) == "causal"
    assert masks.causal_pattern(torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool), SEQ) is None
    kept[0, 6:] = False
    assert masks.causal_pattern(kept[:, None, None, :].expand(2, 1, SEQ, SEQ), SEQ) is None


def test_other_masks_are_refused():
    kept = torch.ones(2, SEQ, dtype=torch.bool)
    kept[0, 3] = False  # a hole inside a sequence: its causal positions would shift
    assert masks.causal_pattern(causal_mask(kept), SEQ) is None
    arbitrary = causal_mask(torch.ones(2, SEQ, dtype=torch.bool)).clone()
    arbitrary[0, 0, 5, 2] = False  # one query that does not see one earlier key
    assert masks.causal_pattern(arbitrary, SEQ) is None
    biased = as_float(causal_mask(kept)) + 0.5  # a float mask that biases the scores
    assert masks.causal_pattern(biased, SEQ) is None
    per_head = causal_mask(kept).expand(2, 4, SEQ, SEQ)
    assert masks.causal_pattern(per_head, SEQ) is None


def test_the_pattern_is_read_once_per_mask_object_and_version(monkeypatch):
    kept = torch.ones(2, SEQ, dtype=torch.bool)
    kept[0, 6:] = False
    mask = causal_mask(kept)
    reads = []
    original = masks._pattern
    monkeypatch.setattr(masks, "_pattern", lambda *args: reads.append(1) or original(*args))
    first = masks.causal_pattern(mask, SEQ)
    assert masks.causal_pattern(mask, SEQ) is first and len(reads) == 1
    mask[1, 0, :, 7] = False  # changed in place: read again
    assert masks.causal_pattern(mask, SEQ) is not first and len(reads) == 2
    assert lengths(masks.causal_pattern(mask, SEQ)) == [6, 7]


def test_packed_attention_gives_each_sequence_its_attention_and_padding_rows_zero():
    kept = torch.ones(2, SEQ, dtype=torch.bool)
    kept[0, 5:] = False
    kept[1, :3] = False
    packing = masks.causal_pattern(causal_mask(kept), SEQ)
    q, k, v = (torch.randn(2, 2, SEQ, 32) for _ in range(3))
    out = masks.packed_attention(q, k, v, packing, 0.2, lambda o: 2 * o, {})
    assert out.shape == (2, SEQ, 64)
    assert torch.equal(out[~kept], torch.zeros_like(out[~kept]))
    for b in range(2):
        rows = kept[b]
        alone = remat.attention(q[b:b + 1, :, rows], k[b:b + 1, :, rows], v[b:b + 1, :, rows], causal=True,
                                softmax_scale=0.2)
        torch.testing.assert_close(out[b, rows], 2 * alone[0].transpose(0, 1).flatten(1), rtol=1e-5, atol=1e-6)
