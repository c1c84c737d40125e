"""The CUDA attention kernels' numerics without a GPU: csrc/attention_kernels.cuh built for the CPU
against the warp emulator (tests/cuda_emulator/), which gives mma, ldmatrix, cp.async, shuffles and
__syncthreads their PTX semantics, one fiber per CUDA thread. The same kernel source as the GPU
build, the same launches (grid, block, shared memory) from its host code: what this checks is the
kernels' indexing, fragment layouts, masks, online softmax, pipelining and GQA, in both backwards
(the deterministic one's dQ kernel, and the one pass that adds dQ by atomics), and that no
ldmatrix has a bank conflict. Not checked here: speed, cp.async's store conflicts, and anything
the emulator cannot see (the GPU's exp2 approximation, ptxas). On a GPU, test_attention_cuda.py
runs the compiled kernels against the same references.
"""

import pytest
import torch

from remat.ops import attention as attn_ops
from remat.ops import attention_varlen as varlen_ops

from attention_checks import DROPOUT_SEED, assert_matches_float64, mask_revealing_inputs, masks_read_from
from cuda_emulator import (
    emulated_attention_bwd,
    emulated_attention_fwd,
    emulated_attention_varlen_bwd,
    emulated_attention_varlen_fwd,
    take_ldmatrix_extra_passes,
)

DTYPES = [torch.float16, torch.bfloat16]

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal). Blocks are 64 queries (16 a warp)
# by 64 keys (32 at head dim 128 in the backward): lengths 1, 17, 65, 129 leave ragged tails and
# several blocks; 80 and 40 run padded (to 96 and 64), 200 to 256. Head dim 256 reads q and
# dO from shared memory at each product, narrows the key blocks to 32 and splits each key block's
# dK/dV into two column halves.
CASES = [
    pytest.param((1, 2, 2, 17, 17, 32, False), id="plain-17-d32"),
    pytest.param((2, 2, 2, 65, 65, 64, True), id="causal-65"),
    pytest.param((1, 2, 2, 17, 129, 64, True), id="causal-q17-k129"),
    pytest.param((1, 2, 2, 129, 17, 64, True), id="causal-q129-k17-rows-without-keys"),
    pytest.param((1, 2, 2, 70, 130, 128, False), id="noncausal-q70-k130-d128"),
    pytest.param((1, 4, 1, 33, 33, 64, True), id="mqa"),
    pytest.param((1, 4, 2, 80, 50, 64, False), id="gqa"),
    pytest.param((1, 2, 1, 1, 1, 64, False), id="seq1"),
    pytest.param((1, 1, 1, 1, 70, 32, True), id="q1-causal"),
    pytest.param((1, 1, 1, 65, 65, 80, True), id="d80"),
    pytest.param((1, 1, 1, 40, 33, 96, False), id="d96"),
    pytest.param((1, 2, 2, 70, 70, 40, True), id="d40"),
    pytest.param((1, 1, 1, 130, 130, 128, True), id="causal-130-d128"),
    pytest.param((1, 2, 1, 70, 40, 256, True), id="gqa-causal-q70-k40-d256"),
    pytest.param((1, 1, 1, 33, 65, 200, False), id="noncausal-q33-k65-d200"),
]


def _inputs(shape, dtype):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal = shape
    q = torch.randn(batch, heads, seqlen_q, head_dim).to(dtype)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim).to(dtype)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim).to(dtype)
    do = torch.randn(q.shape).to(dtype)
    return q, k, v, do, causal


def _float64(q, k, v, do, causal, scale, *features):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, lse = attn_ops.attention_ref(*leaves, causal, scale, *features)
    o.backward(do.double())
    return (o, lse, *[t.grad for t in leaves])


def _emulated(q, k, v, do, causal, scale, *features, deterministic=True):
    """features: window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed
    (attention_fwd's order). DETERMINISTIC=False: the one-pass backward (dQ added by atomics)."""
    o, lse = emulated_attention_fwd(q, k, v, causal, scale, *features)
    return (o, lse, *emulated_attention_bwd(do, q, k, v, o, lse, causal, scale, *features,
                                            deterministic=deterministic))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64(case, dtype):
    q, k, v, do, causal = _inputs(case, dtype)
    scale = q.shape[-1] ** -0.5
    ours = _emulated(q, k, v, do, causal, scale)
    exactly_zero = {"dq", "dk"} if k.shape[2] == 1 else set()  # one key: P = 1, dS = 0
    assert_matches_float64(ours, _float64(q, k, v, do, causal, scale), dtype, exactly_zero)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "one-pass"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_ldmatrix_reads_have_no_bank_conflicts(head_dim, deterministic):
    """At every head dim compiled for, each ldmatrix of the forward and of both backwards (the
    one-pass one reads its dS block back too) reads its matrices' 8 rows from 8 different bank
    groups (the swizzle of swizzled<D>)."""
    q, k, v, do, causal = _inputs((1, 1, 1, 20, 20, head_dim, True), torch.float16)
    take_ldmatrix_extra_passes()
    _emulated(q, k, v, do, causal, 0.125, deterministic=deterministic)
    assert take_ldmatrix_extra_passes() == 0


# The one-pass backward at every head dim compiled for (200 padded to 256), with the key tail,
# rows that see no key, GQA, and the features (shape as CASES, then window_left, window_right,
# softcap, ALiBi, dropout_p as FEATURE_CASES).
ONE_PASS_CASES = [
    pytest.param((1, 2, 2, 17, 17, 32, False), -1, -1, 0.0, None, 0.0, id="plain-17-d32"),
    pytest.param((1, 2, 2, 129, 17, 64, True), -1, -1, 0.0, None, 0.0, id="causal-q129-k17-rows-without-keys"),
    pytest.param((1, 4, 2, 80, 50, 64, False), -1, -1, 0.0, None, 0.0, id="gqa"),
    pytest.param((1, 2, 2, 70, 130, 128, False), -1, -1, 0.0, None, 0.0, id="noncausal-q70-k130-d128"),
    pytest.param((1, 2, 1, 70, 40, 256, True), -1, -1, 0.0, None, 0.0, id="gqa-causal-q70-k40-d256"),
    pytest.param((1, 1, 1, 33, 65, 200, False), -1, -1, 0.0, None, 0.0, id="noncausal-q33-k65-d200"),
    pytest.param((1, 4, 2, 100, 130, 96, False), 40, 20, 2.0, "per-head", 0.2, id="dropout-and-all-gqa-d96"),
    pytest.param((2, 2, 2, 150, 90, 32, False), 10, 25, 3.0, "per-batch", 0.3, id="window-softcap-alibi-dropout"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case, window_left, window_right, softcap, alibi, dropout_p", ONE_PASS_CASES)
def test_one_pass_backward_matches_float64_and_the_deterministic_dk_dv_bitwise(case, window_left, window_right,
                                                                              softcap, alibi, dropout_p, dtype):
    """dQ added by atomics from the dK/dV kernel matches float64 as the dQ kernel's does; dK and
    dV, computed by the same code either way, are bitwise the deterministic backward's."""
    q, k, v, do, causal = _inputs(case, dtype)
    batch, heads = q.shape[:2]
    slopes = None if alibi is None else torch.rand((heads,) if alibi == "per-head" else (batch, heads))
    features = (window_left, window_right, softcap, slopes, dropout_p, DROPOUT_SEED)
    scale = q.shape[-1] ** -0.5
    one_pass = _emulated(q, k, v, do, causal, scale, *features, deterministic=False)
    exactly_zero = {"dq", "dk"} if k.shape[2] == 1 else set()
    assert_matches_float64(one_pass, _float64(q, k, v, do, causal, scale, *features), dtype, exactly_zero)
    deterministic = emulated_attention_bwd(do, q, k, v, *one_pass[:2], causal, scale, *features)
    assert torch.equal(one_pass[3], deterministic[1]) and torch.equal(one_pass[4], deterministic[2])


def test_rows_that_see_no_key_are_zero_with_lse_minus_infinity():
    q, k, v, do, _ = _inputs((1, 2, 2, 70, 20, 64, True), torch.float16)
    o, lse, dq, dk, dv = _emulated(q, k, v, do, True, 0.125)
    blind = 70 - 20  # query i sees key j iff j <= i - 50
    assert (o[:, :, :blind] == 0).all() and (dq[:, :, :blind] == 0).all()
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()


def test_strided_inputs():
    """q, k, v and do as views of larger tensors (other strides than contiguous), o as the forward
    laid it out: the kernels read through the strides."""
    dtype = torch.bfloat16
    base = torch.randn(1, 45, 3, 2, 64).to(dtype)  # (B, S, 3, H, D): packed qkv, as a fused projection gives
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn(1, 45, 2, 64).to(dtype).transpose(1, 2)
    ours = _emulated(q, k, v, do, True, 0.3)
    assert_matches_float64(ours, _float64(q, k, v, do, True, 0.3), dtype)
    contiguous = _emulated(*(t.contiguous() for t in (q, k, v, do)), True, 0.3)
    for a, b in zip(ours, contiguous):
        assert torch.equal(a, b)


def test_bitwise_deterministic():
    q, k, v, do, causal = _inputs((1, 4, 2, 100, 100, 64, True), torch.float16)
    first, second = _emulated(q, k, v, do, causal, 0.125), _emulated(q, k, v, do, causal, 0.125)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_large_scores_stay_finite():
    """Scores of several hundred (a large scale): the online softmax's rescaling and the
    backward's exp2(s - lse) must not overflow."""
    q, k, v, do, _ = _inputs((1, 1, 1, 70, 90, 64, False), torch.float16)
    ours = _emulated(q, k, v, do, False, 4.0)
    for t in ours:
        assert torch.isfinite(t).all()
    assert_matches_float64(ours, _float64(q, k, v, do, False, 4.0), torch.float16)


# (shape as CASES, window_left, window_right, softcap, ALiBi slopes: None, "per-head" or
# "per-batch", dropout_p). Windows narrower than a block skip whole key blocks (200 rows, left 20)
# and whole query blocks in dK/dV; Sq != Sk moves the diagonal both ways. Dropout with GQA sums
# each head's own mask into dK and dV.
FEATURE_CASES = [
    pytest.param((1, 2, 1, 200, 200, 64, True), 20, -1, 0.0, None, 0.0, id="causal-window-left20-skips-blocks"),
    pytest.param((1, 2, 2, 150, 90, 32, False), 10, 25, 0.0, None, 0.0, id="window-10-25-q150-k90"),
    pytest.param((1, 1, 1, 70, 130, 128, False), -1, 5, 0.0, None, 0.0, id="window-right5-q70-k130-d128"),
    pytest.param((1, 2, 2, 65, 129, 64, True), -1, -1, 2.0, None, 0.0, id="softcap"),
    pytest.param((1, 4, 2, 70, 70, 64, True), -1, -1, 0.0, "per-head", 0.0, id="alibi-per-head-gqa"),
    pytest.param((2, 2, 2, 33, 65, 32, False), -1, -1, 0.0, "per-batch", 0.0, id="alibi-per-batch"),
    pytest.param((1, 2, 1, 100, 80, 256, False), 30, 10, 3.0, "per-batch", 0.0, id="all-d256"),
    pytest.param((2, 4, 2, 129, 70, 64, True), -1, -1, 0.0, None, 0.17, id="dropout-gqa-causal"),
    pytest.param((1, 2, 2, 70, 130, 128, False), 40, 20, 5.0, "per-head", 0.5, id="dropout-and-all-d128"),
    pytest.param((1, 2, 1, 65, 50, 256, True), -1, -1, 0.0, None, 0.3, id="dropout-d256"),
    pytest.param((1, 4, 2, 100, 130, 96, False), 40, 20, 2.0, "per-head", 0.2, id="dropout-and-all-gqa-d96"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case, window_left, window_right, softcap, alibi, dropout_p", FEATURE_CASES)
def test_score_options_match_float64(case, window_left, window_right, softcap, alibi, dropout_p, dtype):
    q, k, v, do, causal = _inputs(case, dtype)
    batch, heads = q.shape[:2]
    slopes = None if alibi is None else torch.rand((heads,) if alibi == "per-head" else (batch, heads))
    features = (window_left, window_right, softcap, slopes, dropout_p, DROPOUT_SEED)
    scale = q.shape[-1] ** -0.5
    ours = _emulated(q, k, v, do, causal, scale, *features)
    assert_matches_float64(ours, _float64(q, k, v, do, causal, scale, *features), dtype)


@pytest.mark.parametrize("head_dim, seqlen_q, seqlen_k", [(128, 50, 70), (256, 150, 100)], ids=["d128", "d256"])
def test_dropout_draws_the_triton_kernels_mask_in_every_kernel(head_dim, seqlen_q, seqlen_k):
    """The masks the forward, dK/dV and dQ kernels draw (and the dK/dV kernel for the one-pass
    backward's dQ), read exactly from their outputs (attention_checks.mask_revealing_inputs), are
    each remat.ops.attention.dropout_keep_mask, the Triton kernels' (tests/ops/test_attention_dropout.py).
    Several blocks of queries and keys, two heads, two batches: every part of Philox's counter moves."""
    batch, heads, dropout_p = 2, 2, 0.5
    q, k, v, do, unit_keys = mask_revealing_inputs(batch, heads, seqlen_q, seqlen_k, head_dim, torch.float16)
    kept = attn_ops.dropout_keep_mask(DROPOUT_SEED, batch, heads, seqlen_q, seqlen_k, dropout_p)
    assert 0.4 < kept.float().mean() < 0.6
    features = (-1, -1, 0.0, None, dropout_p, DROPOUT_SEED)
    o, _, _, _, dv = _emulated(q, k, v, do, False, 0.125, *features)
    dq = _emulated(q, unit_keys, v, do, False, 0.125, *features)[2]
    one_pass_dq = _emulated(q, unit_keys, v, do, False, 0.125, *features, deterministic=False)[2]
    masks = (*masks_read_from(o, dv, dq, seqlen_k), masks_read_from(o, dv, one_pass_dq, seqlen_k)[2])
    for kernel, mask in zip(("forward", "dK/dV", "dQ", "one-pass dQ"), masks):
        assert torch.equal(mask, kept), kernel


def test_window_hides_keys_exactly():
    """A key outside every row's window gets zero dK and dV; a window of one key (left = right =
    0) is attention to the diagonal only: o = v there, lse = the scaled score."""
    q, k, v, do, _ = _inputs((1, 1, 1, 40, 100, 64, False), torch.float16)
    o, lse, dq, dk, dv = _emulated(q, k, v, do, False, 0.125, 0, 0, 0.0, None)
    diagonal = torch.arange(40) + 60  # query i's key
    torch.testing.assert_close(o[0, 0], v[0, 0, diagonal], rtol=0, atol=0)
    scores = (q[0, 0].float() * k[0, 0, diagonal].float()).sum(-1) * 0.125
    torch.testing.assert_close(lse[0, 0], scores, rtol=1e-5, atol=1e-5)
    assert (dk[0, 0, :60] == 0).all() and (dv[0, 0, :60] == 0).all()
    # One key a row: P = 1 and dS = dP - delta = 0 but for rounding (dP = dO . v by tensor cores,
    # delta = dO . o in another order): a few fp16 ulps of zero, where the scores' gradient would be ~1.
    torch.testing.assert_close(dq, torch.zeros_like(dq), rtol=0, atol=1e-5)


# Packed sequences: (lengths of q's sequences, of k's, heads, kv_heads, head_dim, causal, window,
# softcap, ALiBi, dropout_p). Empty sequences, one longer than a block (several blocks, its tail
# ragged), a causal sequence with more queries than keys (rows that see nothing), GQA, and every
# score option; dropout's mask counts the sequence as the batch index.
VARLEN_CASES = [
    pytest.param((5, 0, 70, 1), (9, 3, 70, 1), 2, 1, 64, True, (-1, -1), 0.0, None, 0.0, id="causal-gqa-empty"),
    pytest.param((130, 17), (40, 17), 2, 2, 32, True, (-1, -1), 0.0, None, 0.0, id="causal-q130-k40"),
    pytest.param((33, 65, 1), (65, 33, 2), 2, 2, 128, False, (-1, -1), 0.0, None, 0.0, id="noncausal-d128"),
    pytest.param((80, 20), (90, 20), 4, 2, 64, True, (12, -1), 3.0, "per-batch", 0.0, id="window-softcap-alibi"),
    pytest.param((40, 7), (30, 50), 2, 1, 256, False, (5, 9), 0.0, "per-head", 0.0, id="window-alibi-d256"),
    pytest.param((3, 0, 70, 33), (9, 4, 70, 20), 2, 1, 64, True, (-1, -1), 0.0, None, 0.25, id="dropout-gqa-causal"),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "one-pass"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths_q, lengths_k, heads, kv_heads, head_dim, causal, window, softcap, alibi, dropout_p",
                         VARLEN_CASES)
def test_packed_sequences_match_float64(lengths_q, lengths_k, heads, kv_heads, head_dim, causal, window, softcap,
                                        alibi, dropout_p, dtype, deterministic):
    cu_q, cu_k = varlen_ops.cu_seqlens_of(lengths_q), varlen_ops.cu_seqlens_of(lengths_k)
    q = torch.randn(sum(lengths_q), heads, head_dim).to(dtype)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim).to(dtype)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim).to(dtype)
    do = torch.randn(q.shape).to(dtype)
    batch = len(lengths_q)
    slopes = None if alibi is None else torch.rand((heads,) if alibi == "per-head" else (batch, heads))
    scale, features = head_dim ** -0.5, (*window, softcap, slopes, dropout_p, DROPOUT_SEED)
    sizes = (cu_q, cu_k, max(lengths_q), max(lengths_k), causal, scale)
    o, lse = emulated_attention_varlen_fwd(q, k, v, *sizes, *features)
    ours = (o, lse, *emulated_attention_varlen_bwd(do, q, k, v, o, lse, *sizes, *features,
                                                   deterministic=deterministic))

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = varlen_ops.attention_varlen_ref(*leaves, cu_q, cu_k, causal, scale, *features)
    o_ref.backward(do.double())
    assert_matches_float64(ours, (o_ref, lse_ref, *[t.grad for t in leaves]), dtype)


def test_packed_sequences_read_through_strides_and_each_gets_what_it_gets_alone():
    """q, k, v as views of one packed qkv projection (total, 3, H, D): the kernels read through
    the strides; and each sequence's o, lse and gradients are bitwise what the dense kernels give
    it alone (the same blocks, only the offsets differ)."""
    dtype, heads, head_dim, lengths = torch.float16, 2, 64, (70, 0, 33)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim).to(dtype)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    do = torch.randn(q.shape).to(dtype)
    cu = varlen_ops.cu_seqlens_of(lengths)
    sizes = (cu, cu, max(lengths), max(lengths), True, 0.125)
    o, lse = emulated_attention_varlen_fwd(q, k, v, *sizes)
    grads = emulated_attention_varlen_bwd(do, q, k, v, o, lse, *sizes)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if end == start:
            continue
        alone = [t[start:end].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, do)]
        want = _emulated(*alone, True, 0.125)
        got = [o[start:end], lse[:, start:end], *[g[start:end] for g in grads]]
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            b = b[0] if name == "lse" else b[0].transpose(0, 1)
            assert torch.equal(a, b), name
