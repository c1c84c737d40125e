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
    def store_as_bf16(X, Y, n, BLOCK: tl.constexpr):  # X: (n,) fp32; Y: (n,) bf16
        offsets = tl.arange(0, BLOCK)
        tl.store(Y + offsets, tl.load(X + offsets, mask=offsets < n), mask=offsets < n)

    return store_as_bf16


def triton_bf16_store(x):
    """x (1-D fp32) as a Triton kernel stores it into a bf16 tensor: the cast every kernel's store does."""
    import triton

    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _bf16_store_kernel()[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(max(x.numel(), 1)))
    return y


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


# --- bf16 matrix products under the Triton interpreter --------------------------------------------
# The interpreter keeps bf16 values as their raw bits (numpy uint16) and its tl.dot hands those to
# numpy's matmul as integers (triton issue 11584): every bf16 product is garbage, and remat refuses
# bf16 attention under it (remat.triton_kernels._interpreter). A GPU's tensor cores multiply the bf16
# inputs exactly and add in fp32. The test process makes the interpreter do the same (widening bf16
# operands to fp32 before numpy's matmul, with the interpreter's own bf16 -> fp32 conversion), so
# that every bf16 attention test runs on CPU, and asserts with remat's own check that it took.


def make_interpreter_bf16_dots_exact():
    """Makes the Triton interpreter's tl.dot on bf16 operands exact (fp32 accumulation), as a GPU's.

    Returns True when it had to patch, False when the interpreter's bf16 dot is exact already.
    Raises if the patch does not take (a newer Triton changed the interpreter): then the patch needs
    updating, rather than bf16 attention tests refused or silently measured on garbage.
    """
    from remat.triton_kernels._interpreter import bf16_dot_is_exact

    if bf16_dot_is_exact():
        return False
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, *rest, **kwargs):
        return original(self, widened(a), widened(b), *rest, **kwargs)

    create_dot.__wrapped__ = original
    builder.create_dot = create_dot
    if not bf16_dot_is_exact():
        builder.create_dot = original
        raise RuntimeError("patching triton.runtime.interpreter.InterpreterBuilder.create_dot did not make the "
                           "interpreter's bf16 tl.dot exact")
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
