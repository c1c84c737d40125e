"""Attention's sliding window, logit softcapping and ALiBi: kernels against the float64 reference,
block skipping, the fallbacks, saved bytes, torch.compile and bad input (the plain kernels:
tests/ops/test_attention.py; the ops' contract on samples with these features: test_op_registry.py)."""

import contextlib

import pytest
import torch

import remat
from remat.ops import attention as attn_ops

from attention_checks import assert_matches_float64
from kernel_modules import kernel_module
from numerics import REL_TOL, rel_error, saved_bytes

HAS_GPU = torch.cuda.is_available()
# bf16 on CPU too: the tests make the interpreter's bf16 tl.dot exact (conftest.py, numerics.py).
DTYPES = [torch.float16, torch.float32, torch.bfloat16]
INTERPRETER_BLOCKS = (16, 16, 4, 1)  # the kernels' blocks under the interpreter, forced on a GPU where it matters


def _kernels():
    return kernel_module("attention")


def make_inputs(shape, dtype, device, alibi=None, q_gain=1.0):
    """q, k, v requiring grad, do, and the ALiBi slopes: None, "head" (H,) or "batch" (B, H).
    q_gain scales q (large logits for softcapping)."""
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    q = (q_gain * torch.randn(batch, heads, seqlen_q, head_dim, device=device)).to(dtype).requires_grad_()
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device).to(dtype).requires_grad_()
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device).to(dtype).requires_grad_()
    do = torch.randn(batch, heads, seqlen_q, head_dim, device=device).to(dtype)
    slopes = {None: None, "head": (heads,), "batch": (batch, heads)}[alibi]
    if slopes is not None:
        slopes = torch.rand(slopes, device=device) * 0.5
    return q, k, v, do, slopes


def run_remat(q, k, v, do, causal, **features):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = remat.attention(*leaves, causal=causal, return_lse=True, **features)
    o.backward(do)
    return (o, lse, *[t.grad for t in leaves])


def float64_reference(q, k, v, do, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, lse = attn_ops.attention_ref(*leaves, causal, None, *window_size, softcap, alibi_slopes)
    o.backward(do.double())
    return (o, lse, *[t.grad for t in leaves])


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window_size). Interpreter blocks are 16 x 16.
WINDOW_CASES = [
    pytest.param((1, 2, 2, 40, 40, 32, False, (0, 0)), id="w0-one-key"),
    pytest.param((1, 2, 2, 33, 47, 32, False, (1, 1)), id="w1-q33-k47"),
    pytest.param((1, 2, 1, 65, 40, 64, True, (17, -1)), id="w17-causal-q65-k40-mqa"),
    pytest.param((1, 2, 1, 40, 70, 32, False, (17, 5)), id="w17-5-gqa"),
    pytest.param((2, 2, 2, 33, 33, 32, False, (-1, 3)), id="right-only"),
    pytest.param((1, 2, 2, 50, 37, 32, False, (100, 200)), id="wider-than-the-sequence"),
    pytest.param((1, 2, 2, 37, 50, 32, True, (100, 7)), id="wider-causal"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_window_matches_float64(target, case, dtype):
    device, _ = target
    *shape, causal, window = case
    q, k, v, do, _ = make_inputs(shape, dtype, device)
    ours = run_remat(q, k, v, do, causal, window_size=window)
    assert_matches_float64(ours, float64_reference(q, k, v, do, causal, window), dtype,
                   exactly_zero=("dq", "dk") if window == (0, 0) else ())


def test_window_wider_than_the_sequence_is_plain_attention(target):
    device, _ = target
    q, k, v, do, _ = make_inputs((1, 2, 2, 30, 45, 32), torch.float32, device)
    for causal in (False, True):
        wide = run_remat(q, k, v, do, causal, window_size=(75, 75))
        plain = run_remat(q, k, v, do, causal)
        for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), wide, plain):
            assert rel_error(got[torch.isfinite(want)], want[torch.isfinite(want)]) < 1e-6, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_with_large_logits_matches_float64(target, causal, dtype):
    """q scaled by 8: the scaled scores reach ~40, far into tanh's saturation at softcap 5."""
    device, _ = target
    q, k, v, do, _ = make_inputs((1, 2, 1, 33, 47, 64), dtype, device, q_gain=8.0)
    ours = run_remat(q, k, v, do, causal, softcap=5.0)
    ref = float64_reference(q, k, v, do, causal, softcap=5.0)
    assert_matches_float64(ours, ref, dtype)
    uncapped = float64_reference(q, k, v, do, causal)
    assert rel_error(ref[0], uncapped[0]) > 0.1  # the cap changes the result: the test can tell it is applied


def test_softcap_fp32_error_within_twice_pytorchs(target):
    """A wide cap (Gemma 2's 50): the scaled scores sit where tanh is nearly linear, where a tanh
    computed as 1 - 2 / (exp(2x) + 1) loses most of its digits to cancellation (8x PyTorch's error)."""
    device, _ = target
    q, k, v, do, _ = make_inputs((1, 2, 2, 40, 40, 64), torch.float32, device, q_gain=4.0)
    ours = run_remat(q, k, v, do, True, softcap=50.0)
    ref = float64_reference(q, k, v, do, True, softcap=50.0)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch_o, _ = attn_ops.attention_ref(*leaves, True, None, -1, -1, 50.0)  # PyTorch's tanh, in fp32
    torch_o.backward(do)
    for name, got, by_torch, want in zip(("o", "dq", "dk", "dv"), (ours[0], *ours[2:]),
                                         (torch_o, *[t.grad for t in leaves]), (ref[0], *ref[2:])):
        assert rel_error(got, want) <= 2 * rel_error(by_torch, want), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alibi, causal", [("head", False), ("batch", True)])
def test_alibi_matches_float64(target, alibi, causal, dtype):
    device, _ = target
    q, k, v, do, slopes = make_inputs((2, 2, 1, 33, 40, 32), dtype, device, alibi=alibi)
    ours = run_remat(q, k, v, do, causal, alibi_slopes=slopes)
    assert_matches_float64(ours, float64_reference(q, k, v, do, causal, alibi_slopes=slopes), dtype)


@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_every_feature_at_once_across_head_dims(target, head_dim):
    """Window, softcap and per-batch ALiBi together, GQA, seqlen_q != seqlen_k, causal, fp16."""
    device, _ = target
    q, k, v, do, slopes = make_inputs((2, 2, 1, 23, 37, head_dim), torch.float16, device, alibi="batch", q_gain=3.0)
    features = dict(window_size=(9, 4), softcap=6.0, alibi_slopes=slopes)
    ours = run_remat(q, k, v, do, True, **features)
    assert_matches_float64(ours, float64_reference(q, k, v, do, True, **features), torch.float16)


# GPU blocks differ between queries and keys (128 x 64, 32 x 128, ...), which moves the window's
# edges relative to the blocks; forced here for all three kernels, with windows narrower and wider
# than a block and negative scales (the forward negates k then).
@pytest.mark.parametrize("config", [(32, 16, 4, 1), (16, 64, 4, 1)], ids=lambda c: f"BM{c[0]}-BN{c[1]}")
@pytest.mark.parametrize("causal, window, scale", [(False, (5, 9), None), (True, (40, -1), -0.3),
                                                   (False, (70, 3), 0.2)])
def test_window_edges_with_rectangular_blocks(target, monkeypatch, config, causal, window, scale):
    device, _ = target
    monkeypatch.setattr(_kernels(), "_select_config", lambda *args: config)
    q, k, v, do, slopes = make_inputs((1, 2, 1, 70, 45, 32), torch.float32, device, alibi="head")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = remat.attention(*leaves, causal=causal, softmax_scale=scale, return_lse=True, window_size=window,
                             softcap=4.0, alibi_slopes=slopes)
    o.backward(do)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = attn_ops.attention_ref(*ref_leaves, causal, scale, *window, 4.0, slopes)
    ref_o.backward(do.double())
    ours = (o, lse, *[t.grad for t in leaves])
    ref = (ref_o, ref_lse, *[t.grad for t in ref_leaves])
    assert_matches_float64(ours, ref, torch.float32)


def test_window_skips_the_blocks_outside_it(target, monkeypatch):
    """NaN in the keys, values and queries of blocks wholly outside the window of a row block:
    a program that visited such a block, even fully masked, would carry NaN into its result
    (0 * NaN is NaN in the matmuls). Window (0, 0) over 16 x 16 blocks: rows 16-63 and their
    keys never meet rows and keys 0-15."""
    device, _ = target
    monkeypatch.setattr(_kernels(), "_select_config", lambda *args: INTERPRETER_BLOCKS)
    q, k, v, do, _ = make_inputs((1, 2, 2, 64, 64, 32), torch.float32, device)
    poisoned = [t.detach().clone() for t in (q, k, v, do)]
    for t in poisoned:
        t[:, :, :16] = float("nan")
    ours = run_remat(*poisoned, False, window_size=(0, 0))
    ref = float64_reference(q, k, v, do, False, (0, 0))
    for name, got, want in zip(("o", "lse", "dv"), (ours[0], ours[1], ours[4]), (ref[0], ref[1], ref[4])):
        assert rel_error(got[:, :, 16:], want[:, :, 16:]) < REL_TOL[torch.float32], name
    for name, got in (("dq", ours[2]), ("dk", ours[3])):  # exactly 0 in the reference: one key per row
        assert torch.isfinite(got[:, :, 16:]).all() and got[:, :, 16:].abs().max() < 1e-4, name


def test_features_change_the_result(target):
    """Each feature on its own moves the output away from plain attention (none is ignored)."""
    device, _ = target
    q, k, v, do, slopes = make_inputs((1, 2, 2, 33, 33, 32), torch.float32, device, alibi="head", q_gain=4.0)
    plain = remat.attention(q, k, v)
    for features in (dict(window_size=(4, 4)), dict(softcap=2.0), dict(alibi_slopes=slopes)):
        assert rel_error(remat.attention(q, k, v, **features), plain) > 0.05, features


# --- the fallbacks -------------------------------------------------------------------------------


def test_unsupported_head_dim_computes_every_feature(target):
    """Head dim 48 is outside the kernels: the reference on CPU, on CUDA the fallback (which takes
    the reference, not SDPA, when a feature is asked for); the features are all there."""
    device, _ = target
    q, k, v, do, slopes = make_inputs((1, 2, 1, 20, 27, 48), torch.float32, device, alibi="batch", q_gain=3.0)
    features = dict(window_size=(6, 2), softcap=3.0, alibi_slopes=slopes)
    attn_ops._warned.clear()  # the fallback warns once per reason
    with pytest.warns(UserWarning, match="head dim 48") if device == "cuda" else contextlib.nullcontext():
        ours = run_remat(q, k, v, do, True, **features)
    assert_matches_float64(ours, float64_reference(q, k, v, do, True, **features), torch.float32)


@pytest.mark.parametrize("features", [(3, 2, 0.0, None), (-1, -1, 2.5, None), (-1, 4, 0.0, "slopes")],
                         ids=["window", "softcap", "alibi"])
def test_cuda_fallback_computes_the_features(features):
    """The CUDA fallback's function (run here on CPU): each feature as the float64 reference has it."""
    q, k, v, do, slopes = make_inputs((2, 4, 2, 13, 17, 48), torch.float32, "cpu", alibi="batch", q_gain=3.0)
    features = features[:3] + ((slopes if features[3] else None),)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = attn_ops._fallback(*leaves, True, 0.3, True, features)
    o.backward(do)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = attn_ops.attention_ref(*ref_leaves, True, 0.3, *features)
    ref_o.backward(do.double())
    assert lse.dtype == torch.float32 and not lse.requires_grad
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *[t.grad for t in leaves]),
                               (ref_o, *[t.grad for t in ref_leaves])):
        assert rel_error(got, want) <= REL_TOL[torch.float32], name


def test_reference_backend_agrees_with_the_kernels(target):
    device, _ = target
    q, k, v, do, slopes = make_inputs((1, 2, 1, 21, 30, 32), torch.float32, device, alibi="head", q_gain=3.0)
    features = dict(window_size=(5, 3), softcap=3.0, alibi_slopes=slopes)
    kernel = run_remat(q, k, v, do, False, **features)
    with remat.use_backend("reference"):
        reference = run_remat(q, k, v, do, False, **features)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), kernel, reference):
        assert rel_error(got, want) < REL_TOL[torch.float32], name


# --- memory, compile ----------------------------------------------------------------------------


def test_saves_qkv_output_lse_and_the_slopes_only(target):
    device, _ = target
    q, k, v, _, slopes = make_inputs((2, 4, 2, 40, 24, 32), torch.float16, device, alibi="batch")
    got = saved_bytes(lambda: remat.attention(q, k, v, causal=True, window_size=(7, -1), softcap=5.0,
                                              alibi_slopes=slopes))
    qkvo = 2 * (q.numel() + k.numel() + v.numel() + q.numel())  # fp16: o has q's shape
    assert got == qkvo + 4 * 2 * 4 * 40 + 4 * slopes.numel()  # + the fp32 lse (B, H, Sq) and the fp32 slopes


def test_torch_compile_fullgraph_matches_eager(target):
    device, _ = target
    torch._dynamo.reset()
    q, k, v, do, slopes = make_inputs((1, 2, 1, 19, 26, 32), torch.float32, device, alibi="head", q_gain=3.0)

    def f(q, k, v):
        return remat.attention(q, k, v, causal=True, window_size=(6, -1), softcap=3.0, alibi_slopes=slopes)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    compiled_grads = torch.autograd.grad(compiled, (q, k, v), do)
    eager = f(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v), do)
    assert torch.equal(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        assert torch.equal(got, want)


# --- bad input ----------------------------------------------------------------------------------


def _qkv():
    return torch.randn(2, 4, 8, 32), torch.randn(2, 2, 8, 32), torch.randn(2, 2, 8, 32)


@pytest.mark.parametrize(
    "features, error, words",
    [
        (dict(window_size=(-2, 0)), ValueError, "window_size must have values >= -1"),
        (dict(window_size=(1.5, 0)), TypeError, "window_size must be a pair of ints"),
        (dict(window_size=(True, 0)), TypeError, "window_size must be a pair of ints"),
        (dict(window_size=4), TypeError, "window_size must be a pair of ints"),
        (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair of ints"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
        (dict(softcap=float("nan")), ValueError, "softcap must be a finite float >= 0"),
        (dict(softcap="5"), ValueError, "softcap must be a finite float >= 0"),
        (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a torch.Tensor"),
        (dict(alibi_slopes=torch.ones(4).half()), TypeError, "alibi_slopes must have dtype torch.float32"),
        (dict(alibi_slopes=torch.ones(2)), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
        (dict(alibi_slopes=torch.ones(1, 4)), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
        (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes is on meta"),
        (dict(alibi_slopes=torch.ones(4, requires_grad=True)), ValueError, "alibi_slopes must not require grad"),
    ],
)
def test_bad_feature_arguments_name_the_argument(features, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        remat.attention(*_qkv(), **features)
