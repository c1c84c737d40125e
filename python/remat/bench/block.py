"""The headline: a stack of pre-LN GPT blocks, forward + backward, under each memory policy.

Policies: stock eager, torch.compile (per block, whole stack, and with Inductor's activation
memory budget at 0.5 and 0.3), selective checkpointing (save matmuls and attention), full
checkpointing per block, offloading saved activations to host memory, and remat: eager, under
torch.compile, and with full checkpointing of half of the blocks. Then "remat plan" rows: the
stack as remat.plan applies it for budgets of 75 %, 50 % and 25 % of the bytes the stock stack
keeps for the backward (planned on meta at the case's shape, with this GPU's constants, or the
H100's for a GPU the table does not know; on CPU with the "cpu" figures, which never offload).

FLOP model per layer (T = b·s tokens, width h, FFN 4h): matmuls 24·T·h² forward, three times
that forward + backward; causal attention 2·b·s²·h forward, 3.5 times that forward + backward
(as in the attention benchmark). Memory: what the forward leaves allocated for the backward, per
layer, in units of s·b·h bytes (eager keeps about 32 in bf16).

The policies run in order of importance (the targets compare remat with eager and with
torch.compile first), so a run cut short by Ctrl-C still has those. Each is checked against the
eager stack: the output and the gradients of the input and of every weight.
"""


import copy
import functools

import torch

from .. import planner
from ..gpt import GPTConfig, RematGPTBlock, TorchGPTBlock, torch_stack
from ..policies import Offloaded
from ..policies import policies as policy_table
from .cases import Case, Variant, check_against, module_built
from .check import randomize_norms

GPU_SHAPE = {"batch": 8, "seq": 2048, "hidden": 2048, "heads": 16, "layers": 8}
QUICK_LAYERS = 2
CPU_SHAPE = {"batch": 2, "seq": 64, "hidden": 128, "heads": 4, "layers": 2}
SIZES_MEAN = "sequence length s (the first size)"  # what cases(sizes=...), `remat bench --shapes`, sets


def policies(device, layers=QUICK_LAYERS):
    """A Variant for every policy of remat.policies: make(stock stack) -> the module to run. On CPU
    (a functional run) without the slow compiles of the budget policies."""
    table = [Variant(p.name, p.ours, p.make if not p.offloads else Offloaded, compiles=p.compiles)
             for p in policy_table(layers)]
    if device.type != "cuda":
        table = [policy for policy in table if "budget" not in policy.name]
    return table


PLAN_FRACTIONS = (0.75, 0.5, 0.25)  # of the stock stack's saved bytes: the "remat plan" rows' budgets


def plan_policies(device, example, config=None):
    """A "remat plan" Variant per budget of PLAN_FRACTIONS, planned for inputs like `example` (meta).
    With the stack's GPTConfig, each row's name also says the plan's predicted extra time over the
    stock stack, so that the measured time stands beside the prediction: "remat plan 50% (+1.23 ms
    predicted)"."""
    plan_device = _plan_device(device)
    variants = []
    for fraction in PLAN_FRACTIONS:
        name = f"remat plan {round(100 * fraction)}%"
        if config is not None:
            stack = torch_stack(config, device="meta", dtype=example.dtype)
            name += f" (+{_plan_for(fraction, example, plan_device, stack).extra_seconds * 1e3:.2f} ms predicted)"
        variants.append(Variant(name, True, functools.partial(_planned, fraction, example, plan_device)))
    return variants


def _plan_device(device):
    """Whose constants time the plan: the device's (calibrated or from the table), else the H100's."""
    try:
        planner.cost.device_constants(device)
        return device
    except ValueError:  # a GPU without constants in the table
        return "H100"


def _plan_for(fraction, example, plan_device, stack):
    """remat.plan's plan for `fraction` of what the stock stack keeps (planned on a meta copy)."""
    shell = planner.meta_copy(stack)
    saves, _, _ = planner.measure(shell, (example,), ("stock",))
    return planner.plan(shell, (example,), int(fraction * saves["stock"].total_bytes()), device=plan_device)


def _planned(fraction, example, plan_device, stack):
    """A copy of the stack with remat.plan's choices for `fraction` of what the stock stack keeps."""
    return _plan_for(fraction, example, plan_device, stack).apply(copy.deepcopy(stack))


def _block_parameters(block):
    """A block's parameters in TorchGPTBlock's order. RematGPTBlock.from_torch copies each stock
    layer into its fused counterpart: ln_1 -> attn_qkv.norm, attn_qkv -> attn_qkv.linear,
    attn_out, ln_2 -> mlp.norm, fc1 -> mlp.fc1, fc2 -> mlp.fc2."""
    if isinstance(block, RematGPTBlock):
        block = [block.attn_qkv.norm, block.attn_qkv.linear, block.attn_out,
                 block.mlp.norm, block.mlp.fc1, block.mlp.fc2]
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
        example = torch.empty(b, s, h, device="meta", dtype=dtype, requires_grad=True)
        config = GPTConfig(hidden=h, heads=shape["heads"], layers=layers)
        variants = policies(device, layers) + plan_policies(device, example, config)
        yield Case(
            op="gpt_block", mode="fwd+bwd", dtype=dtype,
            shape=f"L={layers} b={b} s={s} h={h} heads={shape['heads']}", size=s,
            unit="TFLOP/s", work=flops, make_inputs=_make_inputs(shape, dtype, device),
            implementations=[variant.implementation(_step) for variant in variants],
            sbh_per_layer=layers * s * b * h, check=check_against(_step(lambda stack: stack)),
        )

