"""MLP, LayerNormMLP and gated-MLP cases: remat's fused layers against the eager stack and torch.compile of it.

The gated case is Llama's: RMSNorm (Llama's rounding), then down(silu(gate(x)) * up(x)) at f = 2.6875·h
(Llama-7B's 11008 / 4096). FLOP model: the matmuls, 2·T·h·f each forward, three times that forward +
backward (two matmuls: 48·T·h² at f = 4h; three: 18·T·h·f). Reported with the step time, the peak
memory of the step, and the memory the forward keeps for the backward (the saved activations).
Checked against the eager stack: output and the gradients of the input and of every parameter.
"""

import torch

import remat

from .cases import Case, Variant, check_against, module_built, ours_by_backend
from .check import randomize_norms

GPU_TOKENS, GPU_HIDDEN, QUICK_HIDDEN = 16384, (1024, 2048, 4096), (2048,)
CPU_TOKENS, CPU_HIDDEN = 128, (64, 96)
SIZES_MEAN = "hidden sizes h"  # what cases(sizes=...), `remat bench --shapes`, sets


class LlamaMLP(torch.nn.Module):
    """transformers' LlamaRMSNorm then LlamaMLP, as a stock stack: norm.weight, gate_proj, up_proj, down_proj."""

    def __init__(self, hidden, ffn, eps=1e-6):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps)
        self.gate_proj, self.up_proj = (torch.nn.Linear(hidden, ffn, bias=False) for _ in range(2))
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        xf = x.float()
        normed = self.norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm.eps)).to(x.dtype)
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))


def _llama_ffn(hidden):
    return hidden * 11008 // 4096


def _stack(kind, hidden, device, dtype):
    if kind == "gated":
        return LlamaMLP(hidden, _llama_ffn(hidden)).to(device, dtype)
    with_norm = kind == "ln_mlp"
    layers = [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    if with_norm:
        layers.insert(0, torch.nn.LayerNorm(hidden))
    return torch.nn.Sequential(*layers).to(device, dtype)


def _ours(stack, kind):
    if kind == "gated":  # sharing the stack's modules (its RMSNorm rounded as torch.nn.RMSNorm rounds)
        fused = remat.nn.GatedMLP.from_modules(stack.gate_proj, stack.up_proj, stack.down_proj, "silu", stack.norm)
        return fused, list(stack.parameters())
    with_norm = kind == "ln_mlp"
    fused = (remat.nn.LayerNormMLP if with_norm else remat.nn.MLP).from_modules(*stack, recompute=True)
    # from_modules copies the weights: the stack's parameters, in the stack's order, are these
    parts = (fused.norm, fused.fc1, fused.fc2) if with_norm else (fused.fc1, fused.fc2)
    return fused, [p for part in parts for p in part.parameters()]


def _eager(stack):
    return stack, list(stack.parameters())


def _compiled(stack):
    return torch.compile(stack, dynamic=False), list(stack.parameters())


KINDS = ("mlp", "ln_mlp", "gated")  # the cases' op names


def implementations(device, kind):
    """A Variant for every implementation: make(stack) -> (module, its parameters in the stack's order)."""
    impls = [Variant(name, True, lambda stack: _ours(stack, kind), backend)
             for name, backend in ours_by_backend(device)]
    impls += [Variant("torch", False, _eager), Variant("torch.compile", False, _compiled, compiles=True)]
    return impls


def _make_inputs(tokens, hidden, dtype, device, kind):
    def make():
        stack = randomize_norms(_stack(kind, hidden, device, dtype))
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        return stack, x, torch.randn(tokens, hidden, device=device, dtype=dtype)

    return make


def _forward_backward(make):
    def build(inputs):
        stack, x, dy = inputs
        module, params = make(stack)
        return module_built(module, params, stack, x, dy)

    return build


def _shape_and_flops(kind, tokens, hidden):
    if kind == "gated":
        ffn = _llama_ffn(hidden)
        return f"T={tokens} h={hidden} f={ffn} (gated)", 18 * tokens * hidden * ffn
    return f"T={tokens} h={hidden} f={4 * hidden}", 48 * tokens * hidden * hidden


def cases(device, dtypes, quick, sizes=None):
    on_gpu = device.type == "cuda"
    tokens = GPU_TOKENS if on_gpu else CPU_TOKENS
    hiddens = sizes or ((QUICK_HIDDEN if quick else GPU_HIDDEN) if on_gpu else CPU_HIDDEN)
    check = check_against(_forward_backward(_eager))
    for dtype in dtypes:
        for kind in KINDS:
            impls = implementations(device, kind)
            for hidden in hiddens:
                shape, flops = _shape_and_flops(kind, tokens, hidden)
                yield Case(
                    op=kind, mode="fwd+bwd", dtype=dtype, shape=shape, size=hidden, unit="TFLOP/s", work=flops,
                    make_inputs=_make_inputs(tokens, hidden, dtype, device, kind),
                    implementations=[impl.implementation(_forward_backward) for impl in impls],
                    check=check,
                )
