"""The CUDA extension's attention kernels (csrc/attention_kernels.cuh), beyond test_attention.py,
whose tests all run on them too on a GPU (its "cuda-cuda" target).

Without a GPU: the launches each shape would make (grid, threads, shared memory, the head dim
compiled for), from the built extension's own host code; the dispatch of backend "cuda" (what the
kernels take, what falls back to Triton). The kernels' numerics without a GPU are in
test_attention_cuda_emulated.py (the same source built for the CPU under a warp emulator). On a
GPU: every dtype and head dim the kernels take, and the window, softcapping, ALiBi and dropout
(the Triton kernels' mask, read exactly), against float64 and against the Triton kernels, bitwise
determinism, and that backend "cuda" runs them.
"""

import math
import warnings

import pytest
import torch

import remat
from remat import _backend
from remat.ops import attention as attn_ops

from attention_checks import (
    DROPOUT_SEED,
    assert_matches_float64,
    deterministic_algorithms,
    mask_revealing_inputs,
    masks_read_from,
)

HAS_GPU = torch.cuda.is_available()
EXTENSION, WHY_NOT = remat.backends()["cuda"]
needs_extension = pytest.mark.skipif(not EXTENSION, reason=f"the CUDA extension is not built: {WHY_NOT}")
needs_gpu = pytest.mark.skipif(not (HAS_GPU and EXTENSION), reason="needs a GPU and the CUDA extension")

# Shared memory a block may opt into: sm_80 (A100) 163 KiB, sm_90 (H100/H200) 227 KiB.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
THREADS = 128  # four warps, 16 query rows (or keys) each
FORWARD, PREPROCESS, DKDV, DQ = range(4)


def _plan(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, bf16, causal, backward, deterministic=True):
    """The launches of a call; DETERMINISTIC as attention_launch_plan's (None: as torch's setting now)."""
    flat = torch.ops.remat_C.attention_launch_plan(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, bf16,
                                                   causal, backward, deterministic)
    rows = [flat[i:i + 7] for i in range(0, len(flat), 7)]
    return [dict(kernel=r[0], head_dim=r[1], grid=tuple(r[2:5]), threads=r[5], shared=r[6]) for r in rows]


def _padded(head_dim):
    return next(d for d in (32, 64, 96, 128, 256) if head_dim <= d)


def _forward_rows(head_dim):
    """Query rows a forward block takes: 4 warps of two 16-row tiles up to head dim 64, else one."""
    return 128 if _padded(head_dim) <= 64 else 64


def _expected_shared(kernel, head_dim, one_pass=False):
    """Bytes of the tiles each kernel keeps (16-bit rows of the padded head dim), written out
    from the kernels' layout: forward Q (_forward_rows) + two stages of K and V (64 rows each, 32
    at 32, 64 and 256); dK/dV: K and V (64 rows) + two stages of Q and dO (64 rows, 32 at 96 and
    128, 16 at 256) + two of lse and delta (fp32), and in the one-pass backward a 16-bit dS block
    (the streamed queries x 64 keys); dQ: Q and dO (64 rows) + two stages of K and V (as dK/dV's Q)."""
    d = _padded(head_dim)
    row = 2 * d
    forward_keys = 64 if d in (96, 128) else 32
    streamed = {32: 64, 64: 64, 96: 32, 128: 32, 256: 16}[d]
    dkdv = (2 * 64 + 4 * streamed) * row + 4 * streamed * 4 + (streamed * 64 * 2 if one_pass else 0)
    return {FORWARD: (_forward_rows(head_dim) + 4 * forward_keys) * row, PREPROCESS: 0, DKDV: dkdv,
            DQ: (2 * 64 + 4 * streamed) * row}[kernel]


# The shapes of test_attention.py's CASES the kernels take, and others only they take (40, 8,
# 120, 136, 200).
PLAN_SHAPES = [(1, 2, 2, 17, 17, 32), (2, 2, 2, 33, 33, 64), (1, 2, 2, 17, 40, 64), (1, 2, 2, 40, 17, 32),
               (1, 4, 1, 17, 17, 64), (1, 4, 2, 33, 20, 32), (2, 1, 1, 1, 1, 64), (1, 1, 1, 65, 65, 80),
               (1, 1, 1, 33, 33, 96), (1, 1, 1, 33, 17, 128), (1, 1, 1, 127, 129, 64), (3, 5, 1, 1000, 3000, 40),
               (1, 1, 1, 9, 9, 8), (2, 8, 2, 4096, 4096, 120), (1, 2, 2, 0, 5, 64), (1, 70000, 7000, 20, 24, 32),
               (1, 2, 1, 33, 65, 256), (2, 3, 3, 100, 70, 136), (1, 4, 2, 129, 129, 200)]


@needs_extension
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "one-pass"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", PLAN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_launch_plan(shape, bf16, deterministic):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    forward = _plan(*shape, bf16, True, False)
    backward = _plan(*shape, bf16, True, True, deterministic)
    # The one-pass backward adds dQ in the dK/dV kernel: no dQ kernel.
    kernels = [FORWARD, PREPROCESS, DKDV] + ([DQ] if deterministic else [])
    assert [launch["kernel"] for launch in forward + backward] == kernels
    # 1-D grids: sequence blocks x heads x batch (no axis limit on heads or batch); at head dim
    # 256 two dK/dV blocks (a column half each) a key block.
    column_halves = 2 if _padded(head_dim) == 256 else 1
    grids = {FORWARD: (math.ceil(seqlen_q / _forward_rows(head_dim)) * heads * batch, 1, 1),
             PREPROCESS: (math.ceil(seqlen_q / 16) * heads * batch, 1, 1),
             DKDV: (math.ceil(seqlen_k / 64) * column_halves * kv_heads * batch, 1, 1),
             DQ: (math.ceil(seqlen_q / 64) * heads * batch, 1, 1)}
    for launch in forward + backward:
        assert launch["head_dim"] == _padded(head_dim)
        assert launch["threads"] == THREADS
        assert launch["grid"] == grids[launch["kernel"]], launch
        assert launch["shared"] == _expected_shared(launch["kernel"], head_dim, not deterministic), launch
        assert launch["shared"] <= min(MAX_SHARED.values())
    assert _plan(*shape, bf16, False, True, deterministic) == backward  # causal or not: the same launches


@needs_extension
def test_the_backward_is_deterministic_as_torch_says():
    """Without an explicit choice the backward follows torch.use_deterministic_algorithms, as
    PyTorch's flash attention backward does: on, a dQ kernel (bitwise reproducible); off (torch's
    default), one pass adding dQ by atomics."""
    def kernels():
        return [launch["kernel"] for launch in _plan(1, 2, 2, 70, 70, 64, True, True, True, None)]

    with deterministic_algorithms():
        assert kernels() == [PREPROCESS, DKDV, DQ]
    assert not torch.are_deterministic_algorithms_enabled()
    assert kernels() == [PREPROCESS, DKDV]


@needs_extension
@pytest.mark.parametrize("head_dim", [0, 4, 12, 252, 264, 512])
def test_launch_plan_refuses_head_dims_the_kernels_lack(head_dim):
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 8 from 8 to 256"):
        _plan(1, 1, 1, 8, 8, head_dim, True, False, False)


@pytest.mark.parametrize("dtype, head_dim, computes", [
    (torch.bfloat16, 64, True), (torch.float16, 128, True), (torch.float16, 40, True), (torch.bfloat16, 8, True),
    (torch.bfloat16, 256, True), (torch.float16, 136, True), (torch.float32, 64, False), (torch.float16, 36, False),
    (torch.float16, 264, False), (torch.bfloat16, 512, False),
])
def test_cuda_kernels_compute_half_types_and_head_dims_up_to_256(dtype, head_dim, computes):
    q = torch.empty(1, 2, 5, head_dim, dtype=dtype)
    assert attn_ops.cuda_kernel_computes(q, q, q, True, 0.125) is computes
    assert attn_ops.cuda_kernel_computes(q, q, q, q, q, q, False, 0.125) is computes  # the backward's arguments


@pytest.mark.parametrize("causal, features", [
    (True, (4,)), (False, (-1, 3)), (True, (-1, -1, 5.0)), (True, (-1, -1, 0.0, torch.ones(2))),
    (False, (7, 2, 30.0, torch.ones(1, 2))), (True, (-1, -1, 0.0, None, 0.1, torch.ones(1, dtype=torch.int64))),
    (False, (3, 3, 1.0, torch.ones(2), 0.5, torch.ones(1, dtype=torch.int64))),
], ids=["window", "window-right", "softcap", "alibi", "all-three", "dropout", "dropout-and-more"])
@pytest.mark.parametrize("dtype, computes", [(torch.bfloat16, True), (torch.float32, False)], ids=str)
def test_cuda_kernels_compute_every_score_option(causal, features, dtype, computes):
    q = torch.empty(1, 2, 5, 64, dtype=dtype)
    assert attn_ops.cuda_kernel_computes(q, q, q, causal, 0.125, *features) is computes
    assert attn_ops.cuda_kernel_computes(q, q, q, q, q, q, causal, 0.125, *features) is computes  # the backward's


def test_backend_cuda_sends_what_the_kernels_do_not_take_to_triton_and_says_so_once(monkeypatch):
    monkeypatch.setattr(_backend, "choose", lambda *args, **kwargs: "cuda")
    _backend.warn_cuda_kernel_declines_once.cache_clear()
    q = torch.randn(1, 2, 5, 32)  # fp32
    with pytest.warns(UserWarning, match="the CUDA attention kernel does not take some of these calls.*its triton "):
        implementation = attn_ops.FAMILY._implementation(0, (q, q, q, True, 0.125))
    assert implementation.__module__.endswith("triton_kernels.attention")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        attn_ops.FAMILY._implementation(0, (q, q, q, True, 0.125))
    _backend.warn_cuda_kernel_declines_once.cache_clear()


# --- on a GPU ----------------------------------------------------------------------------------

def _qkv(shape, dtype):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    make = lambda h, s: torch.randn(batch, h, s, head_dim, device="cuda").to(dtype).requires_grad_()  # noqa: E731
    return make(heads, seqlen_q), make(kv_heads, seqlen_k), make(kv_heads, seqlen_k)


def _run(backend, q, k, v, do, causal, **features):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with remat.use_backend(backend):
        o, lse = attn_ops.attention(*leaves, causal=causal, return_lse=True, **features)
    o.backward(do)
    return (o, lse, *[t.grad for t in leaves])


GPU_SHAPES = [(1, 2, 2, 17, 17, 32), (2, 4, 1, 129, 70, 64), (1, 2, 2, 70, 129, 64), (1, 3, 3, 200, 200, 128),
              (1, 2, 1, 65, 65, 80), (1, 1, 1, 33, 33, 96), (1, 2, 2, 1, 1, 64), (1, 2, 2, 100, 100, 40),
              (1, 2, 1, 130, 70, 256), (1, 2, 2, 70, 130, 256), (1, 1, 1, 65, 65, 200)]


@needs_gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_and_the_triton_kernels(shape, dtype, causal):
    q, k, v = _qkv(shape, dtype)
    do = torch.randn(q.shape, device="cuda").to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CUDA kernel itself, no fallback
        ours = _run("cuda", q, k, v, do, causal)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = attn_ops.attention_ref(*leaves, causal, q.shape[-1] ** -0.5)
    o.backward(do.double())
    exactly_zero = {"dq", "dk"} if k.shape[2] == 1 else set()
    assert_matches_float64(ours, (o, lse, *[t.grad for t in leaves]), dtype, exactly_zero)
    if q.shape[-1] in attn_ops.HEAD_DIMS:  # the Triton kernels' head dims
        triton = _run("triton", q, k, v, do, causal)
        torch.testing.assert_close(ours[1], triton[1], rtol=0, atol=1e-3)  # lse, fp32


# (shape, causal, window_size, softcap, ALiBi slopes' shape: None, "head" or "batch").
GPU_FEATURE_CASES = [
    pytest.param((1, 2, 1, 300, 300, 128), True, (20, -1), 0.0, None, id="causal-window20-d128"),
    pytest.param((1, 2, 2, 150, 90, 256), False, (10, 25), 3.0, "batch", id="window-softcap-alibi-d256"),
    pytest.param((2, 4, 2, 129, 70, 64), True, (-1, -1), 30.0, "head", id="softcap-alibi-gqa"),
    pytest.param((1, 3, 3, 100, 200, 32), False, (-1, 7), 0.0, None, id="window-right7-q100-k200"),
]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, causal, window, softcap, alibi", GPU_FEATURE_CASES)
def test_score_options_match_float64_and_the_triton_kernels(shape, causal, window, softcap, alibi, dtype):
    q, k, v = _qkv(shape, dtype)
    do = torch.randn(q.shape, device="cuda").to(dtype)
    batch, heads = shape[:2]
    slopes = None if alibi is None else torch.rand((heads,) if alibi == "head" else (batch, heads), device="cuda")
    features = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CUDA kernel itself, no fallback
        ours = _run("cuda", q, k, v, do, causal, **features)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = attn_ops.attention_ref(*leaves, causal, q.shape[-1] ** -0.5, *window, softcap, slopes)
    o.backward(do.double())
    assert_matches_float64(ours, (o, lse, *[t.grad for t in leaves]), dtype)
    triton = _run("triton", q, k, v, do, causal, **features)
    finite = torch.isfinite(triton[1])
    torch.testing.assert_close(ours[1][finite], triton[1][finite], rtol=0, atol=1e-3)  # lse, fp32
    assert torch.equal(torch.isfinite(ours[1]), finite)  # the same rows see no key


def _run_op(backend, q, k, v, do, causal, *features):
    """(o, lse, dq, dk, dv) of the attention_fwd op (its features positional, the seed given) under BACKEND."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with remat.use_backend(backend):
        o, lse = attn_ops.attention_fwd(*leaves, causal, q.shape[-1] ** -0.5, *features)
        return (o, lse, *torch.autograd.grad(o, leaves, do))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, causal, window, dropout_p", [
    ((2, 4, 2, 129, 70, 64), True, (-1, -1), 0.17), ((1, 2, 2, 150, 300, 128), False, (40, 20), 0.5),
    ((1, 2, 1, 65, 130, 256), True, (-1, -1), 0.3), ((1, 3, 3, 33, 33, 32), False, (-1, -1), 0.9),
], ids=["gqa-causal-d64", "window-d128", "causal-d256", "p0.9-d32"])
def test_dropout_matches_float64_and_the_triton_kernels_with_the_same_mask(shape, causal, window, dropout_p, dtype):
    q, k, v = _qkv(shape, dtype)
    do = torch.randn(q.shape, device="cuda").to(dtype)
    features = (*window, 0.0, None, dropout_p, DROPOUT_SEED.cuda())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CUDA kernel itself, no fallback
        ours = _run_op("cuda", q, k, v, do, causal, *features)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = attn_ops.attention_ref(*leaves, causal, q.shape[-1] ** -0.5, *features)
    ref = (o, lse, *torch.autograd.grad(o, leaves, do.double()))
    assert_matches_float64(ours, ref, dtype)
    assert_matches_float64(_run_op("triton", q, k, v, do, causal, *features), ref, dtype)


@needs_gpu
@pytest.mark.parametrize("head_dim, seqlen_q, seqlen_k", [(64, 20, 40), (128, 50, 70), (256, 150, 100)],
                         ids=["d64", "d128", "d256"])
def test_dropout_draws_the_triton_kernels_mask_in_every_kernel(head_dim, seqlen_q, seqlen_k):
    """Each compiled kernel's mask, read exactly from its outputs (attention_checks.mask_revealing_inputs),
    is remat.ops.attention.dropout_keep_mask (the Triton kernels'), as in the emulator's test."""
    batch, heads, dropout_p = 2, 2, 0.5
    q, k, v, do, unit_keys = mask_revealing_inputs(batch, heads, seqlen_q, seqlen_k, head_dim, torch.float16, "cuda")
    features = (-1, -1, 0.0, None, dropout_p, DROPOUT_SEED.cuda())
    o, _, _, _, dv = _run_op("cuda", q, k, v, do, False, *features)
    dq = _run_op("cuda", q, unit_keys, v, do, False, *features)[2]
    kept = attn_ops.dropout_keep_mask(DROPOUT_SEED, batch, heads, seqlen_q, seqlen_k, dropout_p, "cuda")
    for kernel, mask in zip(("forward", "dK/dV", "dQ"), masks_read_from(o, dv, dq, seqlen_k)):
        assert torch.equal(mask, kept), kernel


@needs_gpu
@pytest.mark.parametrize("arguments, message", [
    (dict(dropout_p=0.1), "dropout_seed must be given when dropout_p > 0"),
    (dict(dropout_p=0.1, dropout_seed=torch.ones(1, dtype=torch.int32)), "dropout_seed must be one int64"),
    (dict(dropout_p=0.1, dropout_seed=torch.ones(2, dtype=torch.int64)), "dropout_seed must be one int64"),
    (dict(dropout_p=1.0, dropout_seed=torch.ones(1, dtype=torch.int64)), r"dropout_p must be in \[0, 1\)"),
    (dict(softcap=-1.0), "softcap must be finite and >= 0"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must be float32 of shape"),
], ids=["no-seed", "int32-seed", "two-seeds", "p1", "negative-softcap", "alibi-shape"])
def test_the_cuda_ops_name_the_bad_argument(arguments, message):
    """The ops themselves (remat's Python checks bypassed) refuse what the kernels cannot read."""
    q = torch.randn(1, 2, 8, 64, device="cuda").to(torch.float16)
    arguments = {name: a.cuda() if isinstance(a, torch.Tensor) else a for name, a in arguments.items()}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.remat_C.attention_fwd(q, q, q, True, 0.125, **arguments)


@needs_gpu
def test_more_heads_than_a_grid_axis_holds():
    """70000 query heads on 7000 key/value heads: the kernels' 1-D grids run them."""
    q, k, v = _qkv((1, 70000, 7000, 20, 24, 32), torch.float16)
    do = torch.randn(q.shape, device="cuda").to(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        ours = _run("cuda", q, k, v, do, True)
    first = [q[:, :10].detach()] + [t[:, :1].detach().expand(-1, 10, -1, -1) for t in (k, v)]  # group 0
    leaves = [t.double().requires_grad_() for t in first]
    o, lse = attn_ops.attention_ref(*leaves, True, 32**-0.5)
    assert_matches_float64((ours[0][:, :10], ours[1][:, :10]), (o, lse), torch.float16)


@needs_gpu
def test_backward_is_bitwise_deterministic_under_deterministic_algorithms():
    q, k, v = _qkv((2, 8, 2, 300, 300, 128), torch.bfloat16)
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)
    with deterministic_algorithms():
        first, second = _run("cuda", q, k, v, do, True), _run("cuda", q, k, v, do, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@needs_gpu
@pytest.mark.parametrize("shape", [(2, 8, 2, 300, 300, 128), (1, 4, 1, 200, 130, 64), (1, 2, 1, 130, 70, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_one_pass_backward_gives_the_deterministic_dk_dv_bitwise_and_dq_to_rounding(shape):
    """The one-pass backward (dQ by atomics, torch's default) computes dK and dV with the same code
    as the deterministic one, so bitwise the same; its dQ sums the same products in another order
    (fp32), so it differs only by that rounding; both match float64 (test_matches_float64...)."""
    q, k, v = _qkv(shape, torch.bfloat16)
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)
    one_pass = _run("cuda", q, k, v, do, True)
    with deterministic_algorithms():
        deterministic = _run("cuda", q, k, v, do, True)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), one_pass, deterministic):
        if name == "dq":
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-3 * b.abs().max().item())
        else:
            assert torch.equal(a, b), name


@needs_gpu
def test_backend_cuda_runs_the_cuda_kernels_and_fp32_the_triton_ones(monkeypatch):
    chosen = []
    real = attn_ops.FAMILY._implementation
    monkeypatch.setattr(attn_ops.FAMILY, "_implementation",
                        lambda index, args, device=None: chosen.append(real(index, args, device)) or chosen[-1])
    q, k, v = _qkv((1, 2, 2, 40, 40, 64), torch.float16)
    _run("cuda", q, k, v, torch.randn_like(q), True)
    assert chosen == [torch.ops.remat_C.attention_fwd, torch.ops.remat_C.attention_bwd]
    torch.library.opcheck(torch.ops.remat_C.attention_fwd.default, (q.detach(), k.detach(), v.detach(), True, 0.125))

    chosen.clear()
    _backend.warn_cuda_kernel_declines_once.cache_clear()  # said once per process: maybe already
    q, k, v = _qkv((1, 2, 2, 40, 40, 64), torch.float32)
    with pytest.warns(UserWarning, match="does not take some of these calls"):
        _run("cuda", q, k, v, torch.randn_like(q), True)
    assert torch.ops.remat_C.attention_fwd not in chosen


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim, causal, features", [
    (64, True, {}), (128, False, dict(window_size=(30, 5))), (256, True, dict(softcap=20.0)),
    (40, True, dict(alibi_slopes="batch")),
], ids=["causal-d64", "window-d128", "softcap-d256", "alibi-d40"])
def test_packed_sequences_run_the_cuda_kernels_and_match_float64(head_dim, causal, features, dtype, monkeypatch):
    from remat.ops import attention_varlen as varlen_ops

    lengths_q, lengths_k = [130, 0, 1, 77], [100, 9, 1, 200]
    cu_q, cu_k = (varlen_ops.cu_seqlens_of(n, "cuda") for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 4, head_dim, device="cuda").to(dtype)
    k, v = (torch.randn(sum(lengths_k), 2, head_dim, device="cuda").to(dtype) for _ in range(2))
    do = torch.randn(q.shape, device="cuda").to(dtype)
    if features.get("alibi_slopes") == "batch":
        features = dict(alibi_slopes=torch.rand(len(lengths_q), 4, device="cuda"))
    chosen = []
    real = varlen_ops.FAMILY._implementation
    monkeypatch.setattr(varlen_ops.FAMILY, "_implementation",
                        lambda index, args, device=None: chosen.append(real(index, args, device)) or chosen[-1])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with remat.use_backend("cuda"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the CUDA kernels themselves, no fallback
        o, lse = remat.attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal, return_lse=True,
                                        **features)
        o.backward(do)
    assert chosen == [torch.ops.remat_C.attention_varlen_fwd, torch.ops.remat_C.attention_varlen_bwd]
    window = features.get("window_size", (-1, -1))
    score_options = (*window, features.get("softcap", 0.0), features.get("alibi_slopes"))
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = varlen_ops.attention_varlen_ref(*ref_leaves, cu_q, cu_k, causal, head_dim ** -0.5, *score_options)
    o_ref.backward(do.double())
    assert_matches_float64((o, lse, *[t.grad for t in leaves]), (o_ref, lse_ref, *[t.grad for t in ref_leaves]), dtype)
    torch.library.opcheck(torch.ops.remat_C.attention_varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal, 0.125))
