"""Exact saved bytes of a forward, attributed to the units a plan chooses for, and the work each
unit's forward does (for the cost model).

One forward runs under three recorders: saved-tensor hooks (what autograd keeps), the inputs a
checkpointed unit holds, and the op outputs a selectively checkpointed unit keeps in its cache
(saved-tensor hooks see neither, see remat.saved). Every storage is counted once. A dispatch mode
notes, for each storage, where it was made: inside unit i, or outside every unit. A storage made
inside unit i that is not one of its outputs is unit i's own ("internal"): no other unit can keep
it, so those bytes add up over units. The rest (a unit's outputs, what the embeddings and the
rotary tables make) can be kept by several units at once and costs once: each unit records which
of them it keeps, by a key that is the same in every run (("out", i, k): unit i's k-th output;
("outside", n): the n-th storage made outside the units), and a plan pays for their union.
"""

import contextlib
import dataclasses
import warnings

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from ..policies import save_matmuls_and_attention
from ..saved import policy_saves
from .units import checkpoint_policy

OUTSIDE = -1  # the scope of what runs outside every unit


@dataclasses.dataclass
class Work:
    """What a forward computes: FLOPs and bytes written by the ops selective checkpointing keeps
    (matmuls, attention) and by all the others."""

    kept_flops: float = 0.0
    kept_bytes: float = 0.0
    other_flops: float = 0.0
    other_bytes: float = 0.0
    largest_output: int = 0  # the most bytes one op made (its gradient is as large: the peak model's)
    rebuilt_flops: float = 0.0  # matmul FLOPs remat's backward recomputes (rebuilt_flops())


@dataclasses.dataclass
class UnitSaves:
    internal_bytes: int = 0  # storages made inside the unit, not its outputs
    shared_keys: set = dataclasses.field(default_factory=set)  # keys of the other storages it keeps
    work: Work = dataclasses.field(default_factory=Work)
    offloaded_bytes: int = 0  # "offload": the bytes its forward copied to the host


@dataclasses.dataclass
class ForwardSaves:
    """The saves of one forward: per unit, outside the units (scope OUTSIDE), and the bytes of each key."""

    units: list
    outside: UnitSaves
    key_bytes: dict
    # keys ("outside", n) from n = after_units on are storages made after every unit returned (a causal
    # LM's final norm, LM head and loss); the others were made before a unit that may keep them
    after_units: int = 0

    def total_bytes(self):
        keys = set(self.outside.shared_keys).union(*(u.shared_keys for u in self.units))
        return (self.outside.internal_bytes + sum(u.internal_bytes for u in self.units)
                + sum(self.key_bytes[k] for k in keys))


def _tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def rebuilt_flops(func, args):
    """The matmul FLOPs remat's backward of this op recomputes: remat.experts' up projection,
    2 · pairs · h · N1, under its recompute policy (keep_hidden False, its last argument); 0 else.
    Computed from the shapes, so on meta too; an expert-parallel sentinel pair counts as a pair."""
    if func.name() != "remat::experts_fwd" or args[-1]:
        return 0
    x, top_k_index, gate_up = args[0], args[1], args[3]
    return 2 * top_k_index.numel() * x.shape[1] * gate_up.shape[1]


def _flops(func, args, kwargs, out):
    count = flop_registry.get(func._overloadpacket)
    return count(*args, **kwargs, out_val=out) if count is not None else 0


class _Recorder(TorchDispatchMode):
    """Notes where each storage is made and what each op computes, and keeps, while a selectively
    checkpointed unit runs, the outputs of the ops its policy saves (as remat.saved does)."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = self.counter
        scope = counter.scope[-1]
        kept = save_matmuls_and_attention(None, func) == CheckpointPolicy.MUST_SAVE
        new_bytes = sum(counter.made(t, scope) for t in _tensors(out))
        work = counter.saves(scope).work
        work.largest_output = max(work.largest_output, new_bytes)
        if scope != OUTSIDE:
            work.rebuilt_flops += rebuilt_flops(func, args)
            flops = _flops(func, args, kwargs, out)
            if kept:
                work.kept_flops += flops
                work.kept_bytes += new_bytes
            else:
                work.other_flops += flops
                work.other_bytes += new_bytes
        policy = counter.selective.get(scope)
        if policy is not None and policy_saves(policy, func, args, kwargs, out):
            for tensor in _tensors(out):  # all its outputs: SDPA's logsumexp too
                counter.keep(tensor)
        return out


class _Counter:
    def __init__(self, excluded, unit_count):
        self.excluded = {t.untyped_storage()._cdata for t in excluded}
        self.alive = []  # every storage seen, held so that no identity is reused while counting
        self.origin = {}  # storage identity -> (scope, key or None for internal)
        self.outside_made = 0
        self.after_units = 0  # outside_made when the last unit returned
        self.scope = [OUTSIDE]
        self.selective = {}  # unit index -> its selective policy, for the checkpointed units
        self.per_unit = [UnitSaves() for _ in range(unit_count)]
        self.outside = UnitSaves()
        self.kept = {}  # storage identity -> the scopes that keep it
        self.key_bytes = {}

    def saves(self, scope):
        return self.outside if scope == OUTSIDE else self.per_unit[scope]

    def made(self, tensor, scope):
        """Note the storage of an op's output; its bytes if it is new."""
        storage = tensor.untyped_storage()
        identity = storage._cdata
        if identity in self.origin or identity in self.excluded:
            return 0
        self.alive.append(storage)
        if scope == OUTSIDE:
            self.origin[identity] = (scope, ("outside", self.outside_made))
            self.outside_made += 1
        else:
            self.origin[identity] = (scope, None)
        return storage.nbytes()

    def mark_outputs(self, unit, out):
        for k, tensor in enumerate(_tensors(out)):
            identity = tensor.untyped_storage()._cdata
            if self.origin.get(identity, (None,))[0] == unit:
                self.origin[identity] = (unit, ("out", unit, k))

    def keep(self, tensor):
        storage = tensor.untyped_storage()
        identity = storage._cdata
        if identity in self.excluded:
            return
        if identity not in self.origin:  # made by no op seen here (a tensor attribute of the model)
            self.alive.append(storage)
            self.origin[identity] = (OUTSIDE, ("unseen", identity))
        self.kept.setdefault(identity, set()).add(self.scope[-1])
        self.key_bytes.setdefault(identity, storage.nbytes())

    def result(self):
        key_bytes = {}
        for identity, scopes in self.kept.items():
            made_in, key = self.origin[identity]
            size = self.key_bytes[identity]
            if key is None:  # internal to the unit that made it, whoever keeps it
                self.saves(made_in).internal_bytes += size
                continue
            key_bytes[key] = size
            for scope in scopes:
                self.saves(scope).shared_keys.add(key)
        return ForwardSaves(self.per_unit, self.outside, key_bytes, self.after_units)


class _GpuAttentionOnMeta(TorchFunctionMode):
    """On meta tensors, runs SDPA through the kernels a GPU picks, so that autograd keeps what it
    keeps there: flash attention (q, k, v, the output laid out (b, s, h, d), the fp32 log-sum-exp)
    without a mask, also with grouped keys and values (enable_gqa: k and v kept once per group);
    memory-efficient attention (the same, and the mask as a bias) with a mask. Left alone, SDPA takes
    its math path on meta, which keeps the s x s probabilities: on a GPU only grouped keys and values
    with a mask take it (transformers repeats k and v to every head instead)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return _gpu_sdpa(*args, **kwargs)


def _gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    grouped = key.dim() == 4 and key.shape[1] != query.shape[1]
    if not query.is_meta or query.dim() != 4 or (grouped and (not enable_gqa or attn_mask is not None)):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  scale=scale)[0]
    if attn_mask.dtype == torch.bool:  # the GPU turns a boolean mask into an additive one (a new tensor)
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device="meta")
    batch, heads, length = query.shape[:3]
    bias = attn_mask.expand(batch, heads, length, key.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p,
                                                                  is_causal, scale=scale)[0]


def count_forward(model, args, kwargs, units=()):
    """The saves of one training forward of model(*args, **kwargs), attributed to `units` (modules
    of the model, every checkpointed one among them); parameters, buffers and the inputs are not
    activations and are left out. On meta inputs, SDPA keeps what it keeps on a GPU."""
    counter = _Counter([*model.parameters(), *model.buffers(), *_tensors((args, kwargs))], len(units))
    hooks = []
    for i, unit in enumerate(units):
        hooks.append(unit.register_forward_pre_hook(lambda m, a, kw, i=i: _enter(counter, m, i, a, kw),
                                                    with_kwargs=True))
        hooks.append(unit.register_forward_hook(lambda m, a, out, i=i: _leave(counter, i, out)))

    def pack(tensor):
        counter.keep(tensor)
        return tensor

    on_meta = any(t.is_meta for t in _tensors((args, kwargs)))
    try:
        with warnings.catch_warnings(), _GpuAttentionOnMeta() if on_meta else contextlib.nullcontext(), \
                _Recorder(counter), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # torch warns that selective checkpointing's cache will go through these hooks one
            # day: each storage would still count once.
            warnings.filterwarnings("ignore", "A saved_tensors_hooks context", FutureWarning)
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return counter.result()


def _hold_inputs(counter, args, kwargs):
    for tensor in _tensors((args, kwargs)):  # the checkpoint holds them for its recompute
        counter.keep(tensor)


def _enter(counter, module, index, args, kwargs):
    checkpointed, policy = checkpoint_policy(module)
    counter.scope.append(index)
    if checkpointed:
        _hold_inputs(counter, args, kwargs)
        if policy is not None:
            counter.selective[index] = policy


def _leave(counter, index, out):
    counter.scope.pop()
    counter.selective.pop(index, None)
    counter.mark_outputs(index, out)
    counter.after_units = counter.outside_made


def saved_bytes_of(model, example_inputs):
    """Bytes one training forward of `model` keeps for the backward at `example_inputs`, each
    storage once, with what checkpointed units hold (the check a plan's prediction must meet)."""
    args, kwargs = split_inputs(example_inputs)
    checkpointed = [m for m in model.modules() if checkpoint_policy(m)[0]]
    return count_forward(model, args, kwargs, checkpointed).total_bytes()


def split_inputs(example_inputs):
    """(args, kwargs) from a tuple of positional arguments or a dict of keyword arguments."""
    if isinstance(example_inputs, dict):
        return (), example_inputs
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    raise TypeError(f"example_inputs must be a tuple of positional arguments or a dict of keyword arguments, "
                    f"got {type(example_inputs).__name__}")
