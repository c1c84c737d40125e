"""Attention's dropout: the mask regenerated from a seed (never stored), against a reference that
rebuilds the same mask, reproducibility, statistics, gradients, checkpointing and memory."""


import pytest
import torch
import triton
import triton.language as tl

import remat
from remat.ops import attention as attn_ops

from attention_checks import deterministic_algorithms
from kernel_modules import kernel_module
from numerics import REL_TOL, rel_error, saved_bytes

KERNELS = kernel_module("attention")
_dropout_kept = KERNELS._dropout_kept  # a global of the test kernel below: Triton compiles the call on a GPU


def make_inputs(shape, dtype, device):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    q = torch.randn(batch, heads, seqlen_q, head_dim, device=device).to(dtype).requires_grad_()
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device).to(dtype).requires_grad_()
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device).to(dtype).requires_grad_()
    return q, k, v, torch.randn(batch, heads, seqlen_q, head_dim, device=device).to(dtype)


def outputs_and_grads(q, k, v, do, **kwargs):
    o = remat.attention(q, k, v, **kwargs)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


# --- the mask: the kernels' generator and its PyTorch reference ----------------------------------


@triton.jit
def _write_mask(Seed, Out, seqlen_q, seqlen_k, heads, dropout_threshold, BLOCK: tl.constexpr):
    # Out[b, h, i, j] = the kernels' _dropout_kept for (b * heads + h, i, j): one program per (b, h, row block).
    pid = tl.program_id(0)
    blocks = tl.cdiv(seqlen_q, BLOCK)
    slice_index = pid // blocks
    rows = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    kept = _dropout_kept(tl.load(Seed), slice_index, rows[:, None], cols[None, :], dropout_threshold)
    mask = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    offsets = slice_index * seqlen_q * seqlen_k + rows[:, None] * seqlen_k + cols[None, :]
    tl.store(Out + offsets, kept.to(tl.int8), mask=mask)


def kernel_mask(seed, batch, heads, seqlen_q, seqlen_k, dropout_p, device):
    out = torch.zeros(batch, heads, seqlen_q, seqlen_k, dtype=torch.int8, device=device)
    block = triton.next_power_of_2(max(seqlen_q, seqlen_k))
    threshold = KERNELS.dropout_threshold(dropout_p)
    _write_mask[(batch * heads * triton.cdiv(seqlen_q, block),)](
        torch.tensor([seed], dtype=torch.int64, device=device), out, seqlen_q, seqlen_k, heads, threshold, BLOCK=block)
    return out.bool()


@pytest.mark.parametrize("seed", [0, 12345, -2**62 - 7])
def test_reference_mask_is_the_kernels_generator(target, seed):
    """dropout_keep_mask (PyTorch) and the kernels' _dropout_kept (Triton's Philox) agree bit for bit."""
    device, _ = target
    got = kernel_mask(seed, 2, 3, 20, 32, 0.3, device)
    want = attn_ops.dropout_keep_mask(seed, 2, 3, 20, 32, 0.3, device)
    assert torch.equal(got, want)


def test_kept_fraction_is_one_minus_p_within_binomial_error():
    n = 2 * 4 * 64 * 64
    for p in (0.1, 0.5, 0.9):
        kept = attn_ops.dropout_keep_mask(2024, 2, 4, 64, 64, p).float().mean().item()
        assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5, p  # 4 standard deviations


def test_masks_differ_across_positions_heads_and_seeds():
    a = attn_ops.dropout_keep_mask(7, 2, 2, 32, 32, 0.5)
    assert not torch.equal(a[0, 0], a[0, 1]) and not torch.equal(a[0, 0], a[1, 0])
    assert not torch.equal(a[0, 0, 0], a[0, 0, 1])
    assert not torch.equal(a, attn_ops.dropout_keep_mask(8, 2, 2, 32, 32, 0.5))


# --- the kernels against the reference with the same mask --------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (9, -1))])
def test_matches_float64_with_the_same_mask(target, dtype, causal, window):
    """o, dq, dk, dv against the float64 reference fed the same seed (so the same mask), GQA, Sq != Sk."""
    device, _ = target
    q, k, v, do = make_inputs((1, 2, 1, 33, 40, 32), dtype, device)
    seed = torch.tensor([31337], dtype=torch.int64, device=device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, _ = attn_ops.attention_fwd(*leaves, causal, 0.2, *window, 0.0, None, 0.25, seed)
    ours = (o, *torch.autograd.grad(o, leaves, do))
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = attn_ops.attention_ref(*ref_leaves, causal, 0.2, *window, 0.0, None, 0.25, seed)
    ref = (ref_o, *torch.autograd.grad(ref_o, ref_leaves, do.double()))
    for name, got, want in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert rel_error(got, want) <= REL_TOL[dtype], f"{name}: {rel_error(got, want):.3g}"
    no_dropout, _ = attn_ops.attention_ref(*ref_leaves, causal, 0.2, *window)
    assert rel_error(ref_o, no_dropout) > 0.1  # the mask is there


# --- reproducibility and the generator -----------------------------------------------------------


def test_manual_seed_reproduces_outputs_and_gradients_bitwise(target):
    """The gradients bitwise under torch.use_deterministic_algorithms(True), as the CUDA kernels'
    dQ needs (test_attention.py's test_backward_is_deterministic)."""
    device, _ = target
    q, k, v, do = make_inputs((1, 1, 1, 30, 37, 32), torch.float16, device)
    runs = []
    with deterministic_algorithms():
        for seed in (5, 5, 6):
            torch.manual_seed(seed)
            runs.append(outputs_and_grads(q, k, v, do, causal=True, dropout_p=0.2))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])
    second = outputs_and_grads(q, k, v, do, causal=True, dropout_p=0.2)  # the generator moved on
    assert not torch.equal(runs[2][0], second[0])


def test_mean_over_seeds_approaches_the_output_without_dropout(target):
    """E[mask / (1 - p)] = 1, so the mean output over seeds tends to plain attention's (as 1 / sqrt(n))."""
    device, _ = target
    q, k, v, _ = make_inputs((1, 1, 1, 16, 16, 32), torch.float32, device)
    plain = remat.attention(q, k, v).detach()
    with torch.no_grad():
        outputs = [remat.attention(q, k, v, dropout_p=0.5) for _ in range(64)]
    first = rel_error(outputs[0], plain)
    mean = rel_error(torch.stack(outputs).mean(0), plain)
    assert first > 0.3 and mean < 2.5 * first / 64**0.5


def test_gradient_matches_a_directional_finite_difference_at_the_same_seed(target):
    """(f(x + h d) - f(x - h d)) / 2h at one seed against <grad f, d>, f = <o, w>, in fp32."""
    device, _ = target
    q, k, v, _ = make_inputs((1, 2, 1, 20, 25, 32), torch.float32, device)
    weight = torch.randn(q.shape, device=device)
    directions = [torch.randn_like(t) for t in (q, k, v)]

    def f(q, k, v):
        torch.manual_seed(99)
        return (remat.attention(q, k, v, causal=True, dropout_p=0.3) * weight).sum()

    grads = torch.autograd.grad(f(q, k, v), (q, k, v))
    step = 1e-3
    with torch.no_grad():
        plus = f(*[t + step * d for t, d in zip((q, k, v), directions)])
        minus = f(*[t - step * d for t, d in zip((q, k, v), directions)])
    numeric = (plus - minus).double() / (2 * step)
    analytic = sum((g.double() * d.double()).sum() for g, d in zip(grads, directions))
    assert abs(numeric - analytic) <= 1e-3 * abs(analytic) + 1e-3


def test_checkpointing_recomputes_the_same_mask(target):
    device, _ = target
    q, k, v, do = make_inputs((1, 2, 2, 24, 24, 32), torch.float32, device)
    torch.manual_seed(3)
    plain = outputs_and_grads(q, k, v, do, dropout_p=0.4)
    torch.manual_seed(3)
    o = torch.utils.checkpoint.checkpoint(lambda q, k, v: remat.attention(q, k, v, dropout_p=0.4), q, k, v,
                                          use_reentrant=False)
    checkpointed = (o, *torch.autograd.grad(o, (q, k, v), do))
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_torch_compile_fullgraph_reproduces_eager(target):
    device, _ = target
    torch._dynamo.reset()
    q, k, v, do = make_inputs((1, 2, 1, 19, 26, 32), torch.float32, device)

    def f(q, k, v):
        return remat.attention(q, k, v, causal=True, dropout_p=0.3)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(11)
    got = compiled(q, k, v)
    torch.manual_seed(11)
    want = f(q, k, v)
    assert torch.equal(got, want)
    assert not torch.equal(compiled(q, k, v), got)  # a fresh seed per call, not one baked into the graph


# --- memory, bad input ---------------------------------------------------------------------------


def test_saves_qkv_output_lse_and_the_seed_only(target):
    """No mask, nothing of size seqlen_q x seqlen_k: the 8-byte seed regenerates the mask."""
    device, _ = target
    q, k, v, _ = make_inputs((2, 4, 2, 40, 24, 32), torch.float16, device)
    got = saved_bytes(lambda: remat.attention(q, k, v, causal=True, dropout_p=0.1))
    assert got == 2 * (2 * q.numel() + k.numel() + v.numel()) + 4 * 2 * 4 * 40 + 8


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, float("nan"), "0.1", True])
def test_bad_dropout_p_names_the_argument(dropout_p):
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        remat.attention(q, q, q, dropout_p=dropout_p)
