"""remat.attention_varlen: packed variable-length sequences against float64, each sequence against the
dense kernel run on it alone, isolation between sequences, every feature, dropout, saved bytes and the
edge cases (empty sequences, no sequence). The ops' contract on samples: test_op_registry.py; bad input:
test_validation.py."""

import pytest
import torch

import remat
from remat.ops.attention_varlen import attention_varlen_ref, cu_seqlens_of

from attention_checks import assert_matches_float64
from numerics import saved_bytes

HAS_GPU = torch.cuda.is_available()
# bf16 on CPU too: the tests make the interpreter's bf16 tl.dot exact (conftest.py, numerics.py).
DTYPES = [torch.float16, torch.float32, torch.bfloat16]


def packed_inputs(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, device, q_gain=1.0):
    """q, k, v (requiring grad), do, cu_seqlens_q, cu_seqlens_k for sequences of those lengths."""
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = (q_gain * torch.randn(total_q, heads, head_dim, device=device)).to(dtype).requires_grad_()
    k, v = (torch.randn(total_k, kv_heads, head_dim, device=device).to(dtype).requires_grad_() for _ in range(2))
    do = torch.randn(total_q, heads, head_dim, device=device).to(dtype)
    return q, k, v, do, cu_seqlens_of(lengths_q, device), cu_seqlens_of(lengths_k, device)


def run_varlen(q, k, v, do, cu_q, cu_k, **keywords):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    max_q, max_k = (int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0 for cu in (cu_q, cu_k))
    o, lse = remat.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **keywords)
    o.backward(do)
    return (o, lse, *[t.grad for t in leaves])


def float64_varlen(q, k, v, do, cu_q, cu_k, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   dropout=(0.0, None)):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = attention_varlen_ref(*leaves, cu_q, cu_k, causal, None, *window_size, softcap, alibi_slopes, *dropout)
    o.backward(do.double())
    return (o, lse, *[t.grad for t in leaves])


# (query lengths, key lengths, heads, kv_heads, head_dim): ragged lengths around the interpreter's
# 16-row blocks, empty sequences, one-row sequences, seqlen_q != seqlen_k per sequence, GQA and MQA.
SHAPES = [
    pytest.param([1, 17, 0, 129], [1, 17, 0, 129], 2, 2, 32, id="1-17-0-129"),
    pytest.param([5, 33, 0], [40, 20, 7], 4, 2, 64, id="q-ne-k-gqa"),
    pytest.param([0, 0, 16], [3, 0, 16], 2, 1, 32, id="empties-mqa"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths_q, lengths_k, heads, kv_heads, head_dim", SHAPES)
def test_matches_float64(target, lengths_q, lengths_k, heads, kv_heads, head_dim, causal, dtype):
    device, _ = target
    inputs = packed_inputs(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, device)
    assert_matches_float64(run_varlen(*inputs, causal=causal), float64_varlen(*inputs, causal=causal), dtype)


# (keyword arguments, q_gain): each feature per sequence; windows of 0, 1, 17 and wider than any sequence.
FEATURES = [
    pytest.param(dict(window_size=(0, 0)), id="window-0"),
    pytest.param(dict(window_size=(1, 1)), id="window-1"),
    pytest.param(dict(causal=True, window_size=(17, -1)), id="causal-window-17"),
    pytest.param(dict(causal=True, window_size=(500, -1)), id="causal-window-wider-than-all"),
    pytest.param(dict(softcap=5.0, q_gain=4.0), id="softcap-large-logits"),
    pytest.param(dict(causal=True, alibi_slopes="head"), id="alibi-per-head"),
    pytest.param(dict(alibi_slopes="sequence", window_size=(9, 3), softcap=20.0), id="alibi-per-sequence-window-cap"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("keywords", FEATURES)
def test_features_match_float64(target, keywords, dtype):
    device, _ = target
    keywords = dict(keywords)
    lengths_q, lengths_k, heads = [1, 37, 0, 50], [9, 37, 4, 31], 4
    inputs = packed_inputs(lengths_q, lengths_k, heads, 2, 32, dtype, device, q_gain=keywords.pop("q_gain", 1.0))
    slopes = keywords.get("alibi_slopes")
    if slopes is not None:
        keywords["alibi_slopes"] = torch.rand((heads,) if slopes == "head" else (len(lengths_q), heads),
                                              device=device) * 0.5
    # A window of 0 keys beside the diagonal: one key per row, P = 1, and exactly zero dq and dk.
    exactly_zero = ("dq", "dk") if keywords.get("window_size") == (0, 0) else ()
    assert_matches_float64(run_varlen(*inputs, **keywords), float64_varlen(*inputs, **keywords), dtype, exactly_zero)


def test_each_sequence_gets_exactly_what_the_dense_kernel_gives_it_alone(target):
    """The varlen kernels run remat.attention's on each sequence's rows: bitwise the same outputs,
    lse and gradients as remat.attention on that sequence as a batch of one."""
    device, _ = target
    lengths_q, lengths_k = [7, 0, 40, 18], [7, 5, 33, 18]
    q, k, v, do, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 4, 2, 64, torch.float32, device)
    o, lse, dq, dk, dv = run_varlen(q, k, v, do, cu_q, cu_k, causal=True, window_size=(11, -1))
    for b in range(len(lengths_q)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = [t[rows].transpose(0, 1).unsqueeze(0).detach().requires_grad_()
                 for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        o_b, lse_b = remat.attention(*alone, causal=True, window_size=(11, -1), return_lse=True)
        o_b.backward(do[rows_q].transpose(0, 1).unsqueeze(0))
        assert torch.equal(o[rows_q], o_b[0].transpose(0, 1)) and torch.equal(lse[:, rows_q], lse_b[0]), b
        for name, packed, rows, leaf in (("dq", dq, rows_q, alone[0]), ("dk", dk, rows_k, alone[1]),
                                         ("dv", dv, rows_k, alone[2])):
            assert torch.equal(packed[rows], leaf.grad[0].transpose(0, 1)), (name, b)


def test_a_sequence_never_reads_another(target):
    """NaN in every other sequence's rows leaves a sequence's output and gradients unchanged: no
    program reads past its own sequence's bounds (masked, or skipped block by block)."""
    device, _ = target
    lengths = [20, 33, 17]
    q, k, v, do, cu_q, cu_k = packed_inputs(lengths, lengths, 2, 2, 32, torch.float32, device)
    clean = run_varlen(q, k, v, do, cu_q, cu_k, causal=True)
    middle = slice(20, 53)
    poisoned = [t.detach().clone() for t in (q, k, v, do)]
    for t in poisoned:
        t[:20] = float("nan")
        t[53:] = float("nan")
    dirty = run_varlen(*poisoned, cu_q, cu_k, causal=True)
    for name, want, got in zip(("o", "lse", "dq", "dk", "dv"), clean, dirty):
        rows = got[:, middle] if name == "lse" else got[middle]
        assert torch.equal(rows, want[:, middle] if name == "lse" else want[middle]), name


def test_dropout_uses_the_reference_mask_and_is_reproducible(target):
    """Dropout per sequence b draws the mask of batch index b (remat.ops.attention.dropout_keep_mask):
    the reference that rebuilds it gives the kernel's o, dq, dk, dv; the same torch seed, the same bits."""
    device, _ = target
    lengths_q, lengths_k = [19, 0, 34], [25, 6, 34]
    inputs = packed_inputs(lengths_q, lengths_k, 4, 2, 32, torch.float32, device)
    torch.manual_seed(7)
    first = run_varlen(*inputs, causal=True, dropout_p=0.25)
    torch.manual_seed(7)
    seed = torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64, device=device)  # what the call drew
    torch.manual_seed(7)
    second = run_varlen(*inputs, causal=True, dropout_p=0.25)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert_matches_float64(first, float64_varlen(*inputs, causal=True, dropout=(0.25, seed)), torch.float32)
    without = run_varlen(*inputs, causal=True)
    assert not torch.equal(first[0], without[0])  # the mask does drop something


def test_saves_qkv_output_lse_and_cu_seqlens_only(target):
    device, _ = target
    q, k, v, _, cu_q, cu_k = packed_inputs([3, 40, 0, 21], [9, 40, 2, 21], 4, 2, 32, torch.float16, device)
    got = saved_bytes(lambda: remat.attention_varlen(q, k, v, cu_q, cu_k, 40, 40, causal=True))
    qkvo = 2 * (2 * q.numel() + k.numel() + v.numel())  # fp16: o has q's shape
    assert got == qkvo + 4 * 4 * q.shape[0] + 2 * 4 * cu_q.numel()  # + the fp32 lse (H, total_q), the int32 cu_seqlens


@pytest.mark.parametrize("lengths", [[0, 0], []], ids=["only-empty-sequences", "no-sequence"])
def test_no_rows_gives_empty_output_and_gradients(target, lengths):
    device, _ = target
    q, k, v, do, cu_q, cu_k = packed_inputs(lengths, lengths, 2, 2, 32, torch.float32, device)
    o, lse, dq, dk, dv = run_varlen(q, k, v, do, cu_q, cu_k, causal=True)
    assert o.shape == (0, 2, 32) and lse.shape == (2, 0) and dq.shape == dk.shape == dv.shape == (0, 2, 32)


def test_queries_without_keys_get_zero_output_and_minus_inf_lse(target):
    device, _ = target
    q, k, v, do, cu_q, cu_k = packed_inputs([4, 6], [0, 6], 2, 2, 32, torch.float32, device)
    o, lse, dq, dk, dv = run_varlen(q, k, v, do, cu_q, cu_k)
    assert torch.equal(o[:4], torch.zeros_like(o[:4])) and torch.isneginf(lse[:, :4]).all()
    assert torch.equal(dq[:4], torch.zeros_like(dq[:4]))
    assert_matches_float64((o, lse, dq, dk, dv), float64_varlen(q, k, v, do, cu_q, cu_k), torch.float32)


def test_the_fallback_warning_names_the_function_and_the_reference_it_runs(monkeypatch):
    """Where the kernels cannot run a call (on a GPU: a head dim neither backend takes, an old GPU),
    attention_varlen runs its PyTorch reference sequence by sequence, and says so by name."""
    from remat.ops import attention as attn_ops
    from remat.ops import attention_varlen as varlen_ops

    monkeypatch.setattr(varlen_ops, "_fallback_reason", lambda *args: "a reason the kernels decline")
    monkeypatch.setattr(attn_ops, "_warned", set())
    q, k, v, do, cu_q, cu_k = packed_inputs([3, 5], [4, 6], 2, 1, 32, torch.float32, "cpu")
    with pytest.warns(UserWarning, match=r"^remat\.attention_varlen: a reason the kernels decline; falling back "
                                         r"to remat's PyTorch reference \(correct, but it materialises"):
        ours = run_varlen(q, k, v, do, cu_q, cu_k, causal=True)
    assert_matches_float64(ours, float64_varlen(q, k, v, do, cu_q, cu_k, causal=True), torch.float32)
