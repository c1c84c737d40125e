"""The memory policies a stack of transformer blocks can train under: one table for the block
benchmark (remat bench block) and for remat memory.

Each Policy builds, from the stock stack (an nn.Sequential of blocks), the module to run: eager;
remat's fused recompute; torch.compile with and without its activation memory budget; selective
checkpointing (keep the matmul and attention outputs, recompute the rest); full checkpointing per
block; remat with the first blocks fully checkpointed; offloading the saved activations to host
memory.
"""

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from .gpt import remat_stack


class Checkpointed(torch.nn.Module):
    """Runs `block` under torch.utils.checkpoint (non-reentrant), selectively when `policy` is given
    (a selective-checkpoint policy function, as save_matmuls_and_attention)."""

    def __init__(self, block, policy=None):
        super().__init__()
        self.block, self.policy = block, policy

    def forward(self, x):
        if self.policy is None:
            return checkpoint(self.block, x, use_reentrant=False)
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=context)


def save_matmuls_and_attention(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep the outputs of matmuls and attention, recompute the rest."""
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


def compiled_with_budget(stack, budget):
    """torch.compile of the stack under an activation memory budget.

    The budget goes through a backend of its own, not a config patch around the call: Dynamo
    caches compiled code on the stack's forward and does not guard on functorch's config, so a
    patch around a second torch.compile(stack) would silently reuse the plain compile's graph.
    A distinct backend is part of the cache key (tests/tools/test_bench_block.py).
    """
    return torch.compile(stack, backend=functools.partial(_budget_backend, budget))


class Offloaded(torch.nn.Module):
    """Runs `stack` with its saved activations offloaded to host memory."""

    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, x):
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return self.stack(x)


def checkpoint_first(stack, count, policy=None):
    """The stack with its first `count` blocks checkpointed (all of them when count is None)."""
    count = len(stack) if count is None else count
    return torch.nn.Sequential(*(Checkpointed(b, policy) if i < count else b for i, b in enumerate(stack)))


@dataclasses.dataclass(frozen=True)
class Policy:
    """name; ours: remat's kernels run; make(stock stack) -> the module to run; compiles: torch.compile
    runs (slow to build); offloads: the saved activations go to host memory."""

    name: str
    ours: bool
    make: Callable
    compiles: bool = False
    offloads: bool = False


def policies(layers, checkpointed_fractions=(0.5,), compiled=True):
    """Every policy for a stack of `layers` blocks, in order of importance. checkpointed_fractions:
    the parts of the stack "remat + checkpoint k/L" fully checkpoints; compiled: with the
    torch.compile policies."""
    table = [
        Policy("eager", False, lambda s: s),
        Policy("remat", True, remat_stack),
        Policy("compile", False, torch.compile, compiles=True),
        Policy("remat + compile", True, lambda s: torch.compile(remat_stack(s)), compiles=True),
        Policy("full checkpoint", False, lambda s: checkpoint_first(s, None)),
        Policy("selective checkpoint", False, lambda s: checkpoint_first(s, None, save_matmuls_and_attention)),
    ]
    for k in sorted({int(layers * f) for f in checkpointed_fractions} - {0, layers}):
        table.append(Policy(f"remat + checkpoint {k}/{layers}", True,
                            lambda s, k=k: checkpoint_first(remat_stack(s), k)))
    table += [
        Policy("compile, budget 0.5", False, lambda s: compiled_with_budget(s, 0.5), compiles=True),
        Policy("compile, budget 0.3", False, lambda s: compiled_with_budget(s, 0.3), compiles=True),
        Policy("offload to host", False, Offloaded, offloads=True),
        Policy("compile (each block)", False, lambda s: torch.nn.Sequential(*(torch.compile(b) for b in s)),
               compiles=True),
    ]
    return [p for p in table if compiled or not p.compiles]
