"""Tensor parallel: remat's fused gated MLP and norms on projections that torch's `parallelize_module`
sharded, and the fused LM loss on a column-parallel head (remat.linear_cross_entropy's vocabulary-parallel
path: the head's input as its layout hook makes it, the head's shard of the vocabulary).

A gated MLP whose gate and up projections are column-parallel (ColwiseParallel: weights Shard(0) on a
1-D device mesh) and whose down projection is row-parallel (RowwiseParallel: weight Shard(1)) is
computed on each rank's shards as Megatron-LM computes it: the whole input in, this rank's slice of
the intermediate, a partial sum out, reduced across the ranks; in the backward the input's gradient
(and the fused norm's weight gradient, each rank's part of it) summed across the ranks. The layouts
are torch's own, never assumed: the input is what the column-parallel projections' hooks make of it
(a sequence-parallel input is gathered there, as stock), the output what the row-parallel
projection's hook makes of the partial sum (reduced, or reduce-scattered to a sequence shard), the
reductions DTensor's redistributions of the same placements stock computes with.
"""

import torch

from ._guards import _GLOBAL_HOOK_DICTS
from .specs import Linear

# The module whose functions parallelize_module's styles install as hooks (distribute_module's input and
# output layout conversions): the only hooks a fused op that applies them itself may stand in for.
_LAYOUT_HOOKS_MODULE = "torch.distributed.tensor._api"


def _dtensor():
    """DTensor's class, or None where torch has no torch.distributed. (Not functools.cache'd: torch.compile
    warns on every cached function it traces; the import of a loaded module is a dictionary lookup.)"""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(value):
    """Whether `value` is a DTensor (False where torch has no torch.distributed)."""
    dtensor = _dtensor()
    return dtensor is not None and isinstance(value, dtensor)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def is_sharded(module):
    """Whether `module`'s weight is a DTensor (asked at every call of a fused module: a plain one is told
    by its class alone)."""
    weight = module._parameters.get("weight")  # (not getattr: nn.Module's __getattr__ costs a µs a call)
    return weight is not None and type(weight) not in _PLAIN_TENSORS and is_dtensor(weight)


def _layout_hooks_reason(module, label):
    """Why `module`'s hooks are not exactly the input and output layout hooks parallelize_module installs."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    if module._backward_hooks or module._backward_pre_hooks or module._forward_pre_hooks_with_kwargs or \
            len(module._forward_pre_hooks) != 1 or len(module._forward_hooks) != 1 or \
            any(map(len, _GLOBAL_HOOK_DICTS)) or not all(map(is_layout_hook, hooks)):
        return f"{label} has hooks besides tensor parallel's input and output layouts"
    return None


def _placement_reason(module, label, shard_dim, mesh):
    """Why `module` is not a plain nn.Linear sharded on `shard_dim` of its weight (bias None, or sharded
    with it where it is column-parallel) on the 1-D mesh `mesh`, or None."""
    from torch.distributed.tensor import Shard

    dtensor = _dtensor()
    if getattr(type(module), "remat_stock", type(module)) is not torch.nn.Linear:  # a swapped one: its stock class
        return f"{label} is {type(module).__name__}, not exactly nn.Linear (under tensor parallel)"
    weight, bias = module.weight, module.bias
    if not isinstance(weight, dtensor) or weight.device_mesh != mesh or weight.placements != (Shard(shard_dim),):
        placements = getattr(weight, "placements", "a plain tensor")
        return f"{label}.weight is {placements}, not Shard({shard_dim}) on the mesh of the fused projections"
    if not weight.is_floating_point():
        return f"{label}.weight has dtype {weight.dtype}, not a floating dtype"
    if bias is not None and (shard_dim == 1 or not isinstance(bias, dtensor) or bias.placements != (Shard(0),)):
        return f"{label} has a bias, which remat's tensor-parallel MLP does not take on a row-parallel projection"
    return _layout_hooks_reason(module, label)


def mlp_reason(ups, down, labels):
    """Why remat's fused gated MLP cannot compute column-parallel `ups` (gate and up, or one gate_up)
    and row-parallel `down` on their shards, or None: each a plain nn.Linear with only parallelize_module's
    layout hooks, weights Shard(0) (ups) and Shard(1) (down) on one 1-D mesh."""
    mesh = down.weight.device_mesh
    if mesh.ndim != 1:
        return _mesh_reason(labels[-1], mesh)
    for module, label in zip(ups, labels):
        reason = _placement_reason(module, label, 0, mesh)
        if reason:
            return reason
    return _placement_reason(down, labels[-1], 1, mesh)


def _layout(module, x):
    """`x` as `module`'s layout pre-hook hands it to the module's forward."""
    for hook in module._forward_pre_hooks.values():
        result = hook(module, (x,))
        if result is not None:
            x = result[0] if isinstance(result, tuple) else result
    return x


def column_input(ups, x, labels):
    """(this rank's input to the column-parallel `ups`: the whole of it, its gradient summed across the
    ranks, None), or (None, why not): what their layout hooks make of `x` is not replicated."""
    from torch.distributed.tensor import Partial, Replicate

    placed = [_layout(module, x) for module in ups]
    for tensor, label in zip(placed, labels):
        if not isinstance(tensor, _dtensor()) or tensor.placements != (Replicate(),) or tensor.shape != placed[0].shape:
            return None, f"{label}'s input layout is {getattr(tensor, 'placements', 'a plain tensor')}, not Replicate()"
    return placed[0].to_local(grad_placements=[Partial()]), None


def summed_grad(tensor, mesh):
    """`tensor` (the same on every rank) as it is, its gradient summed across the ranks of `mesh`."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def norm_of_replicated(norm, mesh):
    """The remat.specs.Norm `norm` of a norm replicated on every rank (not sharded: plain parameters), its
    weight's and bias's gradients summed across the ranks of `mesh`: each rank computes its part from the
    columns it projects."""
    bias = norm.bias if norm.bias is None else summed_grad(norm.bias, mesh)
    return norm._replace(weight=summed_grad(norm.weight, mesh), bias=bias)


def column_reason(module, label):
    """Why a fused norm cannot be computed into the column-parallel `module` on its shard, or None: a plain
    nn.Linear with only parallelize_module's layout hooks, its weight (and bias) Shard(0) on a 1-D mesh."""
    mesh = module.weight.device_mesh
    return _mesh_reason(label, mesh) if mesh.ndim != 1 else _placement_reason(module, label, 0, mesh)


def head_input(head, hidden):
    """What the column-parallel LM head's layout hook makes of `hidden`: the whole of it on every rank (a
    DTensor Replicate(), gathered from a sequence shard where the plan says so), as remat.linear_cross_entropy
    takes it beside the head's vocabulary shard. ColwiseParallel always hands its forward that; a RuntimeError
    where a custom style does not (the fused loss then cannot compute what the head would)."""
    from torch.distributed.tensor import Replicate

    placed = _layout(head, hidden)
    if not isinstance(placed, _dtensor()) or placed.placements != (Replicate(),):
        raise RuntimeError(f"remat's vocabulary-parallel LM loss: lm_head's input layout is "
                           f"{getattr(placed, 'placements', 'a plain tensor')}, not Replicate()")
    return placed


def _mesh_reason(label, mesh):
    return f"{label}.weight lies on a {mesh.ndim}-D device mesh (remat's tensor-parallel fusions take 1-D)"


def column_output(out, mesh):
    """This rank's columns `out` of a column-parallel projection's output, as its layout hook expects them."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(out, mesh, [Shard(-1)], run_check=False)


def apply_local(function, module, x):
    """function(module, x) on the local tensor of the DTensor `x`, placed as `x` is: a replicated norm's
    stock forward on a projection's replicated input."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return function(module, x)
    return DTensor.from_local(function(module, x.to_local()), x.device_mesh, x.placements, run_check=False)


def is_layout_hook(hook):
    """Whether `hook` is one of the input and output layout conversions parallelize_module installs."""
    return getattr(hook, "__module__", None) == _LAYOUT_HOOKS_MODULE


def local_linear(module):
    """The Linear of this rank's shard of a sharded nn.Linear."""
    bias = module.bias.to_local() if module.bias is not None else None
    return Linear(module.weight.to_local(), bias)


def row_output(down, partial):
    """What the row-parallel `down` returns for this rank's partial sum `partial` of its output: its layout
    hook's reduction of it (all-reduce, or reduce-scatter to a sequence shard)."""
    from torch.distributed.tensor import DTensor, Partial

    out = DTensor.from_local(partial, down.weight.device_mesh, [Partial()], run_check=False)
    for hook in down._forward_hooks.values():
        result = hook(down, (), out)
        if result is not None:
            out = result
    return out
