"""The test helpers themselves: the interpreter's bf16 rounding and bf16 products are the GPU's."""

import pytest
import torch

import remat

import numerics


def bf16_nearest_even_by_bits(x):
    """x (fp32) rounded to bf16 by integer arithmetic on its bits, as IEEE 754 defines rounding to
    nearest even: no floating-point kernel involved, so the same on every CPU."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # carries into the exponent: max fp32 -> inf
    upper = torch.where(torch.isnan(x), (bits >> 16) | 0x0040, upper)  # a NaN stays a (quiet) NaN
    return torch.where(upper >= 2**15, upper - 2**16, upper).to(torch.int16).view(torch.bfloat16)


def test_bf16_oracle_rounds_known_values():
    ulp = 2**-7  # of bf16 in [1, 2)
    cases = {
        1 + 3 * ulp / 4: 1 + ulp, 1 + ulp / 4: 1.0, -(1 + 3 * ulp / 4): -(1 + ulp),
        1 + ulp / 2: 1.0, 1 + 3 * ulp / 2: 1 + 2 * ulp,  # ties go to the even neighbour
        3.4028234663852886e38: float("inf"), float("-inf"): float("-inf"), 0.0: 0.0,
    }
    rounded = bf16_nearest_even_by_bits(torch.tensor(list(cases), dtype=torch.float32))
    assert rounded.tolist() == list(cases.values())
    assert bf16_nearest_even_by_bits(torch.tensor([float("nan")])).isnan().all()


def test_triton_bf16_casts_round_to_nearest_even(target):
    """On a GPU the kernels' bf16 stores round to nearest even; under the interpreter they do too,
    once conftest.py has patched its truncating cast."""
    device, _ = target
    x = torch.cat([torch.randn(4000) * 10.0 ** torch.randint(-30, 30, (4000,)),
                   torch.tensor([1 + 3 * 2**-9, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, float("inf"), float("-inf")])])
    stored = numerics.triton_bf16_store(x.to(device)).cpu()
    expected = bf16_nearest_even_by_bits(x)
    assert torch.equal(stored.view(torch.int16), expected.view(torch.int16))
    assert numerics.triton_bf16_store(torch.tensor([float("nan")], device=device)).isnan().all()


def test_truncation_is_detected(target, monkeypatch):
    """The detection is no constant: with the interpreter's own cast put back, it reports truncation."""
    device, _ = target
    from triton.runtime import interpreter

    truncating = getattr(interpreter._convert_float, "__wrapped__", None)
    if device != "cpu" or truncating is None:
        pytest.skip("only an interpreter that truncates was patched")
    assert numerics.triton_rounds_bf16_to_nearest()
    monkeypatch.setattr(interpreter, "_convert_float", truncating)
    assert not numerics.triton_rounds_bf16_to_nearest()
    assert numerics.triton_bf16_store(torch.tensor([1 + 3 * 2**-9])).item() == 1.0


def test_the_interpreters_bf16_dot_is_exact_and_the_check_is_no_constant(target, monkeypatch):
    """bf16 tl.dot multiplies exactly with fp32 sums (patched under the interpreter); with the
    interpreter's own dot put back, remat's check sees the defect and remat.attention refuses bf16
    rather than return garbage, while fp16 still runs."""
    device, _ = target
    from remat.triton_kernels import _interpreter

    assert _interpreter.bf16_dot_is_exact()
    q = torch.randn(1, 2, 5, 32, dtype=torch.bfloat16, device=device)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert numerics.rel_error(remat.attention(q, q, q), expected) < numerics.REL_TOL[torch.bfloat16]
    from triton.runtime import interpreter

    original = getattr(interpreter.InterpreterBuilder.create_dot, "__wrapped__", None)
    if device != "cpu" or original is None:
        pytest.skip("only an interpreter whose bf16 dot was wrong was patched")
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", original)
    assert not _interpreter.bf16_dot_is_exact()
    monkeypatch.setattr(_interpreter, "bf16_dot_checked", _interpreter.bf16_dot_is_exact)
    with pytest.raises(RuntimeError, match=r"remat\.attention: the Triton interpreter \(TRITON_INTERPRET=1\) "
                                           r"multiplies bfloat16 matrices wrong \(triton issue 11584\)"):
        remat.attention(q, q, q)
    remat.attention(q.half(), q.half(), q.half())
