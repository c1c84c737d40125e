"""Measures shared by the tests: numerical error against a reference, bytes saved by autograd, and
the bf16 rounding and bf16 matrix products of the Triton interpreter."""

import copy
import functools
import re

import torch

from remat import saved as remat_saved
from remat._numerics import rel_error  # noqa: F401 - the tests' error measure is remat's

# Bound on ‖out − ref‖ / ‖ref‖ against a float64 reference. Each is a few times the rounding of
# the output dtype itself (unit roundoff: fp32 6e-8, fp16 4.9e-4, bf16 3.9e-3), leaving room for
# fp32 accumulation over up to ~1e5 terms.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close_to_ref(name, out, ref, dtype):
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    error = rel_error(out, ref)
    assert error <= REL_TOL[dtype], f"{name}: relative error {error:.3g} > {REL_TOL[dtype]:.1g} ({dtype})"


def saved_bytes(fn, exclude=()):
    """Bytes of the unique storages autograd saves while running fn(), leaving out those of `exclude`
    (remat.saved's counter, which remat memory and the benchmarks use too). Pass a model's
    parameters as `exclude` to count activations only."""
    return remat_saved.saved_bytes(fn, exclude)


def activation_bytes(module, *inputs):
    """Bytes autograd saves for module(*inputs), its parameters left out."""
    return saved_bytes(lambda: module(*inputs), exclude=list(module.parameters()))


# The torch.compile backend of the compile tests: Inductor on a GPU; on CPU AOTAutograd's tracing
# alone ("aot_eager"), which is what checks remat's ops (their fakes, autograd and no graph break:
# Inductor treats them as opaque calls), while Inductor's C++ code generation for the PyTorch ops
# around them costs tens of seconds a test. tests/fused/test_gpt.py compiles a stack with Inductor
# on CPU too.
COMPILE_BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"


def assert_compiled_matches_eager(model, x, tol=1e-5, backend=COMPILE_BACKEND):
    """torch.compile(fullgraph=True) of model runs without a graph break and gives eager's output and gradients."""
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend=backend)(x)
    out.sum().backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x)
    expected.sum().backward()
    assert rel_error(out, expected) < tol
    for (name, p), got in zip(model.named_parameters(), compiled_grads):
        assert rel_error(got, p.grad) < tol, name


# --- bf16 rounding under the Triton interpreter ------------------------------------------------
# A GPU rounds an fp32 -> bf16 cast in a Triton kernel (a store into a bf16 tensor, x.to(tl.bfloat16))
# to nearest even. The Triton interpreter (3.8 at least) truncates it: its cast calls
# triton.runtime.interpreter._convert_float without a rounding mode. Truncation errs by up to one
# bf16 ulp where rounding errs by half of one, so on CPU every bf16 bound would be measured on
# other arithmetic than the GPU's. The test process detects the truncation and replaces the
# conversion by torch's round-to-nearest-even one (round_interpreter_bf16_casts_to_nearest, called
# from conftest.py), so that the CPU tests round as the GPU does and the bf16 bounds mean the same.

# 1 + 3·2⁻⁹ lies 3/4 of a bf16 ulp (2⁻⁷) above 1: rounding gives 1 + 2⁻⁷, truncation gives 1.
BF16_PROBE = (1 + 3 * 2**-9, -(1 + 3 * 2**-9))
BF16_PROBE_ROUNDED = (1 + 2**-7, -(1 + 2**-7))


@functools.cache
def _bf16_store_kernel():
    """A Triton kernel storing fp32 values into a bf16 tensor, defined on first use: TRITON_INTERPRET
    must be set (by conftest.py) before a kernel is decorated."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_as_bf16(X, Y, n, BLOCK: tl.constexpr):  # X: (n,) fp32; Y: (n,) bf16 (or any dtype)
        offsets = tl.arange(0, BLOCK)
        tl.store(Y + offsets, tl.load(X + offsets, mask=offsets < n), mask=offsets < n)

    return store_as_bf16


def triton_store(x, dtype):
    """x (1-D fp32) as a Triton kernel stores it into a tensor of `dtype`: the cast every kernel's store does."""
    import triton

    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    _bf16_store_kernel()[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(max(x.numel(), 1)))
    return y


def triton_bf16_store(x):
    """x (1-D fp32) as a Triton kernel stores it into a bf16 tensor."""
    return triton_store(x, torch.bfloat16)


def triton_rounds_bf16_to_nearest(device="cpu"):
    """True when Triton's fp32 -> bf16 cast on `device` rounds to nearest, False when it truncates."""
    stored = triton_bf16_store(torch.tensor(BF16_PROBE, device=device))
    return stored.tolist() == list(BF16_PROBE_ROUNDED)


def round_interpreter_bf16_casts_to_nearest():
    """Makes the Triton interpreter's fp32 -> bf16 casts round to nearest even, as the GPU's do.

    Returns True when it had to patch (the interpreter truncated), False when the interpreter rounds
    already. Raises if it truncates and the conversion it patches is gone (a newer Triton): then the
    patch needs updating, rather than bf16 tests silently measured on truncation.
    """
    if triton_rounds_bf16_to_nearest():
        return False
    import numpy as np
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    truncating = getattr(interpreter, "_convert_float", None)
    if truncating is None:
        raise RuntimeError("the Triton interpreter truncates fp32 -> bf16 casts, and "
                           "triton.runtime.interpreter._convert_float, which numerics.py patches, is gone")
    toward_zero = ir.ROUNDING_MODE.RTZ  # an explicit fp_downcast_rounding="rtz" keeps truncating

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != toward_zero:
            rounded = torch.from_numpy(np.array(values, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16)  # the bits, as the interpreter keeps bf16
        return truncating(values, input_dtype, output_dtype, rounding_mode)

    convert.__wrapped__ = truncating  # for the test that the detection sees the truncation
    interpreter._convert_float = convert
    if not triton_rounds_bf16_to_nearest():
        interpreter._convert_float = truncating
        raise RuntimeError("patching triton.runtime.interpreter._convert_float did not make the interpreter's "
                           "fp32 -> bf16 casts round to nearest")
    return True


# --- matrix products and fp32 math under the Triton interpreter, as on a GPU and on every CPU -----
# The interpreter computes tl.dot with numpy's matmul: fp16 and fp32 operands go to numpy's float32
# matmul, which is OpenBLAS's sgemm, whose kernel (and with it the order of the fp32 sums) OpenBLAS
# picks for the CPU it runs on (Haswell, SkylakeX, SapphireRapids, ...). So the fp32 rounding of
# every product under the interpreter depends on the CPU, and a kernel that recomputes a score in
# its backward (attention's exp(s - lse)) amplifies one ulp of |s| ~ 1e6 into a relative error of
# tens of percent: tests passed on one CPU and failed on another (the same inputs give attention's
# fp16 dv an error of 0.095 with OpenBLAS's Haswell kernel, 0.0263 with its Sandybridge one). bf16
# operands were worse: the interpreter keeps bf16 values as their raw bits (numpy uint16) and hands
# those to matmul as integers (triton issue 11584), so every bf16 product was garbage and remat
# refuses bf16 attention under it (remat.triton_kernels._interpreter).
# The test process replaces the interpreter's tl.dot by one that depends on its inputs alone: the
# operands widened exactly to float64 (bf16 and fp8 with the interpreter's own conversions), their
# products (exact in float64) and the accumulator summed in float64 by numpy's own (not BLAS's)
# reduction, and the total rounded once to the accumulator's dtype. A GPU's tensor cores multiply
# exactly and add in fp32; this is the same up to the order of the fp32 additions, the most
# accurate of them, and the same bits on every CPU: numpy's float64 add is IEEE, and even a
# different summation order would change float64 sums by far less than the fp32 rounding.
# fp32 exp, exp2, log, log2, sin and cos have CPU-dispatched numpy loops too (an AVX-512 one and a
# baseline one, each within an ulp or so, not the same ulp): they are computed in float64 and
# rounded to fp32. Triton's math functions take no fp16/bf16 operand (tl.exp on fp16 raises), so
# numpy's half-precision math loops, dispatched natively on AVX512-FP16 CPUs, are never reached;
# fp16 add/multiply and fp32 <-> fp16 casts in numpy are the same code on every x86 CPU.

# Operands that tell the exact dot from numpy's: in every output element two products of
# ±65280² (~4.3e9, 8 significant bits: exact in fp16 and bf16), the second and the last of the
# sum, cancel, and the small integer products between them survive only in an exact sum: an fp32
# sum loses them to a big partial sum (fp32 spacing 512 there) in any order that does not add all
# small ones first (sequential, blocked, one accumulator per SIMD lane), an fp16 one overflows to inf.
_DOT_SIZE = 16  # tl.dot's smallest tile
_BIG = 65280.0


def adversarial_dot_operands(dtype, device="cpu"):
    """(a, b): _DOT_SIZE x _DOT_SIZE operands of `dtype` whose exact product no fp32 or fp16
    accumulation gives: two cancelling products of ±65280² beside small integer ones."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-16, 17, (_DOT_SIZE, _DOT_SIZE), generator=generator).double() for _ in range(2))
    a[:, 1], a[:, -1], b[1, :], b[-1, :] = _BIG, -_BIG, _BIG, _BIG
    return a.to(dtype).to(device), b.to(dtype).to(device)


def exact_dot_in(a, b, out_dtype):
    """The exact product of a and b (integers: summed exactly in float64) rounded once to out_dtype."""
    exact = a.double() @ b.double()
    assert (exact == exact.round()).all() and exact.abs().max() < 2**53, "the operands must give exact sums"
    return exact.to(out_dtype)


@functools.cache
def _dot_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dot(A, B, C, SIZE: tl.constexpr, IEEE: tl.constexpr):  # C = A @ B, (SIZE, SIZE) each
        tiles = tl.arange(0, SIZE)[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
        a, b = tl.load(A + tiles), tl.load(B + tiles)
        product = tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)
        tl.store(C + tiles, product.to(C.dtype.element_ty))

    return dot


def triton_dot(a, b, out_dtype=torch.float32):
    """a @ b as a Triton kernel's tl.dot (fp32 accumulation) computes it, stored as out_dtype."""
    c = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    _dot_kernel()[(1,)](a, b, c, SIZE=a.shape[0], IEEE=a.dtype == torch.float32)
    return c


def interpreter_dots_are_exact():
    """True when the interpreter's tl.dot on fp16, bf16 and fp32 operands gives bitwise the exact
    product rounded once to fp32: on the adversarial operands, where every fp32 or fp16
    accumulation (whatever the CPU's BLAS) gives other bits."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        a, b = adversarial_dot_operands(dtype)
        if not torch.equal(triton_dot(a, b), exact_dot_in(a, b, torch.float32)):
            return False
    return True


_WIDENED_MATH = ("exp", "exp2", "log", "log2", "sin", "cos")
# fp32 inputs where the dispatched loops can differ: large arguments, values near 1 (log), tiny ones.
_MATH_PROBE = (-87.3, -20.5, -1e-3, -7e-8, 0.0, 3e-8, 0.37, 0.9999999, 1.0000001, 1.7, 33.3, 88.0, 1e4)


@functools.cache
def _math_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp32_math(X, Y, n, BLOCK: tl.constexpr):  # Y: (6, n): exp, exp2, log, log2, sin, cos of X
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(X + offsets, mask=mask, other=1.0)
        tl.store(Y + offsets, tl.exp(x), mask=mask)
        tl.store(Y + n + offsets, tl.exp2(x), mask=mask)
        tl.store(Y + 2 * n + offsets, tl.log(x), mask=mask)
        tl.store(Y + 3 * n + offsets, tl.log2(x), mask=mask)
        tl.store(Y + 4 * n + offsets, tl.sin(x), mask=mask)
        tl.store(Y + 5 * n + offsets, tl.cos(x), mask=mask)

    return fp32_math


def interpreter_fp32_math_is_widened():
    """True when the interpreter's fp32 exp, exp2, log, log2, sin and cos give numpy's float64
    function rounded to fp32 (the same bits on every CPU), NaN where it is NaN."""
    import numpy as np
    import triton

    x = torch.tensor(_MATH_PROBE)
    y = torch.empty(len(_WIDENED_MATH), len(_MATH_PROBE))
    with np.errstate(all="ignore"):  # log of the negative probes is NaN, of 0 -inf: meant
        _math_kernel()[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
        want = [getattr(np, name)(x.numpy().astype(np.float64)).astype(np.float32) for name in _WIDENED_MATH]
    return torch.equal(y.nan_to_num(1.5), torch.from_numpy(np.stack(want)).nan_to_num(1.5))


def _widened_to_float64(handle):
    """The values of an interpreter tensor of floating dtype as float64 numpy data (exact)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    scalar = handle.dtype.scalar
    if scalar == tl.bfloat16:  # kept as raw bits
        values = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
    elif scalar.primitive_bitwidth == 8:  # fp8 formats, as the interpreter's own dot reads them
        values = interpreter._convert_float(handle.data, scalar, tl.float16, None).view(np.float16)
    else:
        values = handle.data
    return values.astype(np.float64)


def _exact_dot(builder, a, b, d, *rest, **kwargs):
    """tl.dot: exact float64 products summed with the accumulator d in float64, rounded once to d's dtype."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if not (a.dtype.scalar.is_floating() and b.dtype.scalar.is_floating() and d.dtype.scalar.is_floating()):
        return _exact_dot.__wrapped__(builder, a, b, d, *rest, **kwargs)  # integer dots are exact already
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf are NaN silently, as in a matmul
        products = _widened_to_float64(a)[..., :, :, None] * _widened_to_float64(b)[..., None, :, :]
        total = np.add.reduce(products, axis=-2) + _widened_to_float64(d)
    if d.dtype.scalar == tl.bfloat16:  # kept as raw bits
        rounded = torch.from_numpy(total).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    else:
        with np.errstate(over="ignore"):  # past the accumulator's range: inf, as on a GPU
            rounded = total.astype(d.data.dtype)
    return interpreter.TensorHandle(rounded, d.dtype.scalar)


def _widened_math(name, original):
    import numpy as np
    from triton.runtime import interpreter

    function = getattr(np, name)

    def create(builder, arg):
        if arg.data.dtype != np.float32:
            return original(builder, arg)
        with np.errstate(over="ignore"):  # past fp32's range: inf, as the fp32 function gives
            values = function(arg.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(values, arg.dtype.scalar)

    create.__wrapped__ = original
    return create


def make_interpreter_dots_and_math_isa_independent():
    """Makes the Triton interpreter's tl.dot exact (the exact product rounded once to the accumulator's
    dtype, for fp16, bf16, fp8 and fp32 operands) and its fp32 exp/exp2/log/log2/sin/cos the float64
    function rounded to fp32: results that depend on the inputs alone, not on the CPU (see above).

    Returns True (it patched). Raises if the interpreter's methods it replaces are gone or the
    self-checks fail after patching (a newer Triton changed the interpreter): then the patch needs
    updating, rather than tests silently measured on the CPU's BLAS kernel or on garbage bf16 products.
    """
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    methods = ["create_dot", *(f"create_{name}" for name in _WIDENED_MATH)]
    missing = [name for name in methods if not hasattr(builder, name)]
    if missing:
        raise RuntimeError(f"triton.runtime.interpreter.InterpreterBuilder has no {', '.join(missing)}, which "
                           "numerics.py replaces to make the interpreter's results independent of the CPU")
    originals = {name: getattr(builder, name) for name in methods}
    _exact_dot.__wrapped__ = originals["create_dot"]  # the interpreter's own, for the tests of the checks
    builder.create_dot = _exact_dot
    for name in _WIDENED_MATH:
        setattr(builder, f"create_{name}", _widened_math(name, originals[f"create_{name}"]))
    if not (interpreter_dots_are_exact() and interpreter_fp32_math_is_widened()):
        for name, original in originals.items():
            setattr(builder, name, original)
        raise RuntimeError("patching triton.runtime.interpreter.InterpreterBuilder did not make the interpreter's "
                           "tl.dot exact or its fp32 math functions the rounded float64 ones")
    return True


def float64_step(module, x, dy):
    """(y, dx, {parameter name: grad}) of a float64 copy of `module` on x with output gradient dy: the
    oracle the fused layers' tests hold every output and gradient to."""
    module64 = copy.deepcopy(module).double()
    x64 = x.detach().double().requires_grad_()
    y = module64(x64)
    y.backward(dy.double())
    return y, x64.grad, {name: p.grad for name, p in module64.named_parameters()}


def assert_raises_naming(call, error, argument, pattern):
    """call() raises `error` whose message names `argument` (as a word of its own) and matches `pattern`."""
    import pytest

    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message), f"{argument!r} is not named in: {message}"
    assert re.search(pattern, message), f"{message!r} does not match {pattern!r}"
