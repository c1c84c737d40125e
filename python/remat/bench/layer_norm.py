"""LayerNorm cases: remat (each backend) against torch eager, torch.compile and Liger.

Byte model (effective bandwidth): forward reads x and writes y, 2·M·N·elem bytes; forward +
backward also reads x and dy and writes dx, 5·M·N·elem bytes. Weights and the per-row
statistics are O(N + M) and not counted. Checked against F.layer_norm: output and the gradients
of x, weight and bias.
"""

import functools

import torch
import torch.nn.functional as F

import remat

from .cases import Case, Variant, check_against, op_built, ours_by_backend

GPU_ROWS, GPU_WIDTHS, QUICK_WIDTHS = 32768, (1024, 2048, 4096, 8192), (1024, 4096)
CPU_ROWS, CPU_WIDTHS = 256, (256, 1000)  # a functional run: small, awkward widths
SIZES_MEAN = "widths N"  # what cases(sizes=...), `remat bench --shapes`, sets
EPS = 1e-5
# (rows, width) that take every path of a row-wise kernel: one element, a masked tail, several
# blocks, a wide single block and the looped path.
AWKWARD_ROWS = ((3, 1), (7, 127), (5, 1000), (2, 8192), (2, 20000))


def _remat(x, w, b):
    return remat.layer_norm(x, (x.shape[-1],), w, b, EPS)


def _torch(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


@functools.cache
def _compiled():
    return torch.compile(_torch, dynamic=False)  # one kernel per shape, as for a training run


def _liger():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)


def peer_variants(device, ours, stock, compiled, liger=None):
    """The Variants of an op: `ours` on each remat backend, then `stock` eager and `compiled` (stock under
    torch.compile), and on a GPU Liger's, when `liger()` builds it."""
    impls = [Variant(name, True, ours, backend) for name, backend in ours_by_backend(device)]
    impls += [Variant("torch", False, stock), Variant("torch.compile", False, compiled, compiles=True)]
    if liger is not None and device.type == "cuda":
        try:
            impls.append(Variant("liger", False, liger()))
        except Exception:  # not installed, or installed but broken against this torch/triton
            pass
    return impls


def implementations(device):
    """A Variant (a function of x, weight, bias) for every implementation that can run on `device`."""
    return peer_variants(device, _remat, _torch, lambda x, w, b: _compiled()(x, w, b), _liger)


def _make_inputs(rows, width, dtype, device):
    def make():
        x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(width, device=device) * 0.1 + 1).to(dtype).requires_grad_()
        b = (torch.randn(width, device=device) * 0.1).to(dtype).requires_grad_()
        dy = torch.randn(rows, width, device=device, dtype=dtype)
        return x, w, b, dy

    return make


def _build(mode):
    def wrap(fn):
        def build(inputs):
            x, w, b, dy = inputs
            return op_built(mode, lambda: fn(x, w, b), {"x": x, "weight": w, "bias": b}, dy)

        return build

    return wrap


def awkward_rows(device, dtype):
    """Inputs x (rows, width) requiring grad at each of AWKWARD_ROWS: a view with a row stride
    beyond its width, then a misaligned one (its data starts one element into an allocation)."""
    for rows, width in AWKWARD_ROWS:
        big = torch.randn(rows, width + 3, device=device, dtype=dtype)
        for x in (big[:, :width], big[:, 1:width + 1]):
            yield x.detach().requires_grad_()


def sanitize_calls(device, dtype):
    """Calls of remat.layer_norm that bench/sanitize_check.py runs, forward and backward, under
    compute-sanitizer: every path of the kernels, scalar ones and masked tails included."""
    for x in awkward_rows(device, dtype):
        w, b = (torch.randn(x.shape[1], device=device, requires_grad=True) for _ in range(2))
        yield functools.partial(_remat, x, w, b)


def row_norm_cases(op, device, dtypes, quick, sizes, impls, make_inputs, build, check):
    """The Cases of a row-wise norm (LayerNorm, RMSNorm): every width, forward and forward + backward,
    at the byte model in this module's docstring. make_inputs(rows, width, dtype, device); build(mode)."""
    rows = GPU_ROWS if device.type == "cuda" else CPU_ROWS
    widths = sizes or ((QUICK_WIDTHS if quick else GPU_WIDTHS) if device.type == "cuda" else CPU_WIDTHS)
    for dtype in dtypes:
        elem = torch.finfo(dtype).bits // 8
        for width in widths:
            for mode, factor in (("fwd", 2), ("fwd+bwd", 5)):
                yield Case(
                    op=op, mode=mode, dtype=dtype, shape=f"M={rows} N={width}", size=width, unit="GB/s",
                    work=factor * rows * width * elem, make_inputs=make_inputs(rows, width, dtype, device),
                    implementations=[impl.implementation(build(mode)) for impl in impls], check=check,
                )


def cases(device, dtypes, quick, sizes=None):
    return row_norm_cases("layernorm", device, dtypes, quick, sizes, implementations(device), _make_inputs, _build,
                          check_against(_build("fwd+bwd")(_torch)))
