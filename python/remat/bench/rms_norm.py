"""RMSNorm cases (Llama's rounding): remat (each backend) against the stock LlamaRMSNorm formula in eager
PyTorch, torch.compile of it, and Liger's RMSNorm (its "llama" casting mode).

Byte model (effective bandwidth), as LayerNorm's: forward reads x and writes y, 2·M·N·elem bytes;
forward + backward also reads x and dy and writes dx, 5·M·N·elem bytes. The weight and the per-row
rstd are O(N + M) and not counted. Checked against the eager formula: output and the gradients of x
and the weight.
"""

import functools

import torch

import remat

from .cases import check_against, op_built
from .layer_norm import awkward_rows, peer_variants, row_norm_cases

SIZES_MEAN = "widths N"  # what cases(sizes=...), `remat bench --shapes`, sets (LayerNorm's widths by default)
EPS = 1e-6


def _remat(x, w):
    return remat.rms_norm(x, (x.shape[-1],), w, EPS, style="llama")


def _torch(x, w):
    """transformers' LlamaRMSNorm.forward."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


@functools.cache
def _compiled():
    return torch.compile(_torch, dynamic=False)  # one kernel per shape, as for a training run


def _liger():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def implementations(device):
    """A Variant (a function of x, weight) for every implementation that can run on `device`."""
    return peer_variants(device, _remat, _torch, lambda x, w: _compiled()(x, w), _liger)


def _make_inputs(rows, width, dtype, device):
    def make():
        x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(width, device=device) * 0.1 + 1).to(dtype).requires_grad_()
        dy = torch.randn(rows, width, device=device, dtype=dtype)
        return x, w, dy

    return make


def _build(mode):
    def wrap(fn):
        def build(inputs):
            x, w, dy = inputs
            return op_built(mode, lambda: fn(x, w), {"x": x, "weight": w}, dy)

        return build

    return wrap


def sanitize_calls(device, dtype):
    """Calls of remat.rms_norm that bench/sanitize_check.py runs, forward and backward, under
    compute-sanitizer: every path of the kernels, scalar ones and masked tails included."""
    for x in awkward_rows(device, dtype):
        yield functools.partial(_remat, x, torch.randn(x.shape[1], device=device, requires_grad=True))


def cases(device, dtypes, quick, sizes=None):
    return row_norm_cases("rms_norm", device, dtypes, quick, sizes, implementations(device), _make_inputs, _build,
                          check_against(_build("fwd+bwd")(_torch)))
