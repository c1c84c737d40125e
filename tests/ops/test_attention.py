"""Attention: kernels against a float64 reference and PyTorch's SDPA, memory, the module, bad input
(the op contract and the ahead-of-time GPU compile: tests/ops/test_op_registry.py, tests/package/test_triton_aot.py)."""

import importlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.ops import attention as attn_ops

from attention_checks import assert_matches_float64, deterministic_algorithms
from numerics import REL_TOL, rel_error, saved_bytes

HAS_GPU = torch.cuda.is_available()
# bf16 on CPU too: the tests make the interpreter's bf16 tl.dot exact (conftest.py, numerics.py).
DTYPES = [torch.float16, torch.float32, torch.bfloat16]



@pytest.fixture(autouse=True)
def fixed_block_sizes(monkeypatch):
    """The fixed table on a GPU: tuning every (head dim, causal, dtype) class met here would add
    minutes of timing. Every candidate's numerics and the tuning path are tested in
    tests/ops/test_autotune.py."""
    monkeypatch.setenv("REMAT_AUTOTUNE", "0")


# Floors of the "at most 2x PyTorch's own error" criterion. fp32: both errors are ~1e-7 (rounding
# noise of the summation order), where a factor of 2 is not meaningful.
ERROR_FLOOR = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.0}

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, softmax_scale). Interpreter
# blocks are 16 x 16: lengths 17, 33, 65 leave ragged tails, 1 is a single row.
CASES = [
    pytest.param((1, 2, 2, 17, 17, 32, False, None), id="plain-17"),
    pytest.param((2, 2, 2, 33, 33, 64, True, None), id="causal-33"),
    pytest.param((1, 2, 2, 17, 40, 64, True, None), id="causal-q17-k40"),
    pytest.param((1, 2, 2, 40, 17, 32, True, None), id="causal-q40-k17-masked-rows"),
    pytest.param((1, 2, 2, 33, 65, 64, False, 0.3), id="noncausal-q33-k65-scale0.3"),
    pytest.param((1, 4, 1, 17, 17, 64, True, None), id="mqa"),
    pytest.param((1, 4, 2, 33, 20, 32, False, None), id="gqa"),
    pytest.param((1, 4, 2, 24, 33, 64, True, 0.6), id="gqa-causal-scale0.6"),
    pytest.param((2, 1, 1, 1, 1, 64, False, None), id="seq1"),
    pytest.param((1, 1, 1, 1, 17, 32, True, None), id="q1-causal"),
    pytest.param((1, 1, 1, 65, 65, 80, False, None), id="d80"),
    pytest.param((1, 1, 1, 33, 33, 96, True, None), id="d96"),
    pytest.param((1, 1, 1, 33, 17, 128, False, None), id="d128"),
    pytest.param((1, 1, 1, 17, 17, 256, True, None), id="d256"),
    pytest.param((1, 1, 1, 127, 129, 64, True, None), id="causal-q127-k129"),
    # Whole 16-blocks only: every unmasked (interior) step with no ragged tail next to it.
    pytest.param((1, 2, 2, 32, 64, 32, False, None), id="noncausal-whole-blocks"),
    pytest.param((1, 2, 2, 48, 48, 64, True, None), id="causal-whole-blocks"),
    pytest.param((1, 2, 1, 64, 32, 32, True, None), id="gqa-causal-q64-k32-whole-blocks"),
    pytest.param((1, 1, 1, 20, 64, 32, True, None), id="causal-q20-k64"),
    pytest.param((1, 2, 2, 33, 47, 64, True, -0.4), id="causal-negative-scale"),
]


def make_qkv(shape, dtype, device):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    q = torch.randn(batch, heads, seqlen_q, head_dim, device=device).to(dtype).requires_grad_()
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device).to(dtype).requires_grad_()
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device).to(dtype).requires_grad_()
    return q, k, v


def float64_reference(q, k, v, do, causal, scale):
    """o, lse, dq, dk, dv of the explicit-softmax reference in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = attn_ops.attention_ref(*leaves, causal, scale)
    o.backward(do.double())
    return (o, lse, *[t.grad for t in leaves])


def _bottom_right_mask(q, k):
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])


def torch_same_dtype(q, k, v, do, causal, scale):
    """o, dq, dk, dv as PyTorch computes them in q's dtype, by two implementations; "PyTorch's
    own error" is the larger of their two errors:

    - F.scaled_dot_product_attention (the math backend on CPU, the default one on a GPU). On CPU
      the math backend upcasts fp16 to fp32 inside, so it is not a same-dtype computation there.
    - an explicit softmax whose matmuls run in q's dtype: the reference FlashAttention's own tests
      measure PyTorch's error with (attention_ref(upcast=False)). Its P and dS round to the input
      dtype before their matmuls, as every flash kernel's do.
    Causal masks are bottom-right aligned in both.
    """
    results = []
    for explicit in (False, True):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        heads = q.shape[1]
        k_full = leaves[1].repeat_interleave(heads // k.shape[1], dim=1)
        v_full = leaves[2].repeat_interleave(heads // k.shape[1], dim=1)
        mask = _bottom_right_mask(q, k) if causal else None
        if explicit:
            s = (leaves[0] * (scale if scale is not None else q.shape[-1] ** -0.5)) @ k_full.transpose(-1, -2)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            o = torch.softmax(s, dim=-1) @ v_full
        elif q.device.type == "cpu":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                o = F.scaled_dot_product_attention(leaves[0], k_full, v_full, attn_mask=mask, scale=scale)
        else:
            o = F.scaled_dot_product_attention(leaves[0], k_full, v_full, attn_mask=mask, scale=scale)
        o.backward(do)
        results.append((o, *[t.grad for t in leaves]))
    return results


def run_remat(q, k, v, do, causal, scale):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = remat.ops.attention.attention(*leaves, causal=causal, softmax_scale=scale, return_lse=True)
    o.backward(do)
    return (o, lse, *[t.grad for t in leaves])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_and_sdpa(target, case, dtype):
    device, _ = target
    *shape, causal, scale = case
    q, k, v = make_qkv(shape, dtype, device)
    do = torch.randn(q.shape, device=device).to(dtype)
    ours = run_remat(q, k, v, do, causal, scale)
    ref = float64_reference(q, k, v, do, causal, scale)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    exactly_zero = {"dq", "dk"} if seqlen_k == 1 else set()  # one key: P = 1, dS = 0
    assert_matches_float64(ours, ref, dtype, exactly_zero)

    if causal and seqlen_q > seqlen_k:
        return  # rows that see no key: SDPA's answer there is NaN or 0 depending on the version
    sdpa, explicit = torch_same_dtype(q, k, v, do, causal, scale)
    for name, got, by_sdpa, by_explicit, want in zip(
        ("o", "dq", "dk", "dv"), (ours[0], *ours[2:]), sdpa, explicit, (ref[0], *ref[2:])
    ):
        if name in exactly_zero:
            continue
        ours_err = rel_error(got, want)
        torch_err = max(rel_error(by_sdpa, want), rel_error(by_explicit, want))
        assert ours_err <= 2 * torch_err + ERROR_FLOOR[dtype], f"{name}: {ours_err:.3g} vs torch {torch_err:.3g}"


# GPU block sizes differ between query and key blocks (128 x 64, 32 x 128, ...), which moves the
# boundaries between unmasked and masked tiles relative to the causal diagonal; the interpreter's
# default is square. Forced here, for all three kernels.
@pytest.mark.parametrize("config", [(32, 16, 4, 1), (16, 32, 4, 1), (64, 16, 4, 1), (16, 64, 4, 1)],
                         ids=lambda c: f"BM{c[0]}-BN{c[1]}")
@pytest.mark.parametrize("shape", [(1, 2, 1, 45, 70, 32, True), (1, 2, 2, 70, 45, 32, True),
                                   (1, 2, 2, 64, 64, 32, True), (1, 2, 2, 50, 37, 32, False)],
                         ids=["causal-q45-k70-mqa", "causal-q70-k45", "causal-64", "noncausal-q50-k37"])
def test_rectangular_blocks_match_float64(target, monkeypatch, config, shape):
    device, _ = target
    monkeypatch.setattr(importlib.import_module(_kernel_module()), "_select_config", lambda *args: config)
    *dims, causal = shape
    q, k, v = make_qkv(dims, torch.float32, device)
    do = torch.randn(q.shape, device=device)
    ours = run_remat(q, k, v, do, causal, None)
    ref = float64_reference(q, k, v, do, causal, None)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        seen = torch.isfinite(want)  # lse is -inf on rows that see no key
        assert torch.equal(torch.isfinite(got), seen), name
        assert rel_error(got[seen], want[seen]) <= REL_TOL[torch.float32], \
            f"{name}: {rel_error(got[seen], want[seen]):.3g}"


def test_rows_without_visible_keys_are_zero(target):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key."""
    device, _ = target
    q, k, v = make_qkv((1, 2, 2, 37, 5, 32), torch.float16, device)
    o, lse = remat.ops.attention.attention(q, k, v, causal=True, return_lse=True)
    hidden = 37 - 5
    assert torch.equal(o[:, :, :hidden], torch.zeros_like(o[:, :, :hidden]))
    assert torch.isneginf(lse[:, :, :hidden]).all() and torch.isfinite(lse[:, :, hidden:]).all()
    o.backward(torch.randn_like(o))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, :hidden], torch.zeros_like(q.grad[:, :, :hidden]))


def test_non_contiguous_inputs(target):
    """q from a (b, s, h, d) tensor, k a slice of a wider tensor, v with a last-dim stride != 1."""
    device, _ = target
    q = torch.randn(2, 19, 2, 32, device=device, dtype=torch.float16).transpose(1, 2).detach().requires_grad_()
    k = torch.randn(2, 2, 25, 48, device=device, dtype=torch.float16)[..., 8:40].detach().requires_grad_()
    v = torch.randn(2, 2, 32, 25, device=device, dtype=torch.float16).transpose(-1, -2).detach().requires_grad_()
    assert q.stride(-1) == 1 and not q.is_contiguous() and v.stride(-1) != 1
    do = torch.randn(2, 19, 2, 32, device=device, dtype=torch.float16).transpose(1, 2)  # non-contiguous too
    ours = run_remat(q, k, v, do, True, None)
    ref = float64_reference(q, k, v, do, True, None)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        assert rel_error(got, want) <= REL_TOL[torch.float16], name


def test_empty_inputs(target):
    device, _ = target
    for shape in [(0, 2, 2, 5, 7, 32), (1, 2, 2, 0, 7, 32), (1, 2, 2, 5, 0, 32)]:
        q, k, v = make_qkv(shape, torch.float32, device)
        o = remat.ops.attention.attention(q, k, v)
        assert o.shape == q.shape
        o.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_backward_is_deterministic(target):
    """Bitwise under torch.use_deterministic_algorithms(True), which the CUDA kernels need (they
    add dQ by atomics otherwise, as PyTorch's flash backward does); the Triton kernels always are."""
    device, _ = target
    q, k, v = make_qkv((1, 4, 2, 45, 37, 64), torch.float16, device)
    do = torch.randn(q.shape, device=device).to(torch.float16)
    with deterministic_algorithms():
        first = torch.autograd.grad(remat.ops.attention.attention(q, k, v, causal=True), (q, k, v), do)
        second = torch.autograd.grad(remat.ops.attention.attention(q, k, v, causal=True), (q, k, v), do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_backends_agree_with_reference_path(target):
    """The kernel and the PyTorch reference (the CPU fallback) give the same numbers."""
    device, backend = target
    q, k, v = make_qkv((1, 2, 1, 21, 30, 32), torch.float32, device)
    do = torch.randn(q.shape, device=device)
    kernel = torch.autograd.grad(remat.ops.attention.attention(q, k, v, causal=True), (q, k, v), do)
    with remat.use_backend("reference"):
        reference = torch.autograd.grad(remat.ops.attention.attention(q, k, v, causal=True), (q, k, v), do)
    for ours, ref in zip(kernel, reference):
        assert rel_error(ours, ref) < REL_TOL[torch.float32]


def assert_causal_matches_float64(ours, q, k, v, do, dtype):
    """(o, lse, dq, dk, dv) of a causal run against float64, lse where a row sees some key."""
    ref = float64_reference(q, k, v, do, True, None)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        if name == "lse":
            got, want = got[~torch.isinf(want)], want[~torch.isinf(want)]
        assert rel_error(got, want) <= REL_TOL[dtype], name


def test_unsupported_head_dim(target):
    """Head dim 48 is outside the kernels: the reference on CPU, SDPA (with a warning) on CUDA."""
    device, _ = target
    q, k, v = make_qkv((1, 2, 1, 9, 13, 48), torch.float32, device)
    do = torch.randn(q.shape, device=device)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ours = run_remat(q, k, v, do, True, None)
    assert_causal_matches_float64(ours, q, k, v, do, torch.float32)


@pytest.mark.parametrize("causal, seqlens", [(False, (7, 11)), (True, (9, 9)), (True, (13, 6)), (True, (4, 10))])
def test_sdpa_fallback_matches_reference(causal, seqlens):
    """The SDPA fallback (CUDA only in production) computes the same function, GQA and
    bottom-right causal included; checked here on CPU."""
    q, k, v = make_qkv((2, 4, 2, *seqlens, 48), torch.float32, "cpu")
    do = torch.randn(q.shape)
    o, lse = attn_ops._sdpa_fallback(q, k, v, causal, 0.2, True)
    o.backward(do)
    ref = float64_reference(q, k, v, do, causal, 0.2)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), (ref[0], *ref[2:])):
        assert torch.isfinite(got).all() and rel_error(got, want) <= REL_TOL[torch.float32], name
    assert torch.equal(torch.isinf(lse), torch.isinf(ref[1]))


@pytest.mark.skipif(not HAS_GPU, reason="the fallback warning is for CUDA tensors")
def test_cuda_fallback_warns_once():
    q, k, v = make_qkv((1, 2, 2, 16, 16, 48), torch.float16, "cuda")
    attn_ops._warned.clear()
    with pytest.warns(UserWarning, match="head dim 48"):
        remat.ops.attention.attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.ops.attention.attention(q, k, v)


# --- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
def test_saves_qkv_output_and_fp32_lse_only(target, kv_heads):
    device, _ = target
    batch, heads, seqlen_q, seqlen_k, head_dim = 2, 4, 40, 24, 32
    q, k, v = make_qkv((batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim), torch.float16, device)
    measured = saved_bytes(lambda: remat.ops.attention.attention(q, k, v, causal=True))
    q_o_bytes = 2 * batch * heads * seqlen_q * head_dim * 2
    kv_bytes = 2 * batch * kv_heads * seqlen_k * head_dim * 2
    lse_bytes = batch * heads * seqlen_q * 4
    assert measured == q_o_bytes + kv_bytes + lse_bytes  # nothing of size seqlen_q x seqlen_k


# --- the module --------------------------------------------------------------------------------


def _module_class():
    cls = getattr(remat.nn, "MultiheadSelfAttention", None)
    if cls is None:
        pytest.skip("remat.nn.MultiheadSelfAttention is not added to remat/nn.py yet")
    return cls


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_module_from_torch_matches_mha(target, batch_first, causal):
    device, _ = target
    cls = _module_class()
    stock = torch.nn.MultiheadAttention(64, 2, batch_first=batch_first).to(device)
    with torch.no_grad():
        stock.in_proj_bias.normal_()
        stock.out_proj.bias.normal_()
    ours = cls.from_torch(stock, causal=causal)
    x = torch.randn(3, 10, 64, device=device)  # (batch 3, seq 10), or (seq 3, batch 10)
    seq = 10 if batch_first else 3
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=device) if causal else None
    want, _ = stock(x, x, x, need_weights=False, attn_mask=mask)
    got, weights = ours(x, x, x, need_weights=False)
    assert weights is None
    assert rel_error(got, want) < 1e-5
    assert ours.state_dict().keys() == stock.state_dict().keys()


def test_module_gqa_and_errors(target):
    device, _ = target
    cls = _module_class()
    module = cls(64, 4, num_kv_heads=2, causal=True).to(device)
    assert module.in_proj_weight.shape == ((4 + 2 * 2) * 16, 64)
    x = torch.randn(2, 9, 64, device=device, requires_grad=True)
    out = module(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert all(p.grad is not None for p in module.parameters())
    with pytest.raises(ValueError, match="dropout"):
        cls(64, 4, dropout=1.0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cls(64, 4, num_kv_heads=3)


def test_module_dropout_in_training_only_and_reproducibly(target):
    """dropout (from_torch takes mha's): remat.attention's dropout_p in training, reproducible by
    seed; none in eval, where it equals the stock module."""
    device, _ = target
    stock = torch.nn.MultiheadAttention(64, 2, dropout=0.3, batch_first=True).to(device)
    ours = _module_class().from_torch(stock)
    x = torch.randn(2, 9, 64, device=device)
    torch.manual_seed(1)
    first, _ = ours(x, x, x, need_weights=False)
    torch.manual_seed(1)
    again, _ = ours(x, x, x, need_weights=False)
    assert torch.equal(first, again)
    evaluated, _ = ours.eval()(x, x, x, need_weights=False)
    assert not torch.equal(first, evaluated)
    assert rel_error(evaluated, stock.eval()(x, x, x, need_weights=False)[0]) < 1e-5


# --- bad input ---------------------------------------------------------------------------------


def _qkv():
    return torch.randn(1, 4, 8, 32), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda q, k, v: remat.ops.attention.attention(q.long(), k, v), TypeError, "q must have dtype"),
        (lambda q, k, v: remat.ops.attention.attention(q, k.half(), v), TypeError, "k must have q's dtype"),
        (lambda q, k, v: remat.ops.attention.attention(q, k, v.long()), TypeError, "v must have dtype"),
        (lambda q, k, v: remat.ops.attention.attention(q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: remat.ops.attention.attention(q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: remat.ops.attention.attention(q, k[..., :16], v), ValueError, "k must have shape"),
        (lambda q, k, v: remat.ops.attention.attention(q, k, v[:, :, :5]), ValueError, "v must have k's shape"),
        (lambda q, k, v: remat.ops.attention.attention(q[:, :3], k, v), ValueError, "number of heads dividing"),
        (lambda q, k, v: remat.ops.attention.attention(q[:, :0], k, v), ValueError, "q has no heads"),
        (lambda q, k, v: remat.ops.attention.attention(q[:, :0], k[:, :0], v[:, :0]), ValueError, "q has no heads"),
        (lambda q, k, v: remat.ops.attention.attention(q, k, v, causal=1), TypeError, "causal must be"),
        (lambda q, k, v: remat.ops.attention.attention(q, k, v, softmax_scale="x"), ValueError, "softmax_scale"),
        (lambda q, k, v: remat.ops.attention.attention(q, k, v, softmax_scale=math.inf), ValueError, "softmax_scale"),
        (lambda q, k, v: remat.ops.attention.attention(q, k, v, return_lse=None), TypeError, "return_lse"),
        (lambda q, k, v: remat.ops.attention.attention(q, k.to("meta"), v), ValueError, "k is on meta"),
    ],
)
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call(*_qkv())


# --- the autotuning candidates on Hopper (their ahead-of-time compile: tests/package/test_triton_aot.py)


def _kernel_module():
    try:
        importlib.import_module("remat.triton_kernels.attention")
        return "remat.triton_kernels.attention"
    except ImportError:
        return "triton_kernels.attention"


def test_hopper_candidates_only_where_they_compiled_without_spills():
    """The 64 x 128 dK/dV tile at head dim 128 spills in the causal kernel: non-causal only. The
    128 x 128 tiles spill at head dims 80 and 96 (padded to 128): exact head dim 128 only."""
    kernels = importlib.import_module(_kernel_module())
    tile = (64, 128, 8, 2)
    assert tile in kernels.candidates("dkdv", 128, torch.bfloat16, hopper=True, causal=False)
    assert tile not in kernels.candidates("dkdv", 128, torch.bfloat16, hopper=True, causal=True)
    assert tile not in kernels.candidates("dkdv", 128, torch.bfloat16, hopper=False, causal=False)
    for head_dim in (80, 96):
        for kind in kernels.KINDS:
            configs = kernels.candidates(kind, head_dim, torch.float16, hopper=True, causal=False)
            assert not [c for c in configs if c[:2] == (128, 128)], (kind, head_dim, configs)


def test_dropout_runs_only_its_own_configurations():
    """With dropout, on either GPU generation, the candidates are the dropout table's (which
    compiled without spills with Philox's live values): not the plain tiles, the fp32 feature
    tiles or the Hopper-only ones, several of which put hundreds of bytes on the stack."""
    kernels = importlib.import_module(_kernel_module())
    for dtype, table in ((torch.float16, "half"), (torch.bfloat16, "half"), (torch.float32, "fp32")):
        for kind in kernels.KINDS:
            for head_dim in (32, 64, 80, 96, 128, 256):
                expected = kernels._DROPOUT_CONFIGS[table][kind][kernels.padded_head_dim(head_dim)]
                for hopper in (False, True):
                    got = kernels.candidates(kind, head_dim, dtype, hopper=hopper, causal=True, features=True,
                                             dropout=True)
                    assert got == expected, (dtype, kind, head_dim, hopper)
    assert (128, 128, 8, 3) in kernels.candidates("fwd", 128, torch.bfloat16, hopper=True, causal=True)  # not dropout


# --- sizes past int32 and past a grid axis ----------------------------------------------------


def test_row_offsets_past_2_31_elements(target):
    """q, k, v and dO rows 2^27 + 64 elements apart: row 16 starts past element 2^31, where an
    int32 row offset (row * row stride) would wrap to a negative address. The four tensors are
    interleaved views of one 4 GiB storage that is allocated but never touched except for the
    17 rows written here, so the test needs a few MB of real memory (and 4 GiB of GPU memory on
    a GPU)."""
    device, _ = target
    seqlen, head_dim, row_stride = 17, 32, 2**27 + 64
    assert (seqlen - 1) * row_stride >= 2**31
    storage = torch.empty((seqlen - 1) * row_stride + 4 * head_dim, dtype=torch.float16, device=device)
    q, k, v, do = (storage.as_strided((1, 1, seqlen, head_dim), (0, 0, row_stride, 1), i * head_dim)
                   for i in range(4))
    for t in (q, k, v, do):
        t.copy_(torch.randn(t.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback on a GPU either: the kernels must run
        ours = run_remat(q, k, v, do, True, None)
    ref = float64_reference(q, k, v, do, True, None)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        assert rel_error(got, want) <= REL_TOL[torch.float16], name


@pytest.mark.skipif(not HAS_GPU, reason="70000 heads take minutes under the interpreter")
def test_more_heads_than_a_grid_axis_holds():
    """70000 query heads (7000 key/value heads): more than the 65535 programs grid axes 1 and 2
    hold. The kernels' 1-D grid runs them, without falling back."""
    q, k, v = make_qkv((1, 70000, 7000, 20, 24, 32), torch.float16, "cuda")
    do = torch.randn(q.shape, device="cuda").to(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = run_remat(q, k, v, do, True, None)
    assert_causal_matches_float64(ours, q, k, v, do, torch.float16)


def test_only_head_dim_and_gpu_generation_fall_back(monkeypatch):
    """Size is no reason to fall back any more: a long packed-qkv view whose int32 row offsets
    would overflow, and more heads than a grid axis holds, both keep the kernels. Checked on
    fake CUDA tensors (shapes and strides without memory) on an Ampere-or-newer GPU stand-in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(attn_ops, "_ampere_or_newer", lambda index: True)
    with FakeTensorMode():
        packed = torch.empty(1, 300000, 3 * 16 * 256, device="cuda").view(1, 300000, 3, 16, 256)[:, :, 0]
        packed = packed.transpose(1, 2)  # row stride 3 * 16 * 256: row 2^31 / 12288 overflows int32
        many_heads = torch.empty(1, 70000, 64, 64, device="cuda")
        odd_head_dim = torch.empty(1, 2, 8, 48, device="cuda")
    assert (packed.shape[2] - 1) * packed.stride(2) >= 2**31
    for q in (packed, many_heads):
        assert attn_ops._fallback_reason(q, q, q) is None
    assert "head dim 48" in attn_ops._fallback_reason(odd_head_dim, odd_head_dim, odd_head_dim)
    monkeypatch.setattr(attn_ops, "_ampere_or_newer", lambda index: False)
    assert "compute capability" in attn_ops._fallback_reason(many_heads, many_heads, many_heads)


def test_backend_cuda_keeps_the_head_dims_only_its_kernels_take(monkeypatch):
    """Head dim 48 (not one of the Triton kernels'): under backend "cuda" the CUDA kernels take
    half-precision calls of it on an Ampere-or-newer GPU, so no fallback; fp32 ones fall back."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(attn_ops._backend, "choose", lambda *args, **kwargs: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with FakeTensorMode():
        half, single = (torch.empty(1, 2, 8, 48, device="cuda", dtype=t) for t in (torch.float16, torch.float32))
    assert attn_ops._fallback_reason(half, half, half, (half, half, half, True, 0.125)) is None
    assert "head dim 48" in attn_ops._fallback_reason(single, single, single, (single, single, single, True, 0.125))
    assert "head dim 48" in attn_ops._fallback_reason(half, half, half)  # without the call: Triton's limits


@pytest.mark.parametrize("features, fallback", [
    ({}, r"torch\.nn\.functional\.scaled_dot_product_attention \(correct, but not remat's memory layout\)"),
    (dict(softcap=5.0), r"remat's PyTorch reference \(correct, but it materialises"),
], ids=["plain-sdpa", "softcap-reference"])
def test_the_fallback_warning_names_what_runs_instead(monkeypatch, features, fallback):
    """SDPA runs plain and causal calls the kernels cannot; the reference runs those with a window,
    softcapping, ALiBi or dropout (SDPA has none of them as the kernels compute them)."""
    monkeypatch.setattr(attn_ops, "_fallback_reason", lambda *args: "a reason the kernels decline")
    monkeypatch.setattr(attn_ops, "_warned", set())
    q, k, v = make_qkv((1, 2, 2, 16, 16, 32), torch.float32, "cpu")
    with pytest.warns(UserWarning, match=r"^remat\.attention: a reason the kernels decline; falling back to "
                                         + fallback):
        remat.attention(q, k, v, causal=True, **features)


def test_integer_like_window_sizes_are_ints(target):
    """numpy's and torch's integer scalars are ints, as torch takes them (a window from a config read
    with numpy); a bool or a float is not."""
    import numpy as np

    device, _ = target
    q, k, v = (t.to(device) for t in _qkv())
    expected = remat.attention(q, k, v, window_size=(2, 2))
    for window in [(np.int64(2), 2), (torch.tensor(2), np.int32(2))]:
        assert torch.equal(remat.attention(q, k, v, window_size=window), expected)
    for window in [(True, 2), (2.0, 2)]:
        with pytest.raises(TypeError, match="window_size must be a pair of ints"):
            remat.attention(q, k, v, window_size=window)


def test_a_row_with_an_infinite_score_is_nan_as_in_float64(target):
    """A +inf key element makes +inf scores: the rows that see that key are NaN in float64 SDPA, and
    in the kernels and the reference alike (not +inf); the rows before it, causally, are untouched."""
    device, _ = target
    q, k, v = (torch.randn(1, 1, 4, 32, device=device) for _ in range(3))
    q[..., 0], k[0, 0, 1, 0] = 1.0, float("inf")
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert torch.isnan(expected[0, 0, 1:]).all() and torch.isfinite(expected[0, 0, 0]).all()
    with remat.use_backend("reference"):
        reference = remat.attention(q, k, v, causal=True)
    for out in (remat.attention(q, k, v, causal=True), reference):
        assert torch.equal(torch.isnan(out), torch.isnan(expected))
        assert rel_error(out[0, 0, 0], expected[0, 0, 0]) <= REL_TOL[torch.float32]
