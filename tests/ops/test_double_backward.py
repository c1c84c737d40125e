"""Double backward (create_graph=True, then a second backward) through remat.layer_norm, remat.gelu
and remat.attention: the first backward runs the differentiable reference there, so the second
gives what PyTorch's own double backward gives. The fused layers refuse it with a clear error."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import remat
from remat.ops import attention as attn_ops
from remat.ops import gelu as gelu_ops
from remat.ops import layer_norm as ln_ops

from numerics import REL_TOL, rel_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def first_and_second_order(fn, tensors, dy, weights):
    """The gradients of fn(*tensors) against dy, and the gradients of Σ weights·gradients with
    respect to the tensors and dy: what a gradient penalty differentiates."""
    tensors, (dy,) = _leaves(*tensors), _leaves(dy)
    out = fn(*tensors)
    grads = torch.autograd.grad(out, tensors, dy.to(out.dtype), create_graph=True)
    penalty = sum((g.double() * w).sum() for g, w in zip(grads, weights))
    second = torch.autograd.grad(penalty, [*tensors, dy], allow_unused=True, materialize_grads=True)
    return [g.detach() for g in grads], list(second)


def assert_double_backward_like_pytorch(ours_fn, theirs_fn, tensors, dtype):
    """First- and second-order gradients of ours in `dtype` against PyTorch's in float64: within
    the dtype's bound, or twice the error of PyTorch's own at `dtype` (as FlashAttention's tests)."""
    tensors = [t.to(dtype) for t in tensors]
    out = theirs_fn(*[t.double() for t in tensors])
    dy = torch.randn(out.shape, dtype=torch.float64, device=out.device)
    weights = [torch.randn(t.shape, dtype=torch.float64, device=t.device) for t in tensors]
    ours = first_and_second_order(ours_fn, tensors, dy.to(dtype), weights)
    theirs = first_and_second_order(theirs_fn, tensors, dy.to(dtype), weights)
    exact = first_and_second_order(theirs_fn, [t.double() for t in tensors], dy, weights)
    for order, o, t, e in zip(("first", "second"), ours, theirs, exact):
        for i, (mine, torch_own, want) in enumerate(zip(o, t, e)):
            error, bound = rel_error(mine, want), max(REL_TOL[dtype], 2 * rel_error(torch_own, want))
            assert error <= bound, f"{order}-order gradient {i}: {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_layer_norm_double_backward_matches_pytorch(target, dtype, affine):
    device, _ = target
    width = 37
    x = torch.randn(2, 3, width, device=device)
    params = [torch.randn(width, device=device), torch.randn(width, device=device)] if affine else []

    def ours(x, *params):
        return remat.layer_norm(x, (width,), *params)

    def theirs(x, *params):
        return F.layer_norm(x, (width,), *params)

    assert_double_backward_like_pytorch(ours, theirs, [x, *params], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_double_backward_matches_pytorch(target, dtype, approximate):
    device, _ = target
    x, bias = torch.randn(5, 33, device=device) * 3, torch.randn(33, device=device)

    def ours(x, bias):
        return remat.gelu(x, approximate, bias)

    def theirs(x, bias):
        return F.gelu(x + bias, approximate=approximate)

    assert_double_backward_like_pytorch(ours, theirs, [x, bias], dtype)


def _sdpa_bottom_right(q, k, v, causal):
    """PyTorch's attention with remat's conventions (GQA heads repeated, causal bottom-right), on
    the math backend: the one that has a double backward."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    mask = attn_ops._visible_mask(q.shape[2], k.shape[2], q.device) if causal else None
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


ATTENTION_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_double_backward_matches_pytorch(target, dtype, causal):
    device, _ = target
    q = torch.randn(1, 4, 9, 32, device=device)
    k, v = torch.randn(1, 2, 13, 32, device=device), torch.randn(1, 2, 13, 32, device=device)

    def ours(q, k, v):
        return remat.attention(q, k, v, causal=causal)

    def theirs(q, k, v):
        return _sdpa_bottom_right(q, k, v, causal)

    assert_double_backward_like_pytorch(ours, theirs, [q, k, v], dtype)


# --- the second derivatives themselves, by finite differences, in float64 ----------------------


def test_layer_norm_gradgradcheck(reference_backend):
    x, w, b = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((4, 7), (7,), (7,)))
    assert torch.autograd.gradgradcheck(lambda x, w, b: ln_ops.layer_norm_fwd(x, w, b, 1e-5)[0], (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x: ln_ops.layer_norm_fwd(x, None, None, 1e-5)[0], (x,))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_gradgradcheck(reference_backend, approximate):
    x, bias = torch.randn(4, 7, dtype=torch.float64) * 3, torch.randn(7, dtype=torch.float64)
    x, bias = x.requires_grad_(), bias.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x, b: gelu_ops.gelu_fwd(x, b, approximate), (x, bias))
    assert torch.autograd.gradgradcheck(lambda x: gelu_ops.gelu_fwd(x, None, approximate), (x,))


@pytest.mark.parametrize("seqlens", [(5, 7), (7, 4)], ids=["q5-k7", "q7-k4-rows-seeing-no-key"])
def test_attention_gradgradcheck(reference_backend, seqlens):
    seqlen_q, seqlen_k = seqlens
    q = torch.randn(1, 2, seqlen_q, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, seqlen_k, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradgradcheck(lambda q, k, v: attn_ops.attention_fwd(q, k, v, True, 0.5)[0], (q, k, v))


# --- the fused layers: a clear error ----------------------------------------------------------


FUSED = {
    "mlp": (lambda x, w1, w2: remat.mlp(x, w1, None, w2, None), "remat::gelu_bwd"),
    "layer_norm_linear": (lambda x, w1, w2: remat.layer_norm_linear(x, None, None, w1, None), "remat::layer_norm_bwd"),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_layers_refuse_double_backward_naming_remat_and_the_workaround(target, name):
    device, _ = target
    fused, backward_op = FUSED[name]
    x, w1, w2 = _leaves(torch.randn(3, 8, device=device), torch.randn(16, 8, device=device),
                        torch.randn(8, 16, device=device))
    out = fused(x, w1, w2)
    (dx,) = torch.autograd.grad(out, x, torch.randn_like(out), create_graph=True)
    expected = (rf"{backward_op} has no derivative: remat's fused layers .* do not support a double backward "
                r"\(create_graph=True\)\. remat\.layer_norm, remat\.gelu and remat\.attention do")
    with pytest.raises(NotImplementedError, match=expected):
        dx.square().sum().backward()
