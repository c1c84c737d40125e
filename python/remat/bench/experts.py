"""Routed experts cases (a mixture of experts' expert MLPs), `remat bench experts` or `remat bench
moe`: remat.experts, recomputing the pre-activation in the backward and keeping it (keep-hidden),
against the experts implementations people train with.

The peers: "torch", the stock eager loop over the experts as transformers' modules write it
(remat.ops.experts.stock_experts, also the check's PyTorch); transformers' own "eager",
"batched_mm" and "grouped_mm" experts functions, each run by a real transformers experts module
(Qwen3MoeExperts, built on meta from a Qwen3MoeConfig with the case's sizes and called with the
case's tensors as its weights: torch.func.functional_call), its config._experts_implementation
set to the one measured; and on a GPU, where liger_kernel is installed and has it, Liger's fused
MoE (liger_kernel.ops.fused_moe.LigerFusedMoEFunction: gather, grouped GEMM and SwiGLU fused, the
pre-activation kept). A peer that cannot run a case is a row whose error says why ("Skipped: ..."):
Liger off a GPU (its kernels are Triton for CUDA tensors), Liger not installed, transformers not
installed, and batched_mm where the expert weights it gathers for every (token, expert) pair would
not fit (BATCHED_MM_MAX_BYTES: at the GPU sizes, 77 GB at 1024 tokens; it is transformers'
implementation for a few tokens at a time). With LIGER_FUSED_MOE_AUTOTUNE=0 (bench/gpu_check.sh
sets it: its autotuning compiles ~130 kernels, minutes) Liger runs one configuration, and its row
is named "liger (autotune off)".

Memory: "fwd saves" is what each forward keeps for the backward beyond x, the routing weights, the
expert weights and the output (exactly on CPU, from the allocator on a GPU); "sbh/layer" the same
per token and hidden element. Work model (FLOPs): the two expert projections on T·K routed rows,
2·T·K·h·(N1 + I) forward; the backward's four products, twice that (the recompute policy's extra up
projection, 2·T·K·h·N1, is not counted as work). Checked against float64: the output and every
gradient (x, the routing weights, both expert weights).
"""

import functools
import importlib
import os

import torch

import remat
from remat.ops.experts import sample_routing, stock_experts

from .cases import Case, Variant, check_against, op_built, ours_by_backend

# Qwen3-30B-A3B's experts: hidden 2048, expert intermediate 768, 128 experts, top-8.
GPU_TOKENS, GPU_WIDTH, GPU_INTER, GPU_EXPERTS, GPU_TOP_K = 4096, 2048, 768, 128, 8
QUICK_TOKENS = 1024
# On CPU: widths ragged against the kernels' tiles, and I·2 bytes a multiple of 16, as torch's grouped_mm
# (transformers' grouped_mm peer) needs in fp16 and bf16.
CPU_TOKENS, CPU_WIDTH, CPU_INTER, CPU_EXPERTS, CPU_TOP_K = 32, 40, 40, 5, 2
SIZES_MEAN = "token counts T"  # what cases(sizes=...), `remat bench --shapes`, sets
# transformers' experts implementations measured (transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS;
# "eager" is the experts module's own forward)
TRANSFORMERS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
# batched_mm gathers each (token, expert) pair's expert weights, T·K·3·I·h elements (and as many
# gradients): run only where that copy is at most this many bytes.
BATCHED_MM_MAX_BYTES = 8 * 10**9


class Skipped(Exception):
    """A peer that does not run a case; the message (its row's error) says why."""


def _remat(keep_hidden):
    return lambda x, index, weights, gate_up, down: remat.experts(x, index, weights, gate_up, down,
                                                                 keep_hidden=keep_hidden)


def _stock(x, index, weights, gate_up, down):
    return stock_experts(x, index, weights, gate_up, down)


@functools.cache
def _transformers_module(implementation, experts, width, inter, top_k):
    """transformers' Qwen3MoeExperts with these sizes, on meta (its weights are the case's, given
    at each call), dispatching to `implementation`."""
    try:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as error:
        raise Skipped(f"transformers is not installed ({error})") from None
    config = Qwen3MoeConfig(hidden_size=width, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=top_k, hidden_act="silu")
    config._experts_implementation = implementation
    with torch.device("meta"):
        return Qwen3MoeExperts(config)


def _transformers(implementation):
    """transformers' experts `implementation`, run by its Qwen3MoeExperts module on the case's tensors."""

    def call(x, index, weights, gate_up, down):
        experts, n1, width = gate_up.shape
        if implementation == "batched_mm":
            gathered = index.numel() * (n1 + down.shape[2]) * width * gate_up.element_size()
            if gathered > BATCHED_MM_MAX_BYTES:
                raise Skipped(f"each pair's weights gathered: {gathered / 1e9:.3g} GB > "
                              f"{BATCHED_MM_MAX_BYTES / 1e9:.3g} GB (their gradients as much again)")
        module = _transformers_module(implementation, experts, width, n1 // 2, index.shape[1])
        return torch.func.functional_call(module, {"gate_up_proj": gate_up, "down_proj": down}, (x, index, weights))

    return call


@functools.cache
def _liger_function():
    try:
        liger = importlib.import_module("liger_kernel")
    except ImportError:
        raise Skipped("liger_kernel is not installed (pip install liger-kernel)") from None
    try:
        return importlib.import_module("liger_kernel.ops.fused_moe").LigerFusedMoEFunction
    except (ImportError, AttributeError) as error:
        version = getattr(liger, "__version__", "")
        raise Skipped(f"liger_kernel {version} has no fused MoE (liger_kernel.ops.fused_moe: {error})") from None


def _liger(x, index, weights, gate_up, down):
    """Liger's fused MoE (SwiGLU, the concatenated [gate; up] layout: the case's), on CUDA tensors."""
    if x.device.type != "cuda":
        raise Skipped(f"GPU only: Triton kernels for CUDA tensors, not {x.device.type}")
    return _liger_function().apply(x, gate_up, down, index.to(torch.int32), weights)


def implementations(device):
    impls = []
    for name, backend in ours_by_backend(device):
        impls.append(Variant(name, True, _remat(False), backend))
        impls.append(Variant(f"{name}-keep-hidden", True, _remat(True), backend))
    impls.append(Variant("torch", False, _stock))
    impls += [Variant(f"transformers-{name}", False, _transformers(name)) for name in TRANSFORMERS_IMPLEMENTATIONS]
    liger = "liger (autotune off)" if _liger_autotune_off() else "liger"
    return impls + [Variant(liger, False, _liger)]


def _liger_autotune_off():
    """LIGER_FUSED_MOE_AUTOTUNE=0 (as liger_kernel reads it): Liger runs one configuration of each kernel."""
    return os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "").lower() in ("0", "false", "no")


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
                    work=flops, sbh_per_layer=tokens * width,
                    make_inputs=_make_inputs(tokens, width, inter, experts, top_k, dtype, device),
                    implementations=[impl.implementation(_build(mode)) for impl in impls], check=check,
                )
