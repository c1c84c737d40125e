"""The devices the planner knows: Device, a device's constants, and DEVICES, by name.

DEVICES holds each device's dense bf16 tensor-core FLOP/s and memory bandwidth (bytes/s read plus
written), from the vendors' data sheets (SXM parts): A100 312 TFLOP/s and 2.04 TB/s, H100 989
TFLOP/s and 3.35 TB/s, H200 989 TFLOP/s and 4.8 TB/s; and the host link's bytes/s each way, for
offloading: PCIe 4.0 x16 on the A100 (32 GB/s), PCIe 5.0 x16 on the H100 and H200 (64 GB/s). "cpu"
is a rough figure for planning on a machine without a GPU (1 TFLOP/s, 100 GB/s, no host link: no
offloading): its predicted times only rank the choices.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    flops_per_s: float
    bytes_per_s: float
    host_bytes_per_s: float = None  # the host link, each way; None: no offloading


DEVICES = {d.name: d for d in (
    Device("A100", 312e12, 2.04e12, 32e9),
    Device("H100", 989e12, 3.35e12, 64e9),
    Device("H200", 989e12, 4.8e12, 64e9),
    Device("cpu", 1e12, 100e9),
)}
