"""The one saved-byte counter: the bytes a forward keeps for its backward, each storage once.

Used by remat memory, the benchmarks' memory column and the tests' exact memory assertions.
"""

import contextlib
import inspect
import warnings

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from .policies import Checkpointed

# Recent torch hands a selective-checkpoint policy the op's output too (SelectiveCheckpointContext's
# op_output); torch 2.11 and earlier take is_recompute alone.
_CONTEXT_TAKES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def policy_saves(policy, func, args, kwargs, out):
    """Whether a selective-checkpoint `policy` keeps the output `out` of `func(*args, **kwargs)`,
    asked as torch's checkpoint asks it in a forward."""
    output = {"op_output": out} if _CONTEXT_TAKES_OUTPUT else {}
    decision = policy(SelectiveCheckpointContext(is_recompute=False, **output), func, *args, **kwargs)
    return decision is True or decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def _local(tensor):
    """A DTensor's local shard (what this rank holds: tensor parallel, FSDP2), any other tensor itself."""
    if hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh"):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


class SavedStorages:
    """The storages a forward saves for the backward, each counted once, those of `exclude` (the
    parameters) left out.

    A tensor saved by two ops costs its storage once, and a weight saved by a matmul's backward
    is not an activation. When offloading, a saved device tensor is freed once copied to the host
    and a later one may get its address: a weak reference tells them apart, so both are counted.
    """

    def __init__(self, exclude=()):
        self._parameters = {_local(t).untyped_storage().data_ptr() for t in exclude}
        self._saved = {}  # address -> (weak reference to the storage, bytes)
        self._freed_bytes = 0  # saved, then freed on the device: their host copies still count

    def add(self, tensor):
        storage = _local(tensor).untyped_storage()
        address = storage.data_ptr()
        if address in self._parameters:
            return
        previous = self._saved.get(address)
        if previous is not None and previous[0].expired():
            self._freed_bytes += previous[1]
        self._saved[address] = (StorageWeakRef(storage), storage.nbytes())

    def total_bytes(self, *excluded):
        """All the bytes saved, but the storages of `excluded` (the caller's input, the output)."""
        skip = {_local(tensor).untyped_storage().data_ptr() for tensor in excluded}
        return self._freed_bytes + sum(size for address, (ref, size) in self._saved.items()
                                       if address not in skip or ref.expired())


class _SelectiveSaves(TorchDispatchMode):
    """Adds to `saved` the outputs of the ops that selective checkpointing keeps.

    Selective checkpointing keeps the outputs of the ops its policy saves in a cache of its own,
    which saved-tensor hooks do not see. This mode sits below checkpoint's own dispatch modes, so
    every op they run reaches it too, and asks the running block's own policy, as they do.
    """

    def __init__(self, saved):
        super().__init__()
        self.saved = saved
        self.policies = []  # of the selectively checkpointed blocks running now, innermost last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.policies and policy_saves(self.policies[-1], func, args, kwargs, out):
            for tensor in pytree.tree_leaves(out):  # all its outputs: SDPA's logsumexp too
                if isinstance(tensor, torch.Tensor):
                    self.saved.add(tensor)
        return out


def count_saved_bytes(module, x, offload):
    """(device bytes, host bytes) that one forward keeps for the backward, by unique storage.

    Saved-tensor hooks see what autograd saves; inside a non-reentrant checkpoint they see only
    the checkpoint's handles, which cost nothing. The checkpoint instead holds its block's input,
    and a selective one also the outputs of the ops its policy saves: both are counted as well.
    Parameters are not activations and are left out.
    """
    saved = SavedStorages(module.parameters())

    def pack(tensor):
        saved.add(tensor)
        return tensor

    held = []
    checkpointed = [m for m in module.modules() if isinstance(m, Checkpointed)]
    hooks = [m.register_forward_pre_hook(lambda m, args: held.append(args[0])) for m in checkpointed]
    selective = [m for m in checkpointed if m.policy is not None]
    recorder = _SelectiveSaves(saved) if selective else contextlib.nullcontext()

    def enter(m, args):
        recorder.policies.append(m.policy)

    def leave(m, args, out):  # returns None: a forward hook's result would replace the output
        recorder.policies.pop()

    for m in selective:  # the recorder counts ops only while such a block runs
        hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with warnings.catch_warnings(), recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # torch warns that selective checkpointing's cache will go through these hooks one
            # day: pack would then see tensors the recorder sees, and each storage counts once.
            warnings.filterwarnings("ignore", "A saved_tensors_hooks context", FutureWarning)
            out = module(x)
    finally:
        for hook in hooks:
            hook.remove()
    for tensor in held:
        saved.add(tensor)
    total = saved.total_bytes(out, x)  # the input belongs to the caller
    return (0, total) if offload else (total, 0)


def saved_bytes(fn, exclude=()):
    """Bytes of the unique storages autograd saves while running fn(), leaving out those of `exclude`
    (pass a model's parameters to count activations only)."""
    saved = SavedStorages(exclude)

    def pack(tensor):
        saved.add(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved.total_bytes()
