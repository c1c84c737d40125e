"""GELU cases (exact, tanh, and with a fused bias): remat against torch eager and torch.compile.

Byte model (effective bandwidth): forward reads x and writes y, 2·M·N·elem bytes; forward +
backward also reads x and dy and writes dx, 5·M·N·elem bytes. The bias is O(N), not counted.
Eager bias + GELU is two kernels (add, then gelu), as `F.gelu(x + b)` runs. Checked against
F.gelu: output and the gradients of x and the bias.
"""

import functools

import torch
import torch.nn.functional as F

import remat

from .cases import Case, check_against, op_built
from .layer_norm import awkward_rows, peer_variants

GPU_ROWS, GPU_WIDTH, QUICK_ROWS = 32768, 8192, 8192
CPU_ROWS, CPU_WIDTH = 256, 1000
SIZES_MEAN = "row counts M"  # what cases(sizes=...), `remat bench --shapes`, sets
VARIANTS = (("none", False), ("tanh", False), ("none", True))  # (approximate, with bias)


def _remat(approximate):
    return lambda x, b: remat.gelu(x, approximate, b)


def _torch(approximate):
    return lambda x, b: F.gelu(x + b if b is not None else x, approximate=approximate)


@functools.cache
def _compiled(approximate):
    return torch.compile(_torch(approximate), dynamic=False)  # one kernel per shape


def implementations(device, approximate):
    """A Variant (a function of x and the bias) for every implementation."""
    return peer_variants(device, _remat(approximate), _torch(approximate),
                         lambda x, b: _compiled(approximate)(x, b))


def _make_inputs(rows, width, dtype, device, with_bias):
    def make():
        x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(width, device=device, dtype=dtype, requires_grad=True) if with_bias else None
        return x, b, torch.randn(rows, width, device=device, dtype=dtype)

    return make


def _build(mode):
    def wrap(fn):
        def build(inputs):
            x, b, dy = inputs
            return op_built(mode, lambda: fn(x, b), {"x": x} if b is None else {"x": x, "bias": b}, dy)

        return build

    return wrap


def sanitize_calls(device, dtype):
    """Calls of remat.gelu that bench/sanitize_check.py runs, forward and backward, under
    compute-sanitizer: LayerNorm's awkward rows, with a bias and without."""
    for x in awkward_rows(device, dtype):
        yield functools.partial(remat.gelu, x, "tanh", torch.randn(x.shape[1], device=device, requires_grad=True))
        yield functools.partial(remat.gelu, x, "none")


def cases(device, dtypes, quick, sizes=None):
    on_gpu = device.type == "cuda"
    width = GPU_WIDTH if on_gpu else CPU_WIDTH
    row_counts = sizes or (([QUICK_ROWS] if quick else [GPU_ROWS // 4, GPU_ROWS]) if on_gpu else [CPU_ROWS])
    for dtype in dtypes:
        elem = torch.finfo(dtype).bits // 8
        for approximate, with_bias in VARIANTS:
            impls = implementations(device, approximate)
            check = check_against(_build("fwd+bwd")(_torch(approximate)))
            for rows in row_counts:
                for mode, factor in (("fwd", 2), ("fwd+bwd", 5)):
                    yield Case(
                        op="gelu" + ("_tanh" if approximate == "tanh" else "") + ("+bias" if with_bias else ""),
                        mode=mode, dtype=dtype, shape=f"M={rows} N={width}", size=rows * width,
                        unit="GB/s", work=factor * rows * width * elem,
                        make_inputs=_make_inputs(rows, width, dtype, device, with_bias),
                        implementations=[impl.implementation(_build(mode)) for impl in impls],
                        check=check,
                    )
