"""Error measures shared by the kernel tests."""

import torch

# Bound on ‖out − ref‖ / ‖ref‖ against a float64 reference. Each is a few times the rounding of
# the output dtype itself (unit roundoff: fp32 6e-8, fp16 4.9e-4, bf16 3.9e-3), leaving room for
# fp32 accumulation over up to ~1e5 terms.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_error(out, ref):
    """‖out − ref‖ / ‖ref‖ in float64 (0 when both are empty)."""
    out, ref = out.double(), ref.double()
    scale = ref.norm()
    if ref.numel() == 0:
        return 0.0
    return ((out - ref).norm() / scale.clamp_min(1e-300)).item()


def assert_close_to_ref(name, out, ref, dtype):
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    error = rel_error(out, ref)
    assert error <= REL_TOL[dtype], f"{name}: relative error {error:.3g} > {REL_TOL[dtype]:.1g} ({dtype})"
