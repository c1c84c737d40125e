"""The cost model: the extra time each choice adds to a unit's training step, from the FLOPs and
bytes it recomputes, on a device's constants.

A device's constants (devices.py: the data sheets' figures, or what remat.calibrate() measured)
are its dense bf16 tensor-core FLOP/s, memory bandwidth and host link.

Per unit, from its stock forward (kept ops: the matmuls and attention; the others: elementwise,
norms, copies): a forward costs its FLOPs at the FLOP rate plus twice the bytes its ops write (each
written once and read once) at the bandwidth.
- stock: nothing extra.
- remat: its fused kernels rebuild in the backward the bytes they do not keep: twice the bytes it
  keeps less than stock; and what they recompute with matmuls, at the FLOP rate: remat.experts'
  up projection on every (token, expert) pair (Work.rebuilt_flops).
- remat-keep: as remat, its experts keeping their pre-activation (no up projection rebuilt).
- selective: the backward reruns the ops other than matmuls and attention.
- full: the backward reruns the whole forward.
- offload: the bytes copied to the host go out during the forward and come back during the
  backward, each overlapped with the unit's compute (offload.py's side stream): extra time
  max(0, transfer - forward) + max(0, transfer - backward), the backward taken as twice the
  forward; plus, never hidden, the copies' own device-memory traffic (each byte read once going
  out and written once coming back, at the bandwidth the kernels share). Per byte kept less,
  that traffic alone costs at least what remat's rebuilding does. Each unit is taken alone: two
  offloaded units in a row share the link in truth.

A causal LM's LM head and loss fused (remat.linear_cross_entropy) recompute the logits in their
backward: 2·tokens·hidden·vocab FLOPs more than the stock head and loss (the stock loss's own
traffic, the fp32 upcast and log-softmax of the logits, that the fused one saves is not counted).
"""

import torch

from .devices import DEVICES


def device_constants(device):
    """The Device for a name of DEVICES, or for a torch device (a GPU by its name); a ValueError
    naming `device` otherwise. A GPU's constants that remat.calibrate() measured and cached come
    before the table's (calibrate.py)."""
    from .calibrate import cached, calibrated

    if isinstance(device, str) and device in DEVICES:
        return (device != "cpu" and calibrated(device)) or DEVICES[device]
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} or a torch device, got {device!r}") from None
    if device.type in ("cpu", "meta"):
        return DEVICES["cpu"]
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        measured = cached().get(gpu)
        if measured is not None:
            return measured
        for name, constants in DEVICES.items():
            if name in gpu:
                return constants
        raise ValueError(f"no constants for GPU {gpu!r}: pass device= one of {', '.join(DEVICES)}")
    raise ValueError(f"device must be one of {', '.join(DEVICES)} or a cpu or cuda device, got {device}")


def _seconds(flops, written_bytes, device):
    return flops / device.flops_per_s + 2 * written_bytes / device.bytes_per_s


def extra_seconds(choice, stock, saves, device):
    """Predicted extra step time of `choice` for one unit: stock, its stock forward's UnitSaves;
    saves, the UnitSaves of the choice."""
    work = stock.work
    if choice == "stock":
        return 0.0
    if choice in ("remat", "remat-keep"):
        return (2 * max(0, stock.internal_bytes - saves.internal_bytes) / device.bytes_per_s
                + saves.work.rebuilt_flops / device.flops_per_s)
    if choice == "selective":
        return _seconds(work.other_flops, work.other_bytes, device)
    forward = _seconds(work.kept_flops + work.other_flops, work.kept_bytes + work.other_bytes, device)
    if choice == "full":
        return forward
    if choice == "offload":
        transfer = saves.offloaded_bytes / device.host_bytes_per_s
        traffic = 2 * saves.offloaded_bytes / device.bytes_per_s
        return max(0.0, transfer - forward) + max(0.0, transfer - 2 * forward) + traffic
    raise ValueError(f"unknown choice {choice!r}")


def fused_loss_seconds(tokens, hidden, vocab, device):
    """Predicted extra step time of the fused LM head and loss over the stock ones (see above)."""
    return 2 * tokens * hidden * vocab / device.flops_per_s
