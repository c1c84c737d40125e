"""The one relative error remat measures with (the benchmarks' checks, the conversion probes, the tests),
and the dtype the references compute in."""

import torch


def math_dtype(x):
    """float64 for a float64 tensor (the tests' oracles), else float32: what the references compute in."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rel_error(out, ref):
    """‖out − ref‖ / ‖ref‖ in float64 (0 when both are empty).

    Where the exact result is zero (dx of a LayerNorm over one element), the float64 reference
    holds only rounding noise (~1e-14), so the scale has a floor of 1e-6 per element: the error
    is then measured absolutely, at a level far below any real gradient.
    """
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double(), ref.double()
    scale = max(ref.norm().item(), 1e-6 * ref.numel() ** 0.5)
    return (out - ref).norm().item() / scale
