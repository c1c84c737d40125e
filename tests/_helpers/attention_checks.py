"""The attention tests' comparison of a run with its float64 reference."""

import torch

from numerics import REL_TOL, rel_error


def assert_matches_float64(ours, ref, dtype, exactly_zero=()):
    """(o, lse, dq, dk, dv) against float64: each within REL_TOL of `dtype`, lse in fp32 and -inf
    exactly where the reference's is (rows that see no key). exactly_zero: gradients the reference
    has exactly 0 (every row sees one key: P = 1, dS = P (dP - delta) = 0), where a kernel gets
    dO.V - dO.O to fp32 rounding (different summation orders), i.e. ~1e-7."""
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        assert got.shape == want.shape, name
        if name in exactly_zero:
            assert want.abs().max() == 0 and got.abs().max() < 1e-4, name
            continue
        if name == "lse":
            assert got.dtype == torch.float32
            masked = torch.isinf(want)
            assert torch.equal(torch.isinf(got), masked) and (got[masked] < 0).all(), "lse: rows that see no key"
            assert rel_error(got[~masked], want[~masked]) < 1e-6, "lse"
            continue
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        assert rel_error(got, want) <= REL_TOL[dtype], f"{name}: {rel_error(got, want):.3g}"
