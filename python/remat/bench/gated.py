"""Gated activation cases, act(gate) · up (SwiGLU with silu, GeGLU with the tanh GELU): remat against
the stock two-step computation in eager PyTorch, torch.compile of it, and Liger's SiLUMul / GELUMul.

gate and up are the two halves of one (M, 2N) projection output, as a fused gate_up projection
gives them (and as Liger takes them). Byte model (effective bandwidth): forward reads gate and up
and writes y, 3·M·N·elem bytes; forward + backward also reads gate, up and dy and writes d_gate
and d_up, 8·M·N·elem bytes. Checked against the eager computation: output and the gradient of
the projection output.
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
ACTIVATIONS = ("silu", "gelu_tanh")
_STOCK = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
_LIGER = {"silu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
          "gelu_tanh": ("liger_kernel.ops.geglu", "LigerGELUMulFunction")}


def _halves(gate_up):
    return gate_up.chunk(2, dim=-1)


def _remat(activation):
    return lambda gate_up: remat.gated_activation(*_halves(gate_up), activation)


def _torch(activation):
    def stock(gate_up):
        gate, up = _halves(gate_up)
        return _STOCK[activation](gate) * up

    return stock


@functools.cache
def _compiled(activation):
    return torch.compile(_torch(activation), dynamic=False)  # one kernel per shape


def _liger(activation):
    import importlib

    module, name = _LIGER[activation]
    function = getattr(importlib.import_module(module), name)
    return lambda gate_up: function.apply(*_halves(gate_up))


def implementations(device, activation):
    """A Variant (a function of the (M, 2N) projection output) for every implementation."""
    return peer_variants(device, _remat(activation), _torch(activation),
                         lambda gate_up: _compiled(activation)(gate_up), lambda: _liger(activation))


def _make_inputs(rows, width, dtype, device):
    def make():
        gate_up = torch.randn(rows, 2 * width, device=device, dtype=dtype, requires_grad=True)
        return gate_up, torch.randn(rows, width, device=device, dtype=dtype)

    return make


def _build(mode):
    def wrap(fn):
        def build(inputs):
            gate_up, dy = inputs
            return op_built(mode, lambda: fn(gate_up), {"gate_up": gate_up}, dy)

        return build

    return wrap


def sanitize_calls(device, dtype):
    """Calls of remat.gated_activation that bench/sanitize_check.py runs, forward and backward, under
    compute-sanitizer: LayerNorm's awkward rows as the halves of one tensor (an unaligned up half at odd
    widths) and as tensors of their own."""
    for x in awkward_rows(device, dtype):
        yield functools.partial(_remat("silu"), torch.cat([x, x], dim=-1).detach().requires_grad_())
        yield functools.partial(remat.gated_activation, x, torch.randn_like(x, requires_grad=True), "gelu")


def cases(device, dtypes, quick, sizes=None):
    on_gpu = device.type == "cuda"
    width = GPU_WIDTH if on_gpu else CPU_WIDTH
    row_counts = sizes or (([QUICK_ROWS] if quick else [GPU_ROWS // 4, GPU_ROWS]) if on_gpu else [CPU_ROWS])
    for dtype in dtypes:
        elem = torch.finfo(dtype).bits // 8
        for activation in ACTIVATIONS:
            impls = implementations(device, activation)
            check = check_against(_build("fwd+bwd")(_torch(activation)))
            for rows in row_counts:
                for mode, factor in (("fwd", 3), ("fwd+bwd", 8)):
                    yield Case(
                        op=f"gated_{activation}", mode=mode, dtype=dtype, shape=f"M={rows} N={width}",
                        size=rows * width, unit="GB/s", work=factor * rows * width * elem,
                        make_inputs=_make_inputs(rows, width, dtype, device),
                        implementations=[impl.implementation(_build(mode)) for impl in impls],
                        check=check,
                    )
