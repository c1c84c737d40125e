"""The headline: a stack of pre-LN GPT blocks, forward + backward, under each memory policy.

Policies: stock eager, torch.compile (per block, whole stack, and with Inductor's activation
memory budget at 0.5 and 0.3), selective checkpointing (save matmuls and attention), full
checkpointing per block, offloading saved activations to host memory, and remat: eager, under
torch.compile, and with full checkpointing of half of the blocks.

FLOP model per layer (T = b·s tokens, width h, FFN 4h): matmuls 24·T·h² forward, three times
that forward + backward; causal attention 2·b·s²·h forward, 3.5 times that forward + backward
(as in the attention benchmark). Memory: what the forward leaves allocated for the backward, per
layer, in units of s·b·h bytes (eager keeps about 32 in bf16).

The policies run in order of importance (the targets compare remat with eager and with
torch.compile first), so a run cut short by Ctrl-C still has those. Each is checked against the
eager stack: the output and the gradients of the input and of every weight.
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..gpt import GPTConfig, RematGPTBlock, TorchGPTBlock, remat_stack, torch_stack
from .cases import Case, Variant, check_against, module_built
from .check import randomize_norms

GPU_SHAPE = {"batch": 8, "seq": 2048, "hidden": 2048, "heads": 16, "layers": 8}
QUICK_LAYERS = 2
CPU_SHAPE = {"batch": 2, "seq": 64, "hidden": 128, "heads": 4, "layers": 2}


class _Checkpointed(torch.nn.Module):
    """Runs `block` under torch.utils.checkpoint (non-reentrant), optionally selective."""

    def __init__(self, block, policy=None):
        super().__init__()
        self.block, self.policy = block, policy

    def forward(self, x):
        if self.policy is None:
            return checkpoint(self.block, x, use_reentrant=False)
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=context)


def _save_matmuls_and_attention(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _budget_backend(budget, graph, example_inputs):
    """Inductor with the activation memory budget in force while the graph is partitioned."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(activation_memory_budget=budget):
        return compile_fx(graph, example_inputs)


def _compiled_with_budget(stack, budget):
    """torch.compile of the stack under an activation memory budget.

    The budget goes through a backend of its own, not a config patch around the call: Dynamo
    caches compiled code on the stack's forward and does not guard on functorch's config, so a
    patch around a second torch.compile(stack) would silently reuse the plain compile's graph.
    A distinct backend is part of the cache key (tests/test_bench_block.py).
    """
    return torch.compile(stack, backend=functools.partial(_budget_backend, budget))


class _Offloaded(torch.nn.Module):
    """Runs `stack` with its saved activations offloaded to host memory."""

    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, x):
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return self.stack(x)


def policies(device):
    """A Variant for every policy: make(stock stack) -> the module to run."""
    half = lambda stack: len(stack) // 2  # noqa: E731
    table = [
        Variant("eager", False, lambda s: s),
        Variant("remat", True, remat_stack),
        Variant("compile", False, torch.compile, compiles=True),
        Variant("remat + compile", True, lambda s: torch.compile(remat_stack(s)), compiles=True),
        Variant("full checkpoint", False, lambda s: torch.nn.Sequential(*(_Checkpointed(b) for b in s))),
        Variant("selective checkpoint", False,
                lambda s: torch.nn.Sequential(*(_Checkpointed(b, _save_matmuls_and_attention) for b in s))),
        Variant("remat + checkpoint half", True,
                lambda s: torch.nn.Sequential(*(_Checkpointed(b) if i < half(s) else b
                                                for i, b in enumerate(remat_stack(s))))),
        Variant("compile, budget 0.5", False, lambda s: _compiled_with_budget(s, 0.5), compiles=True),
        Variant("compile, budget 0.3", False, lambda s: _compiled_with_budget(s, 0.3), compiles=True),
        Variant("offload to host", False, _Offloaded),
        Variant("compile (each block)", False, lambda s: torch.nn.Sequential(*(torch.compile(b) for b in s)),
                compiles=True),
    ]
    if device.type != "cuda":  # functional run: skip the slow compiles of the budget variants
        table = [policy for policy in table if "budget" not in policy.name]
    return table


def _block_parameters(block):
    """A block's parameters in TorchGPTBlock's order. RematGPTBlock.from_torch copies each stock
    layer into its fused counterpart: ln_1 -> attn_qkv.norm, attn_qkv -> attn_qkv.linear,
    attn_out, ln_2 -> mlp.norm, fc1 -> mlp.fc1, fc2 -> mlp.fc2."""
    if isinstance(block, RematGPTBlock):
        block = [block.attn_qkv.norm, block.attn_qkv.linear, block.attn_out, block.mlp.norm, block.mlp.fc1, block.mlp.fc2]
        return [p for layer in block for p in layer.parameters()]
    return list(block.parameters())


def parameters_in_stock_order(run):
    """The weights a policy's module trains, in the order of the stock stack's parameters."""
    blocks = [m for m in run.modules() if isinstance(m, (TorchGPTBlock, RematGPTBlock))]
    return [p for block in blocks for p in _block_parameters(block)]


def _make_inputs(shape, dtype, device):
    def make():
        config = GPTConfig(hidden=shape["hidden"], heads=shape["heads"], layers=shape["layers"])
        stack = randomize_norms(torch_stack(config, device=device, dtype=dtype))
        x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], device=device, dtype=dtype, requires_grad=True)
        return stack, x, torch.randn_like(x)

    return make


def _step(make):
    def build(inputs):
        stack, x, dy = inputs
        run = make(stack)
        return module_built(run, parameters_in_stock_order(run), stack, x, dy)

    return build


def cases(device, dtypes, quick, sizes=None):
    shape = dict(GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    if quick and device.type == "cuda":
        shape["layers"] = QUICK_LAYERS
    if sizes:
        shape["seq"] = sizes[0]
    b, s, h, layers = shape["batch"], shape["seq"], shape["hidden"], shape["layers"]
    flops = layers * (3 * 24 * b * s * h * h + 3.5 * 2 * b * s * s * h)
    for dtype in dtypes:
        yield Case(
            op="gpt_block", mode="fwd+bwd", dtype=dtype,
            shape=f"L={layers} b={b} s={s} h={h} heads={shape['heads']}", size=s,
            unit="TFLOP/s", work=flops, make_inputs=_make_inputs(shape, dtype, device),
            implementations=[policy.implementation(_step) for policy in policies(device)],
            sbh_per_layer=layers * s * b * h, check=check_against(_step(lambda stack: stack)),
        )

