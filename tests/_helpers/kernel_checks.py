"""Shared by the test files that call Triton launchers directly (test_rms_norm_kernels.py,
test_gated_kernels.py): the devices they run on, and the check that an error is at most twice
PyTorch's own."""

import pytest
import torch

from remat import _backend

from numerics import rel_error

# Our error may be twice PyTorch's own, plus the noise of our own fp32 arithmetic: four fp32 unit
# roundoffs, which only shows for fp32 results of a handful of elements where PyTorch may happen to
# round luckily (1.2e-7 against 2.6e-8 seen for one element); for fp16/bf16 results it is below a
# thousandth of one rounding of the output.
FP32_NOISE = 4 * 2.0**-24

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES, name="device")
def kernel_device(request):
    """The device the launchers run on: CPU through the Triton interpreter, and a GPU when present."""
    if request.param == "cpu" and not _backend.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is not set: no Triton kernel runs on CPU tensors")
    return request.param


def assert_within_twice_stock(name, ours, want, theirs, terms=None):
    """ours and theirs (the stock implementation's result) have one dtype, and ours is no more than
    twice as far from the float64 `want` as theirs (relative error, plus FP32_NOISE).

    terms: the size of the terms `want` is a sum of, where they may cancel (dy · up for a gated
    activation's d_gate, whose derivative has a root): the noise allowance is then FP32_NOISE of
    their size, since fp32 arithmetic errs by a few roundoffs of its operands, not of a result that
    cancels to near zero (a single element near act's root otherwise fails either implementation)."""
    assert ours.dtype == theirs.dtype, f"{name}: dtype {ours.dtype}, the stock implementation gives {theirs.dtype}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    ours_error, stock_error = rel_error(ours, want), rel_error(theirs, want)
    noise = FP32_NOISE
    if terms is not None and want.norm() > 0:
        noise *= max(1.0, (terms.double().norm() / want.double().norm()).item())
    assert ours_error <= 2 * stock_error + noise, f"{name}: error {ours_error:.3g}, stock's {stock_error:.3g}"
