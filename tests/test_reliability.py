"""Cross-cutting robustness: autocast, NaN/Inf, huge tensors, random shapes, and a training run."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remat
from remat.gpt import GPTConfig, remat_stack, torch_stack

import numerics
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


# --- NaN and Inf propagate as the math says, row by row ----------------------------------------


def test_nan_stays_in_its_row(target):
    """The expected NaNs follow from the math, not from PyTorch's CPU kernels (whose handling of inf
    can depend on the vector ISA): a LayerNorm row holding NaN or inf is NaN throughout (inf - mean
    is inf - inf), and GELU is elementwise, with gelu(NaN) = NaN and gelu(+inf) = +inf."""
    device, _ = target
    x = torch.randn(4, 37, device=device)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    y = remat.layer_norm(x, (37,))
    assert torch.isnan(y[[1, 2]]).all()
    assert rel_error(y[[0, 3]], F.layer_norm(x[[0, 3]].double(), (37,))) < REL_TOL[torch.float32]
    g = remat.gelu(x, "tanh")
    nan_at = torch.zeros(x.shape, dtype=torch.bool, device=device)
    nan_at[1, 5] = True
    assert torch.equal(torch.isnan(g), nan_at)
    assert g[2, 0] == float("inf")
    finite = torch.isfinite(x)
    assert rel_error(g[finite], F.gelu(x[finite].double(), approximate="tanh")) < REL_TOL[torch.float32]


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
        for step in range(60):  # enough to learn (the first assertion); each step runs the interpreter
            loss = F.mse_loss(model(data[step % 64]), target_out[step % 64])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
        losses.append(torch.tensor(curve))
    stock_curve, remat_curve = losses
    assert stock_curve[-15:].mean() < 0.8 * stock_curve[:15].mean(), "the stock model did not learn"
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


# --- extreme values: fp16 overflow boundaries and extreme attention logits, as PyTorch ----------

FP16_MAX = torch.finfo(torch.float16).max  # 65504


def assert_like_pytorch(name, ours, theirs, exact, compare_error=True):
    """ours behaves as PyTorch's same-dtype result `theirs`, against the float64 result `exact`.

    - where the exact result, rounded to the dtype, is inf or NaN (an overflow of the dtype, a NaN
      in the math), ours is the same inf (same sign) or NaN. The oracle for non-finite values is
      the float64 result, never PyTorch's same-dtype one: on CPU that depends on the vector ISA
      (torch 2.14.1's fp32 GELU gives NaN for +inf on AVX-512, +inf on AVX2);
    - finite wherever the exact result and PyTorch's are finite (where only PyTorch overflows,
      ours may stay finite);
    - on the elements where both are finite, error at most twice PyTorch's (as FlashAttention's
      tests), or within the dtype's bound.
    compare_error=False checks the first two only, for results whose error is rounding noise in
    both implementations.
    """
    dtype = ours.dtype
    exact_rounded = exact.to(dtype)
    both_finite = torch.isfinite(theirs) & torch.isfinite(exact_rounded)
    assert torch.isfinite(ours[both_finite]).all(), f"{name}: non-finite where PyTorch is finite"
    exact_not = ~torch.isfinite(exact_rounded)
    assert torch.equal(torch.isnan(ours[exact_not]), torch.isnan(exact_rounded[exact_not])), f"{name}: NaN differs"
    assert torch.equal(ours[exact_not].nan_to_num(0.0), exact_rounded[exact_not].nan_to_num(0.0)), (
        f"{name}: inf differs")
    if not compare_error:
        return
    ours_error = rel_error(ours[both_finite], exact[both_finite])
    theirs_error = rel_error(theirs[both_finite], exact[both_finite])
    assert ours_error <= max(REL_TOL[dtype], 2 * theirs_error), (
        f"{name}: error {ours_error:.3g}, PyTorch's {theirs_error:.3g}")


def test_non_finite_values_are_judged_against_float64_not_pytorch():
    """What torch's fp32 GELU gives for +inf on AVX-512 (NaN) is no reason to fail a kernel that
    gives +inf, as float64 does; and a NaN where float64 has +inf is a failure, whatever PyTorch gives."""
    exact = torch.tensor([float("inf"), float("nan"), 0.5], dtype=torch.float64)
    avx512_pytorch = torch.tensor([float("nan"), float("nan"), 0.5])
    assert_like_pytorch("y", torch.tensor([float("inf"), float("nan"), 0.5]), avx512_pytorch, exact)
    with pytest.raises(AssertionError, match="NaN differs"):
        assert_like_pytorch("y", avx512_pytorch.clone(), avx512_pytorch, exact)
    with pytest.raises(AssertionError, match="inf differs"):
        assert_like_pytorch("y", torch.tensor([float("-inf"), float("nan"), 0.5]), avx512_pytorch, exact)


def run_three_ways(ours_fn, theirs_fn, tensors, grad_out):
    """Outputs and gradients of ours, of PyTorch at the same dtype, and of PyTorch in float64."""
    results = []
    for fn, cast in ((ours_fn, None), (theirs_fn, None), (theirs_fn, torch.float64)):
        leaves = [(t.to(cast) if cast else t.clone()).requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.backward(grad_out.to(out.dtype))
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    return results


def _layer_norm_inputs(kind, device):
    rows, width = 4, 40
    if kind == "spread-to-fp16-max":  # x^2 and the variance overflow fp16 many times over
        x = (torch.rand(rows, width, device=device) * 2 - 1) * FP16_MAX
    elif kind == "mean-near-fp16-max":  # mean ~65000, spread of a few ulps (32): cancellation
        x = FP16_MAX - 32.0 * torch.randint(0, 64, (rows, width), device=device)
    elif kind == "one-element-at-fp16-max":  # one outlier a row dominates mean and variance
        x = torch.randn(rows, width, device=device)
        x[:, 7] = FP16_MAX
    else:  # "fp32-squares-near-fp32-max": sum of squares ~4e37, under fp32's 3.4e38
        return torch.randn(rows, width, device=device) * 1e18
    return x.to(torch.float16)


@pytest.mark.parametrize("kind", ["spread-to-fp16-max", "mean-near-fp16-max", "one-element-at-fp16-max",
                                  "fp32-squares-near-fp32-max"])
def test_layer_norm_at_overflow_boundaries_as_pytorch(target, kind):
    """fp32 statistics: no overflow where PyTorch's (also fp32) statistics have none."""
    device, _ = target
    x = _layer_norm_inputs(kind, device)
    width = x.shape[-1]
    w, b = torch.randn(width, device=device), torch.randn(width, device=device)
    params = [w.to(x.dtype), b.to(x.dtype)]

    def ln(fn):
        return lambda x, w, b: fn(x, (width,), w, b)

    ours, theirs, exact = run_three_ways(ln(remat.layer_norm), ln(F.layer_norm), [x, *params],
                                         torch.randn(x.shape, device=device))
    for name, o, t, e in zip(("y", "dx", "dw", "db"), ours, theirs, exact):
        assert_like_pytorch(name, o, t, e)


def _gelu_near_fp16_max(device):
    """fp16 values at and near ±65504, and where gelu itself is tiny or exactly 0/-0."""
    edges = [FP16_MAX, -FP16_MAX, 65000.0, -65000.0, 3e4, -3e4, 1e4, -1e4, 20.0, -20.0, 5.0, -5.0, 0.0]
    return torch.tensor(edges, device=device).repeat(3, 1).to(torch.float16)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_at_fp16_max_as_pytorch(target, approximate):
    device, _ = target
    x = _gelu_near_fp16_max(device)
    ours, theirs, exact = run_three_ways(lambda x: remat.gelu(x, approximate),
                                         lambda x: F.gelu(x, approximate=approximate), [x],
                                         torch.randn(x.shape, device=device))
    for name, o, t, e in zip(("y", "dx"), ours, theirs, exact):
        assert_like_pytorch(name, o, t, e)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_bias_overflowing_fp16_gives_inf_as_pytorch(target, approximate):
    """x + bias past 65504 is inf in fp16 for PyTorch (x + b rounds first); our fused bias adds in
    fp32, and the result gelu(x + b) ~ x + b must still round to inf, not wrap or saturate."""
    device, _ = target
    x = _gelu_near_fp16_max(device)
    bias = torch.full((x.shape[1],), 3e4, device=device).to(torch.float16)
    ours, theirs, exact = run_three_ways(lambda x, b: remat.gelu(x, approximate, b),
                                         lambda x, b: F.gelu(x + b, approximate=approximate), [x, bias],
                                         torch.randn(x.shape, device=device))
    assert torch.isinf(ours[0]).any(), "the case must reach fp16 overflow"
    assert_like_pytorch("y", ours[0], theirs[0], exact[0])


# GELU at ±inf and NaN, in IEEE arithmetic (erf(±inf) = ±1, tanh(±inf) = ±1, exp(-inf) = 0, inf·0 =
# NaN), for both forms: gelu(h) = h·g(h) with g(+inf) = 1, g(-inf) = 0, and gelu'(h) = g(h) + h·g'(h)
# with g'(±inf) = 0. So gelu(+inf) = +inf (its limit); gelu(-inf) = -inf·0 and gelu'(±inf) = ±inf·0
# are NaN, as PyTorch's float64 gives. Written out here because PyTorch's fp32 CPU kernel is no
# oracle: torch 2.14.1 gives NaN for gelu(+inf) on AVX-512 and +inf on AVX2.
INF, NAN = float("inf"), float("nan")
GELU_AT_NON_FINITE = {INF: (INF, NAN), -INF: (NAN, NAN), NAN: (NAN, NAN)}  # h: (gelu(h), gelu'(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_at_infinity_propagates_as_the_math(target, approximate, dtype):
    device, _ = target
    x = torch.tensor([[*GELU_AT_NON_FINITE, 1.0, -0.5]], device=device).to(dtype).requires_grad_()
    y = remat.gelu(x, approximate)
    y.backward(torch.ones_like(y))
    count = len(GELU_AT_NON_FINITE)
    value, slope = (torch.tensor([v], device=device).to(dtype) for v in zip(*GELU_AT_NON_FINITE.values()))
    torch.testing.assert_close(y[:, :count].detach(), value, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(x.grad[:, :count], slope, rtol=0, atol=0, equal_nan=True)
    finite = x.detach()[:, count:].double().requires_grad_()
    exact = F.gelu(finite, approximate=approximate)
    exact.backward(torch.ones_like(exact))
    assert rel_error(y[:, count:], exact) <= REL_TOL[dtype]
    assert rel_error(x.grad[:, count:], finite.grad) <= REL_TOL[dtype]


def _pytorch_flash_attention(q, k, v, causal, softmax_scale):
    """PyTorch's own FlashAttention-style kernels: like ours, they keep an fp32 log-sum-exp and
    recompute the probabilities from it. Its fp32 rounding (~|lse| * 6e-8) bounds the relative
    precision of every recomputed probability, so at logits of 1e3-1e4 their backward, and ours,
    carry ~1e-4 relative error where PyTorch's explicit-softmax math path does not: compared with
    the math path, a FlashAttention-style backward would fail for a reason of the algorithm, not
    of the implementation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)


# (q/k magnitude, softmax_scale): the largest |logit| each gives with head dim 32, seq 24.
EXTREME_LOGITS = {
    "scale-1e3": (1.0, 1e3),  # |logits| ~2e4, near fp16's max
    "scale-1e5": (1.0, 1e5),  # |logits| ~2e6, beyond fp16's max: must not matter in fp32 math
    "scale-minus-1e3": (1.0, -1e3),  # negative: the row maximum is at the smallest q.k
    "qk-x100": (100.0, None),  # |q|, |k| ~100 (fp16 q.k partial sums past 65504), |logits| ~3e4
    "qk-x10-causal": (10.0, None),  # |logits| ~3e2: one-hot rows under a causal mask
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", list(EXTREME_LOGITS))
def test_attention_extreme_logits_as_pytorch(target, case, dtype):
    device, _ = target
    magnitude, softmax_scale = EXTREME_LOGITS[case]
    causal = case.endswith("causal")
    q, k, v = (torch.randn(1, 2, 24, 32, device=device) for _ in range(3))
    q, k, v = (q * magnitude).to(dtype), (k * magnitude).to(dtype), v.to(dtype)

    def ours_fn(q, k, v):
        return remat.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)

    def theirs_fn(q, k, v):
        if q.dtype == torch.float64:  # the float64 reference: the explicit softmax
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
        return _pytorch_flash_attention(q, k, v, causal, softmax_scale)

    ours, theirs, exact = run_three_ways(ours_fn, theirs_fn, [q, k, v], torch.randn(q.shape, device=device))
    # dq and dk of near one-hot rows are sums of terms that cancel: dS = P (dP - delta) with
    # delta = rowsum(dO * O) ~ dP, where both FlashAttention-style backwards round O to the dtype
    # first. Their error relative to the vanishing exact value is rounding noise times
    # softmax_scale (>> 1 at scale 1e3, for PyTorch's as for ours): a ratio of two noises is no
    # measure, so dq and dk are held to PyTorch's finiteness only; o to its accuracy.
    # dv guards the backward's recomputed probabilities. Its error, in fp16 as in fp32 (the scores
    # and the lse are fp32 in both), is the algorithm's (see _pytorch_flash_attention): each
    # probability recomputed as exp(s - lse) carries the fp32 roundings of s and lse, a few
    # |s| 2^-24 each in its exponent (a few percent at scale 1e5, |s| ~ 2e6). PyTorch's CPU flash
    # backward is no oracle for it: which error it carries depends on the CPU (fp16 dv at scale 1e5:
    # 0.14 on an AVX2 CPU, 0.0003 on an AVX512-FP16 one), so dv is held to 4 |logit|max 2^-24, or
    # the dtype's bound, on every CPU. Ours is the same on every CPU: under the interpreter tl.dot
    # gives the exact product rounded once (conftest.py, numerics.py); with numpy's BLAS deciding
    # the rounding of s, the same inputs gave 0.095 on one CPU kernel and 0.026 on another.
    scale = softmax_scale or q.shape[-1] ** -0.5
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
    for name, o, t, e in zip(("o", "dq", "dk", "dv"), ours, theirs, exact):
        assert_like_pytorch(name, o, t, e, compare_error=name == "o")
    bound = max(REL_TOL[dtype], 4 * logits.abs().nan_to_num(posinf=0.0).max().item() * 2**-24)
    dv_error = rel_error(ours[3], exact[3])
    assert dv_error <= bound, (f"dv: error {dv_error:.3g} > {bound:.3g}: the backward's probabilities exp(s - lse) "
                               "drift further from the forward's than fp32 rounding of the scores and lse allows")
    _, lse = remat.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    assert rel_error(lse, torch.logsumexp(logits, dim=-1)) <= REL_TOL[torch.float32]


# --- the interpreter's arithmetic is the same on every CPU ----------------------------------------
# numpy dispatches its loops on the CPU it runs on (OpenBLAS's sgemm kernel for matmul, AVX-512 and
# AVX512-FP16 variants of its math loops), so under the Triton interpreter a kernel's result could
# depend on the CPU. conftest.py replaces the interpreter's tl.dot and fp32 math functions
# (numerics.make_interpreter_dots_and_math_isa_independent); these tests hold them to results that
# follow from the inputs alone, on operands where any CPU-dependent arithmetic gives other bits.


def _interpreter_only(device):
    if device != "cpu":
        pytest.skip("the interpreter's arithmetic: CPU tensors only")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=["fp32-out", "fp16-out"])
def test_interpreter_dot_is_the_exact_product_rounded_once(target, dtype, out_dtype):
    """tl.dot gives bitwise the exact product rounded once, where numpy's fp32 matmul (the CPU's
    BLAS kernel) and fp16 accumulation (numpy's half arithmetic) each give other bits."""
    device, _ = target
    _interpreter_only(device)
    a, b = numerics.adversarial_dot_operands(dtype)
    want = numerics.exact_dot_in(a, b, out_dtype)
    blas_fp32 = torch.from_numpy(np.matmul(a.float().numpy(), b.float().numpy()))
    half_sums = torch.from_numpy(_half_sums(a.half().numpy(), b.half().numpy()))
    assert not torch.equal(blas_fp32.to(out_dtype), want) and not torch.equal(half_sums.to(out_dtype), want), (
        "the operands must tell the exact product from fp32 and fp16 accumulation")
    got = numerics.triton_dot(a, b, out_dtype)
    assert torch.equal(got, want), (
        f"the interpreter's {dtype} tl.dot is not the exact product rounded once: it depends on how the CPU sums")


def _half_sums(a, b):
    """a @ b (numpy fp16) summed in fp16 arithmetic, as native half-precision loops would."""
    total = np.zeros((a.shape[0], b.shape[1]), dtype=np.float16)
    with np.errstate(all="ignore"):
        for k in range(a.shape[1]):
            total = total + a[:, k, None] * b[None, k, :]
    return total


def _half_arithmetic_dot(builder, a, b, d, *rest, **kwargs):
    """tl.dot as numpy's half-precision arithmetic would compute it on fp16 operands: fp16 sums."""
    from triton.runtime import interpreter

    product = _half_sums(a.data.astype(np.float16), b.data.astype(np.float16)).astype(d.data.dtype)
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)


@pytest.mark.parametrize("simulated", ["interpreters-own-blas-dot", "half-arithmetic-dot"])
def test_the_dot_check_sees_cpu_dependent_sums(target, monkeypatch, simulated):
    """The check conftest.py asserts after patching is no constant: with the interpreter's own dot
    (numpy's fp32 BLAS matmul) or a dot summing in fp16, it reports the dot inexact."""
    device, _ = target
    _interpreter_only(device)
    from triton.runtime import interpreter

    assert numerics.interpreter_dots_are_exact()
    own = interpreter.InterpreterBuilder.create_dot.__wrapped__
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        own if simulated == "interpreters-own-blas-dot" else _half_arithmetic_dot)
    assert not numerics.interpreter_dots_are_exact()


def test_interpreter_fp32_math_is_float64_rounded_and_the_check_is_no_constant(target, monkeypatch):
    """fp32 exp2 and friends are numpy's float64 functions rounded to fp32 (the same bits on every
    CPU); a loop one ulp off, as a CPU's own vector loop may be, fails the check."""
    device, _ = target
    _interpreter_only(device)
    from triton.runtime import interpreter

    assert numerics.interpreter_fp32_math_is_widened()
    patched = interpreter.InterpreterBuilder.create_exp2

    def one_ulp_off(builder, arg):
        exact = patched(builder, arg)
        return interpreter.TensorHandle(np.nextafter(exact.data, np.float32(np.inf)), exact.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp2", one_ulp_off)
    assert not numerics.interpreter_fp32_math_is_widened()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e30 -> inf: meant
def test_interpreter_fp16_casts_round_to_nearest_even(target):
    """An fp32 -> fp16 store rounds to nearest even, as a GPU's: halfway cases, subnormals and the
    overflow boundary (65520 and up round to inf), bitwise as torch's conversion."""
    device, _ = target
    ulp = 2.0**-10
    values = [1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2**-20, -(1 + ulp / 2), 2**-24 * 1.5, 2**-24 * 0.5,
              2**-25 * 1.0001, 6.1e-5, 65504.0, 65519.99, 65520.0, -65520.0, 1e30, float("inf"), 0.1, -0.0]
    x = torch.tensor(values, device=device)
    stored = numerics.triton_store(x, torch.float16)
    assert torch.equal(stored.view(torch.int16), x.to(torch.float16).view(torch.int16)), (
        "the interpreter's fp32 -> fp16 cast does not round to nearest even")


# --- multi-GPU callers: Triton launches on the current device, not the tensors' ----------------
def test_triton_launchers_switch_to_their_inputs_device(monkeypatch):
    """Every public Triton launcher makes its first tensor's device current while it runs (a
    kernel launched on another GPU would read the wrong memory). Recorded with a stand-in for
    torch.cuda.device, so it runs without a GPU; CPU tensors leave the device alone."""
    import types

    from remat.triton_kernels import _common, attention, gelu, layer_norm

    entered = []

    class RecordingDevice:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "device", RecordingDevice)
    calls = []
    launch = _common.on_input_device(lambda first, *args: calls.append((first, args)) or "done")
    on_gpu1 = types.SimpleNamespace(device=torch.device("cuda", 1))
    assert launch(on_gpu1, 2) == "done"
    assert entered == [torch.device("cuda", 1), "exit"] and calls == [(on_gpu1, (2,))]
    launch(torch.zeros(1), 3)
    assert len(entered) == 2 and len(calls) == 2
    launchers = [layer_norm.layer_norm_fwd, layer_norm.layer_norm_bwd, gelu.gelu_fwd, gelu.gelu_bwd,
                 attention.attention_fwd, attention.attention_bwd]
    undecorated = [f.__name__ for f in launchers if getattr(f, "__wrapped__", None) is None]
    assert not undecorated, f"launchers without the device switch: {undecorated}"
