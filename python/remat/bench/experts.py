"""Routed experts cases (a mixture of experts' expert MLPs): remat.experts, recomputing the
pre-activation in the backward and keeping it, against the stock eager loop over the experts as
transformers' experts modules write it.

Work model (FLOPs): the two expert projections on T·K routed rows, 2·T·K·h·(N1 + I) forward; the
backward's four products, twice that, plus the recomputed up projection (2·T·K·h·N1) for the
recompute policy. Checked against the stock loop: the output and every gradient.
"""

import functools

import torch

import remat
from remat.ops.experts import sample_routing, stock_experts

from .cases import Case, Variant, check_against, op_built, ours_by_backend

# Qwen3-30B-A3B's experts: hidden 2048, expert intermediate 768, 128 experts, top-8.
GPU_TOKENS, GPU_WIDTH, GPU_INTER, GPU_EXPERTS, GPU_TOP_K = 4096, 2048, 768, 128, 8
QUICK_TOKENS = 1024
CPU_TOKENS, CPU_WIDTH, CPU_INTER, CPU_EXPERTS, CPU_TOP_K = 32, 40, 36, 5, 2
SIZES_MEAN = "token counts T"  # what cases(sizes=...), `remat bench --shapes`, sets


def _remat(keep_hidden):
    return lambda x, index, weights, gate_up, down: remat.experts(x, index, weights, gate_up, down,
                                                                 keep_hidden=keep_hidden)


def _stock(x, index, weights, gate_up, down):
    return stock_experts(x, index, weights, gate_up, down)


def implementations(device):
    impls = []
    for name, backend in ours_by_backend(device):
        impls.append(Variant(name, True, _remat(False), backend))
        impls.append(Variant(f"{name}-keep-hidden", True, _remat(True), backend))
    return impls + [Variant("torch", False, _stock)]


def _make_inputs(tokens, width, inter, experts, top_k, dtype, device):
    def make():
        x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
        index = sample_routing(tokens, top_k, experts, device)
        weights = torch.rand(tokens, top_k, device=device, dtype=dtype, requires_grad=True)
        gate_up = (torch.randn(experts, 2 * inter, width, device=device) / width**0.5).to(dtype).requires_grad_()
        down = (torch.randn(experts, width, inter, device=device) / inter**0.5).to(dtype).requires_grad_()
        return x, index, weights, gate_up, down, torch.randn(tokens, width, device=device, dtype=dtype)

    return make


def _build(mode):
    def wrap(fn):
        def build(inputs):
            x, index, weights, gate_up, down, dy = inputs
            leaves = {"x": x, "top_k_weights": weights, "gate_up": gate_up, "down": down}
            return op_built(mode, lambda: fn(x, index, weights, gate_up, down), leaves, dy)

        return build

    return wrap


def sanitize_calls(device, dtype):
    """Calls of remat.experts that bench/sanitize_check.py runs, forward and backward, under
    compute-sanitizer: ragged widths, an expert with no token, a sentinel id, both policies, and the
    transposed, interleaved layout with biases (gpt-oss's)."""
    tokens, width, inter, experts, top_k = 13, 40, 36, 5, 3
    x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
    index = sample_routing(tokens, top_k, experts, device, sentinel=True)
    weights = torch.rand(tokens, top_k, device=device, dtype=dtype, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * inter, width, device=device) / width**0.5).to(dtype).requires_grad_()
    down = (torch.randn(experts, width, inter, device=device) / inter**0.5).to(dtype).requires_grad_()
    for keep_hidden in (False, True):
        yield functools.partial(remat.experts, x, index, weights, gate_up, down, keep_hidden=keep_hidden)
    transposed = (gate_up.detach().transpose(1, 2).contiguous().requires_grad_(),
                  down.detach().transpose(1, 2).contiguous().requires_grad_())
    biases = (torch.randn(experts, 2 * inter, device=device, dtype=dtype, requires_grad=True),
              torch.randn(experts, width, device=device, dtype=dtype, requires_grad=True))
    yield functools.partial(remat.experts, x, index, weights, *transposed, *biases, activation="swiglu_clamped",
                            interleaved=True, transposed=True)


def cases(device, dtypes, quick, sizes=None):
    on_gpu = device.type == "cuda"
    width, inter, experts, top_k = ((GPU_WIDTH, GPU_INTER, GPU_EXPERTS, GPU_TOP_K) if on_gpu
                                    else (CPU_WIDTH, CPU_INTER, CPU_EXPERTS, CPU_TOP_K))
    token_counts = sizes or (([QUICK_TOKENS] if quick else [GPU_TOKENS]) if on_gpu else [CPU_TOKENS])
    impls = implementations(device)
    check = check_against(_build("fwd+bwd")(_stock))
    for dtype in dtypes:
        for tokens in token_counts:
            rows = tokens * top_k
            forward_flops = 2 * rows * width * 3 * inter
            for mode, flops in (("fwd", forward_flops), ("fwd+bwd", 3 * forward_flops)):
                yield Case(
                    op="experts", mode=mode, dtype=dtype,
                    shape=f"T={tokens} h={width} I={inter} E={experts} K={top_k}", size=tokens, unit="TFLOP/s",
                    work=flops, make_inputs=_make_inputs(tokens, width, inter, experts, top_k, dtype, device),
                    implementations=[impl.implementation(_build(mode)) for impl in impls], check=check,
                )
