"""Variable-length attention cases: remat.attention_varlen on packed sequences of a realistic length mix.

The mix: lengths drawn log-uniformly between 1/32 of the longest and the longest (a fine-tuning
batch of documents of very different lengths; a fixed seed, so every run times the same batch),
causal. Against:
- remat.attention on the same batch padded to its longest sequence ("remat-padded": the kernel
  without the feature, computing the padding too);
- SDPA on the padded batch with the padding as a boolean mask, as Hugging Face's sdpa path runs
  a padded batch (flash and cuDNN take no such mask: SDPA runs its efficient or math backend);
- FlexAttention on the packed batch with a document mask (GPU only).
All take the packed (total, heads, head_dim) tensors: the padded ones gather into and out of the
padded layout inside the timed call (memory-bound copies, a few percent of the attention's time at
these sizes). FLOP model: 4·h·d per score computed, the scores being each sequence's causal
triangle (the padded implementations compute more, not counted: their TFLOP/s is useful work).
Checked against SDPA run on each sequence alone, and its float64 reference.
"""

import functools

import torch
import torch.nn.functional as F

import remat
from remat.ops.attention import _visible_mask
from remat.ops.attention_varlen import attention_varlen_ref, cu_seqlens_of

from .cases import Case, Check, Variant, op_built, ours_by_backend
from .check import outputs_and_grads

# (longest sequence, number of sequences, heads, head dim) per device type.
GPU_MIXES = ((4096, 16, 16, 128), (2048, 32, 16, 64))
CPU_MIXES = ((48, 4, 2, 32),)
SIZES_MEAN = "longest sequence lengths s (16 sequences, 16 heads of 128)"


def length_mix(longest, count, seed=0):
    """`count` lengths, log-uniform in [longest / 32, longest], the first one `longest` (fixed by seed)."""
    generator = torch.Generator().manual_seed(seed)
    low = max(1, longest // 32)
    logs = torch.rand(count, generator=generator) * (torch.log(torch.tensor(float(longest))) - torch.log(
        torch.tensor(float(low)))) + torch.log(torch.tensor(float(low)))
    lengths = logs.exp().round().clamp(low, longest).to(torch.int64).tolist()
    lengths[0] = longest
    return lengths


class _Batch:
    """The packed tensors of a length mix and the indices that pad them (B, longest) and back."""

    def __init__(self, lengths, heads, head_dim, dtype, device):
        self.lengths, self.longest = lengths, max(lengths)
        self.cu_seqlens = cu_seqlens_of(lengths, device)
        total = sum(lengths)
        self.q, self.k, self.v = (torch.randn(total, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                                  for _ in range(3))
        self.do = torch.randn(total, heads, head_dim, device=device, dtype=dtype)
        positions = torch.arange(self.longest, device=device)
        self.kept = positions[None, :] < torch.tensor(lengths, device=device)[:, None]  # (B, longest)
        self.padded_rows = self.kept.flatten().nonzero().squeeze(1)  # packed row r -> padded row
        causal = _visible_mask(self.longest, self.longest, device)
        self.mask = (causal[None] & self.kept[:, None, :])[:, None]  # (B, 1, longest, longest)

    def pad(self, t):
        """(total, H, D) -> (B, H, longest, D), zeros in the padding (differentiable)."""
        padded = t.new_zeros(len(self.lengths) * self.longest, *t.shape[1:]).index_copy(0, self.padded_rows, t)
        return padded.view(len(self.lengths), self.longest, *t.shape[1:]).transpose(1, 2)

    def unpad(self, o):
        return o.transpose(1, 2).flatten(0, 1).index_select(0, self.padded_rows)


def _remat_varlen(batch):
    return remat.attention_varlen(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, batch.longest,
                                  batch.longest, causal=True)


def _remat_padded(batch):
    o = remat.attention(batch.pad(batch.q), batch.pad(batch.k), batch.pad(batch.v), causal=True)
    return batch.unpad(o)


def _sdpa_padded(batch):
    o = F.scaled_dot_product_attention(batch.pad(batch.q), batch.pad(batch.k), batch.pad(batch.v), attn_mask=batch.mask)
    return batch.unpad(o)


def _per_sequence_sdpa(q, k, v, lengths):
    """SDPA on each sequence alone: the stock computation the check holds the others to."""
    outputs, start = [], 0
    for length in lengths:
        parts = (t[start:start + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outputs.append(F.scaled_dot_product_attention(*parts, is_causal=True)[0].transpose(0, 1))
        start += length
    return torch.cat(outputs)


@functools.cache
def _flex_compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_packed(batch):
    from torch.nn.attention.flex_attention import create_block_mask

    if not hasattr(batch, "block_mask"):
        document = torch.repeat_interleave(torch.arange(len(batch.lengths), device=batch.q.device),
                                           torch.tensor(batch.lengths, device=batch.q.device))
        total = document.shape[0]
        batch.block_mask = create_block_mask(lambda b, h, i, j: (document[i] == document[j]) & (i >= j), None, None,
                                             total, total, device=str(batch.q.device))
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (batch.q, batch.k, batch.v))
    return _flex_compiled()(q, k, v, block_mask=batch.block_mask)[0].transpose(0, 1)


def implementations(device):
    if device.type == "cuda":  # the Triton kernels and the CUDA extension's, each in its own rows
        impls = [Variant(name, True, _remat_varlen, backend) for name, backend in ours_by_backend(device)]
    else:
        impls = [Variant(f"remat-{remat._backend.choose('attention_varlen', device, kernels=('triton',))}", True,
                         _remat_varlen)]
    impls += [Variant("remat-padded", True, _remat_padded), Variant("sdpa-padded", False, _sdpa_padded)]
    if device.type == "cuda":
        impls.append(Variant("flex_attention", False, _flex_packed, compiles=True))
    return impls


def _build(mode):
    def wrap(fn):
        def build(batch):
            return op_built(mode, lambda: fn(batch), {"q": batch.q, "k": batch.k, "v": batch.v}, batch.do)

        return build

    return wrap


def _check(lengths):
    def stock(batch):
        return outputs_and_grads(lambda: _per_sequence_sdpa(batch.q, batch.k, batch.v, lengths),
                                 {"q": batch.q, "k": batch.k, "v": batch.v}, batch.do)

    def reference(batch):
        leaves = {name: t.detach().double().requires_grad_() for name, t in (("q", batch.q), ("k", batch.k),
                                                                             ("v", batch.v))}
        return outputs_and_grads(lambda: attention_varlen_ref(*leaves.values(), batch.cu_seqlens, batch.cu_seqlens,
                                                              causal=True)[0], leaves, batch.do.double())

    return Check(stock, reference)


_SHARED = {}


def _make_inputs(lengths, heads, head_dim, dtype, device):
    def make():
        key = (tuple(lengths), heads, head_dim, dtype, str(device))
        if key not in _SHARED:
            _SHARED.clear()
            _SHARED[key] = _Batch(lengths, heads, head_dim, dtype, device)
        return _SHARED[key]

    return make


def sanitize_calls(device, dtype):
    """The call bench/sanitize_check.py runs under compute-sanitizer: ragged sequences (an empty one,
    lengths not multiples of any block), GQA, causal, seqlen_q != seqlen_k per sequence."""
    cu_q, cu_k = cu_seqlens_of([5, 0, 37], device), cu_seqlens_of([9, 3, 40], device)
    q = torch.randn(42, 2, 64, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(52, 1, 64, device=device, dtype=dtype, requires_grad=True)
    yield functools.partial(remat.attention_varlen, q, k, k, cu_q, cu_k, 37, 40, causal=True)


_MODES = (("fwd", 1.0), ("bwd", 2.5), ("fwd+bwd", 3.5))


def cases(device, dtypes, quick, sizes=None):
    mixes = GPU_MIXES if device.type == "cuda" else CPU_MIXES
    if sizes:
        mixes = [(s, 16, 16, 128) for s in sizes]
    impls = implementations(device)
    for dtype in dtypes:
        for longest, count, heads, head_dim in mixes:
            lengths = length_mix(longest, count)
            scores = sum(n * (n + 1) // 2 for n in lengths)
            make_inputs = _make_inputs(lengths, heads, head_dim, dtype, device)
            check = _check(lengths)  # one for the three modes: they share the inputs and the reference
            for mode, factor in _MODES:
                yield Case(
                    op="attention_varlen_causal", mode=mode, dtype=dtype,
                    shape=f"{count} seqs ≤{longest} (total {sum(lengths)}) h={heads} d={head_dim}", size=longest,
                    unit="TFLOP/s", work=factor * 4 * heads * head_dim * scores, make_inputs=make_inputs,
                    implementations=[impl.implementation(_build(mode)) for impl in impls], check=check,
                )
