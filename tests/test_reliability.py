"""Cross-cutting robustness: autocast, NaN/Inf, huge tensors, random shapes, and a training run."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remat
from remat.gpt import GPTConfig, remat_stack, torch_stack
from numerics import REL_TOL, rel_error

# --- autocast: the same output dtypes as PyTorch's own layers ----------------------------------


def test_autocast_dtypes_match_pytorch(target):
    device, _ = target
    amp = torch.bfloat16
    x = torch.randn(2, 8, 32, device=device)
    stock = remat.nn.LayerNormMLP(32, 64).to(device)
    stack = torch.nn.Sequential(stock.norm, stock.fc1, torch.nn.GELU(), stock.fc2)
    q = torch.randn(1, 2, 8, 16, device=device)
    with torch.autocast(device, dtype=amp):
        pairs = [
            (remat.layer_norm(x, (32,)), F.layer_norm(x, (32,))),
            (remat.gelu(x.to(amp)), F.gelu(x.to(amp))),
            (stock(x), stack(x)),
            (remat.attention(q, q, q), F.scaled_dot_product_attention(q, q, q)),
        ]
        loss = stock(x).float().sum()
    for ours, theirs in pairs:
        assert ours.dtype == theirs.dtype
        assert rel_error(ours, theirs) < REL_TOL[torch.bfloat16]
    loss.backward()  # outside autocast, like a training step
    assert stock.fc1.weight.grad.dtype == torch.float32


# --- NaN and Inf propagate as in PyTorch, row by row -------------------------------------------


def test_nan_stays_in_its_row(target):
    device, _ = target
    x = torch.randn(4, 37, device=device)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    y = remat.layer_norm(x, (37,))
    expected = F.layer_norm(x, (37,))
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert rel_error(y[[0, 3]], expected[[0, 3]]) < REL_TOL[torch.float32]
    g = remat.gelu(x, "tanh")
    assert torch.equal(torch.isnan(g), torch.isnan(F.gelu(x, approximate="tanh")))


# --- random shapes, strides and dtypes against the reference -----------------------------------

shapes = st.tuples(st.integers(1, 9), st.integers(1, 300))
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, dtype=dtypes, row_padding=st.integers(0, 7), affine=st.booleans())
def test_layer_norm_property(target, shape, dtype, row_padding, affine):
    device, _ = target
    rows, width = shape
    x = torch.randn(rows, width + row_padding, device=device).to(dtype)[:, :width]
    w = torch.randn(width, device=device) if affine else None
    want = F.layer_norm(x.double(), (width,), w.double() if affine else None)
    assert rel_error(remat.layer_norm(x, (width,), w), want) <= REL_TOL[dtype]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, dtype=dtypes, approximate=st.sampled_from(["none", "tanh"]), with_bias=st.booleans())
def test_gelu_property(target, shape, dtype, approximate, with_bias):
    device, _ = target
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    b = torch.randn(shape[1], device=device).to(dtype) if with_bias else None
    h = x + b if with_bias else x
    want = F.gelu(x.double() + (b.double() if with_bias else 0), approximate=approximate)
    # Far in the negative tail (h < -4) exact GELU's 1 + erf(h/√2) cancels in fp32, in PyTorch's
    # own kernel as in ours: a lone such element is held to twice PyTorch's same-dtype error.
    torch_own = rel_error(F.gelu(h, approximate=approximate), want)
    assert rel_error(remat.gelu(x, approximate, b), want) <= max(REL_TOL[dtype], 2 * torch_own)


# --- a small model trains the same with and without remat --------------------------------------


def test_training_tracks_stock(target):
    device, _ = target
    torch.manual_seed(0)
    config = GPTConfig(hidden=32, heads=2, layers=2)
    stock = torch_stack(config, device=device)
    ours = remat_stack(stock)
    data = torch.randn(64, 2, 8, 32, device=device)
    target_out = torch.randn(64, 2, 8, 32, device=device)
    losses = []
    for model in (stock, ours):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for step in range(200):
            loss = F.mse_loss(model(data[step % 64]), target_out[step % 64])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
        losses.append(torch.tensor(curve))
    stock_curve, remat_curve = losses
    assert stock_curve[-20:].mean() < 0.8 * stock_curve[:20].mean(), "the stock model did not learn"
    assert (stock_curve - remat_curve).abs().max() < 1e-3 * stock_curve.max()


# --- more than 2^31 elements (GPU only) --------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with > 10 GB free")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_more_than_2_31_elements(backend):
    if not remat.backends()[backend][0]:
        pytest.skip(remat.backends()[backend][1])
    rows, width = 2**17 + 3, 2**14 + 8  # 2.15e9 elements, > 2^31
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    with remat.use_backend(backend):
        y = remat.layer_norm(x, (width,))
        last = y[-4:].float()
        assert rel_error(last, F.layer_norm(x[-4:].float(), (width,))) < REL_TOL[torch.bfloat16]
        del y
        g = remat.gelu(x)
        assert rel_error(g[-4:], F.gelu(x[-4:].float())) < REL_TOL[torch.bfloat16]
