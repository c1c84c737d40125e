"""MLP and LayerNormMLP cases: remat's fused layers against the eager stack and torch.compile of it.

FLOP model: the two matmuls, 2·T·h·f each forward, three times that forward + backward
(48·T·h² at f = 4h). Reported with the step time, the peak memory of the step, and the memory
the forward leaves allocated for the backward (its output and the saved activations).
"""

import torch

import remat

from .cases import Case, Implementation
from .layer_norm import ours_by_backend

GPU_TOKENS, GPU_HIDDEN, QUICK_HIDDEN = 16384, (1024, 2048, 4096), (2048,)
CPU_TOKENS, CPU_HIDDEN = 128, (64, 96)


def _stack(with_norm, hidden, device, dtype):
    layers = [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    if with_norm:
        layers.insert(0, torch.nn.LayerNorm(hidden))
    return torch.nn.Sequential(*layers).to(device, dtype)


def _ours(stack, with_norm):
    fused = (remat.nn.LayerNormMLP if with_norm else remat.nn.MLP).from_modules(*stack, recompute=True)
    return fused, fused


def implementations(device, with_norm):
    """(name, ours, make(stack) -> (callable, module holding the parameters), remat backend)."""
    impls = [(name, True, lambda stack: _ours(stack, with_norm), backend) for name, backend in ours_by_backend(device)]
    impls += [
        ("torch", False, lambda stack: (stack, stack), None),
        ("torch.compile", False, lambda stack: (torch.compile(stack, dynamic=False), stack), None),
    ]
    return impls


def _make_inputs(tokens, hidden, dtype, device, with_norm):
    def make():
        stack = _stack(with_norm, hidden, device, dtype)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        return stack, x, torch.randn(tokens, hidden, device=device, dtype=dtype)

    return make


def _forward_backward(make):
    def build(inputs):
        stack, x, dy = inputs
        run, module = make(stack)

        def reset():
            x.grad = None
            for p in module.parameters():
                p.grad = None

        return (lambda: run(x).backward(dy)), reset, (lambda: run(x))

    return build


def cases(device, dtypes, quick, sizes=None):
    on_gpu = device.type == "cuda"
    tokens = GPU_TOKENS if on_gpu else CPU_TOKENS
    hiddens = sizes or ((QUICK_HIDDEN if quick else GPU_HIDDEN) if on_gpu else CPU_HIDDEN)
    for dtype in dtypes:
        for with_norm in (False, True):
            impls = implementations(device, with_norm)
            for hidden in hiddens:
                yield Case(
                    op="ln_mlp" if with_norm else "mlp", mode="fwd+bwd", dtype=dtype,
                    shape=f"T={tokens} h={hidden} f={4 * hidden}", size=hidden,
                    unit="TFLOP/s", work=48 * tokens * hidden * hidden,
                    make_inputs=_make_inputs(tokens, hidden, dtype, device, with_norm),
                    implementations=[Implementation(name, ours, _forward_backward(make), backend)
                                     for name, ours, make, backend in impls],
                )
