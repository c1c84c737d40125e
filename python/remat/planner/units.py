"""The units a plan chooses for (a model's repeated blocks) and how each choice is applied to one.

Choices: "stock" (the block as it is), "remat" (remat.convert's fused recompute), "remat-keep" (the
same, but a mixture of experts' experts keep their pre-activation: no up projection rebuilt in the
backward, more bytes; a choice for blocks with experts on remat.experts only), "selective"
(torch's selective checkpointing: keep matmul and attention outputs, recompute the rest), "full"
(full checkpointing of the block), "offload" (the block's saved tensors go to host memory and come
back for its backward: offload.py; a choice for GPUs only). A checkpointed or offloaded block keeps
its class, its attributes and its state_dict keys: its forward is overridden on the instance, and
remat.revert removes the override.

Beside the units, a causal LM's LM head and loss: "stock" (logits and transformers' loss) or
"fused" (remat.convert's remat.linear_cross_entropy, convert/hf/loss.py: no logits kept in training
with labels). Their choice is remat.convert's "loss" rule, applied or not.
"""

import functools
import inspect
import warnings

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..convert import LAYERS, RematWarning, convert, revert
from ..convert.hf.experts import keep_experts_hidden, runs_remat_experts
from ..policies import save_matmuls_and_attention
from .offload import HostOffload, offloaded_forward

CHOICES = ("stock", "remat", "remat-keep", "selective", "full", "offload")
ON_ANY_DEVICE = tuple(c for c in CHOICES if c != "offload")  # "offload": a choice on GPUs only
REMAT_CHOICES = ("remat", "remat-keep")  # remat.convert's, for the blocks it changes
CHECKPOINT_POLICIES = {"selective": save_matmuls_and_attention, "full": None}
HEAD_CHOICES = ("stock", "fused")  # a causal LM's LM head and loss


def find_units(model):
    """Dotted paths of the model's repeated blocks: the children of each outermost nn.ModuleList
    (or nn.Sequential) whose children are all of one class holding parameters, as Hugging Face's
    decoder and encoder layer lists and remat.gpt's stacks are. A ValueError if there is none."""
    paths = []

    def visit(module, path):
        children = list(module.children())
        if (isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and children
                and len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters())):
            paths.extend(f"{path}.{name}" if path else name for name, _ in module.named_children())
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    if not paths:
        raise ValueError(f"model ({type(model).__name__}) has no list of repeated blocks "
                         "(an nn.ModuleList or nn.Sequential of one block class) for a plan to choose for")
    return paths


def _parent_and_name(model, path):
    parent_path, _, name = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), name


# The names Hugging Face layers take a KV cache by. A checkpointed layer must not write to one:
# its recompute in the backward would append the same keys and values a second time (and under
# selective checkpointing see longer keys than the forward did). Hugging Face's own gradient
# checkpointing drops the cache the same way.
CACHE_ARGUMENTS = ("cache", "layer_past", "past_key_values", "past_key_value")


def _checkpointed_forward(module, policy, *args, **kwargs):
    forward = type(module).forward.__get__(module)
    if not torch.is_grad_enabled():  # no backward to recompute for
        return forward(*args, **kwargs)
    bound = inspect.signature(forward).bind(*args, **kwargs)  # GPT-2's blocks take the cache by position
    if bound.arguments.get("use_cache"):
        bound.arguments["use_cache"] = False
    for name in CACHE_ARGUMENTS:
        if bound.arguments.get(name) is not None:
            bound.arguments[name] = None
    args, kwargs = bound.args, bound.kwargs
    if policy is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def checkpoint_in_place(module, choice):
    """Run `module` under torch's (selective) checkpointing from now on; remat.revert undoes it."""
    module.forward = functools.partial(_checkpointed_forward, module, CHECKPOINT_POLICIES[choice])
    module.remat_checkpoint = choice


def offload_in_place(module):
    """Offload `module`'s saved tensors to host memory from now on; remat.revert undoes it. The
    HostOffload is module.remat_offload (its host_bytes: what the last forward copied out)."""
    offload = HostOffload()
    module.forward = functools.partial(offloaded_forward, module, offload)
    module.remat_checkpoint = "offload"  # the marker of a plan's in-place forward, which revert removes
    module.remat_offload = offload


def checkpoint_policy(module):
    """(True, selective policy or None) for a module checkpoint_in_place made, else (False, None)."""
    choice = vars(module).get("remat_checkpoint")
    return (choice in CHECKPOINT_POLICIES), CHECKPOINT_POLICIES.get(choice)


def is_planned(model):
    """True when remat.convert or a plan already changed some module of `model`."""
    return any(getattr(m, "remat_fused", False) or "remat_fx" in vars(m) or "remat_checkpoint" in vars(m)
               or runs_remat_experts(m) for m in model.modules())


def run_remat_experts(units):
    """Whether some unit holds experts running remat.experts: where "remat-keep" differs from "remat"."""
    return any(runs_remat_experts(m) for unit in units for m in unit.modules())


def fused_head(model):
    """The module of `model` whose LM head and loss remat.convert fused (convert/hf/loss.py), or None."""
    return next((m for m in model.modules() if "remat_head" in vars(m)), None)


def apply_choices(model, paths, choices, head="stock"):
    """Apply one choice per unit to `model` in place: convert it all with remat.convert (the
    layers outside the units too, whatever the choices, so that they keep the same bytes in every
    plan), then give the units that are not "remat" their stock modules back and checkpoint those
    that are "selective" or "full". head "fused": the LM head and loss as remat.convert fuses them
    (fused_head says whether it did); anything else keeps them stock. Returns the units' modules
    after the change."""
    layers = LAYERS if head == "fused" else LAYERS - {"loss"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)  # a unit that nothing fuses is told apart below
        convert(model, inplace=True, layers=layers)
    units = []
    for path, choice in zip(paths, choices):
        parent, name = _parent_and_name(model, path)
        unit = parent._modules[name]
        if choice not in REMAT_CHOICES:
            unit = revert(unit)
            parent._modules[name] = unit
        keep_experts_hidden(unit, choice == "remat-keep")
        if choice in CHECKPOINT_POLICIES:
            checkpoint_in_place(unit, choice)
        elif choice == "offload":
            offload_in_place(unit)
        units.append(unit)
    return units
