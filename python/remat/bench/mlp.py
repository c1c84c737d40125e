"""MLP and LayerNormMLP cases: remat's fused layers against the eager stack and torch.compile of it.

FLOP model: the two matmuls, 2·T·h·f each forward, three times that forward + backward
(48·T·h² at f = 4h). Reported with the step time, the peak memory of the step, and the memory
the forward keeps for the backward (the saved activations). Checked against the eager stack:
output and the gradients of the input and of every parameter.
"""

import torch

import remat

from .cases import Case, Variant, check_against, module_built
from .check import randomize_norms
from .layer_norm import ours_by_backend

GPU_TOKENS, GPU_HIDDEN, QUICK_HIDDEN = 16384, (1024, 2048, 4096), (2048,)
CPU_TOKENS, CPU_HIDDEN = 128, (64, 96)
SIZES_MEAN = "hidden sizes h"  # what cases(sizes=...), `remat bench --shapes`, sets


def _stack(with_norm, hidden, device, dtype):
    layers = [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    if with_norm:
        layers.insert(0, torch.nn.LayerNorm(hidden))
    return torch.nn.Sequential(*layers).to(device, dtype)


def _ours(stack, with_norm):
    fused = (remat.nn.LayerNormMLP if with_norm else remat.nn.MLP).from_modules(*stack, recompute=True)
    # from_modules copies the weights: the stack's parameters, in the stack's order, are these
    parts = (fused.norm, fused.fc1, fused.fc2) if with_norm else (fused.fc1, fused.fc2)
    return fused, [p for part in parts for p in part.parameters()]


def _eager(stack):
    return stack, list(stack.parameters())


def _compiled(stack):
    return torch.compile(stack, dynamic=False), list(stack.parameters())


def implementations(device, with_norm):
    """A Variant for every implementation: make(stack) -> (module, its parameters in the stack's order)."""
    impls = [Variant(name, True, lambda stack: _ours(stack, with_norm), backend)
             for name, backend in ours_by_backend(device)]
    impls += [Variant("torch", False, _eager), Variant("torch.compile", False, _compiled, compiles=True)]
    return impls


def _make_inputs(tokens, hidden, dtype, device, with_norm):
    def make():
        stack = randomize_norms(_stack(with_norm, hidden, device, dtype))
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        return stack, x, torch.randn(tokens, hidden, device=device, dtype=dtype)

    return make


def _forward_backward(make):
    def build(inputs):
        stack, x, dy = inputs
        module, params = make(stack)
        return module_built(module, params, stack, x, dy)

    return build


def cases(device, dtypes, quick, sizes=None):
    on_gpu = device.type == "cuda"
    tokens = GPU_TOKENS if on_gpu else CPU_TOKENS
    hiddens = sizes or ((QUICK_HIDDEN if quick else GPU_HIDDEN) if on_gpu else CPU_HIDDEN)
    check = check_against(_forward_backward(_eager))
    for dtype in dtypes:
        for with_norm in (False, True):
            impls = implementations(device, with_norm)
            for hidden in hiddens:
                yield Case(
                    op="ln_mlp" if with_norm else "mlp", mode="fwd+bwd", dtype=dtype,
                    shape=f"T={tokens} h={hidden} f={4 * hidden}", size=hidden,
                    unit="TFLOP/s", work=48 * tokens * hidden * hidden,
                    make_inputs=_make_inputs(tokens, hidden, dtype, device, with_norm),
                    implementations=[impl.implementation(_forward_backward) for impl in impls],
                    check=check,
                )
