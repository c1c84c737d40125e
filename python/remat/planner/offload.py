"""The "offload" choice: a unit's saved tensors go to host memory in its forward and come back for
its backward, through saved-tensor hooks of our own rather than torch.autograd.graph.save_on_cpu.

save_on_cpu copies each saved tensor on the compute stream (with pinned memory, non-blocking for
the host, but in line with the kernels: each copy delays the kernels queued after it), and copies
each one back only when the backward needs it. Here, on CUDA:
- forward: each saved tensor is copied to pinned host memory with a non-blocking copy on a side
  stream (after the compute stream's work so far), so the copy runs while the forward computes;
  record_stream keeps the device tensor's memory from reuse until its copy is done.
- backward: when the unit's first saved tensor is needed, all of the unit's tensors are sent back
  on the side stream, the last saved first (the backward needs them in about that order), so the
  later ones arrive while the backward computes; the compute stream waits for each tensor's own
  copy only.
Between the two, the device keeps nothing for the unit (its parameters and buffers, saved by
reference, stay where they are and are not copied). The copies brought back live until autograd
releases them after their node's backward: peak.py counts them all as the unit's transient.

On CPU and meta tensors the same hooks copy into plain (not pinned) host tensors: the machinery,
counts and results can be tested without a GPU, but nothing overlaps there, and plans for CPU
tensors never offer this choice. host_bytes: the bytes the last forward copied out (each saved
tensor its own copy, as save_on_cpu makes them).
"""

import functools
import weakref

import torch

_SIDE_STREAMS = {}  # device index -> the stream offload copies run on


def _side_stream(device):
    if device.index not in _SIDE_STREAMS:
        _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device.index]


class _Saved:
    """One saved tensor while it is away: its host copy, and the copy brought back. group: weak
    references to the saved tensors of the same forward, so that autograd's release of one (after
    its node's backward) frees its device copy, with no reference cycle to wait for."""

    __slots__ = ("device", "host", "sent", "back", "arrived", "group", "__weakref__")

    def __init__(self, device, group):
        self.device, self.group = device, group
        self.host = self.sent = self.back = self.arrived = None


class HostOffload:
    """The saved-tensor hooks of one offloaded unit (see the module docstring)."""

    def __init__(self):
        self.host_bytes = 0

    def hooks(self, module):
        """The hooks for one forward of `module`: its tensors saved in that forward are one group."""
        keep = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}
        self.host_bytes = 0
        group = []
        return torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, keep, group), self._unpack)

    def _pack(self, keep, group, tensor):
        if tensor.untyped_storage()._cdata in keep:  # a weight: on the device anyway
            return tensor
        saved = _Saved(tensor.device, group)
        on_gpu = tensor.device.type == "cuda"
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta" if tensor.is_meta else "cpu",
                           pin_memory=on_gpu)
        if on_gpu:
            stream = _side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written by then
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                saved.sent = stream.record_event()
            tensor.record_stream(stream)
        else:
            host.copy_(tensor)
        saved.host = host
        self.host_bytes += host.nbytes
        group.append(weakref.ref(saved))
        return saved

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.back is None:
            _bring_back(saved.group)
        if saved.arrived is not None:
            current = torch.cuda.current_stream(saved.device)
            current.wait_event(saved.arrived)
            saved.back.record_stream(current)
        return saved.back


def _bring_back(group):
    """Start copying every tensor of the group that is still away back to its device, last saved first."""
    for reference in reversed(group):
        saved = reference()
        if saved is None or saved.back is not None:  # released already, or back
            continue
        if saved.device.type != "cuda":
            saved.back = saved.host
            continue
        stream = _side_stream(saved.device)
        with torch.cuda.stream(stream):
            stream.wait_event(saved.sent)
            saved.back = saved.host.to(saved.device, non_blocking=True)
            saved.arrived = stream.record_event()
        saved.host = None  # the pinned buffer returns to torch's host cache once the copy is done


# Under torch.compile an offloaded unit runs eagerly, a graph break of its own: Dynamo recurses
# without end resuming after these hooks' context (torch 2.14), and the copies are host-side work.
@torch.compiler.disable
def offloaded_forward(module, offload, *args, **kwargs):
    """`module`'s class forward with its saved tensors offloaded (no hooks without a backward)."""
    forward = type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with offload.hooks(module):
        return forward(*args, **kwargs)
