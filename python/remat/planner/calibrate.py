"""remat.calibrate(): the cost model's constants measured on this machine's GPU, cached per GPU.

Three short timed runs (median of a few, CUDA events, as the attention autotuner times):
- matmul FLOP/s: a bf16 (m x k) @ (k x n) product, 2·m·n·k FLOPs;
- memory bandwidth: a copy of one device buffer into another, its bytes read plus written;
- host link: copies between pinned host memory and the device, each way; the slower is kept
  (an offloaded layer's bytes go out and come back).

The constants are written to planner-constants.json in the cache folder of the attention
autotuner ($REMAT_CACHE_DIR, else $XDG_CACHE_HOME/remat, else ~/.cache/remat), keyed by the GPU's
name (torch.cuda.get_device_name). remat.plan uses them over the data-sheet table for that GPU:
for a CUDA device by its name, and for a table name (device="H200") when one cached GPU's name
holds it. The measured rates are what these kernels reach, below the data sheet's peaks; the
per-choice formulas of cost.py stay a model either way.
"""

import json
import os
import tempfile
import time
import warnings

import torch

from ..triton_kernels import _autotune
from .cost import Device

CACHE_FILE = "planner-constants.json"
_FORMAT = 1
MATMUL_SHAPE = (8192, 8192, 8192)
COPY_BYTES = 2**30
HOST_BYTES = 2**28


def cache_path():
    return os.path.join(_autotune.cache_dir(), CACHE_FILE)


def _cuda_seconds(label, fn):
    return _autotune.cuda_time_ms(fn) / 1e3


def measure_constants(name, timer=_cuda_seconds, device="cuda", matmul_shape=MATMUL_SHAPE, copy_bytes=COPY_BYTES,
                      host_bytes=HOST_BYTES):
    """A Device of the rates measured on `device`: timer(label, fn) -> seconds of one fn() call
    (label: "matmul", "copy", "to host" or "from host"; tests pass a fake, with meta tensors)."""
    m, k, n = matmul_shape
    a = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    b = torch.empty(k, n, dtype=torch.bfloat16, device=device)
    flops_per_s = 2 * m * n * k / timer("matmul", lambda: torch.mm(a, b))
    source = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    bytes_per_s = 2 * copy_bytes / timer("copy", lambda: target.copy_(source))
    on_gpu = torch.device(device).type == "cuda"
    host = torch.empty(host_bytes, dtype=torch.uint8, device="meta" if source.is_meta else "cpu", pin_memory=on_gpu)
    near = torch.empty(host_bytes, dtype=torch.uint8, device=device)
    out = timer("to host", lambda: host.copy_(near, non_blocking=on_gpu))
    back = timer("from host", lambda: near.copy_(host, non_blocking=on_gpu))
    return Device(name, flops_per_s, bytes_per_s, host_bytes / max(out, back))


def calibrate(device=None, timer=_cuda_seconds):
    """Measure the cost model's constants on a CUDA GPU (default: the current one), cache them for
    its name and return them (a cost.Device). A RuntimeError without a GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("remat.calibrate() measures a CUDA GPU and torch sees none; without one, "
                           "remat.plan uses the data-sheet constants of remat.planner.DEVICES")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device to calibrate, got {device}")
    with torch.cuda.device(device):
        constants = measure_constants(torch.cuda.get_device_name(device), timer, device)
    store(constants)
    return constants


def cached():
    """{GPU name: Device} from the cache file; {} when there is none, with a warning when it is unreadable."""
    try:
        with open(cache_path(), encoding="utf-8") as handle:
            data = json.load(handle)
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a format-{_FORMAT} constants file")
        return {name: Device(name, float(c["flops_per_s"]), float(c["bytes_per_s"]), float(c["host_bytes_per_s"]))
                for name, c in data["devices"].items()}
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"remat.plan: ignoring the unreadable calibration cache {cache_path()} ({error}); "
                      "using the data-sheet constants", stacklevel=3)
        return {}


def store(constants):
    """Add (or replace) one GPU's constants in the cache file, written whole through a temporary file."""
    devices = cached()
    devices[constants.name] = constants
    entries = {name: {"flops_per_s": d.flops_per_s, "bytes_per_s": d.bytes_per_s,
                      "host_bytes_per_s": d.host_bytes_per_s} for name, d in sorted(devices.items())}
    folder = os.path.dirname(cache_path())
    os.makedirs(folder, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"format": _FORMAT, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "devices": entries}, handle, indent=1)
    os.replace(temp, cache_path())


def calibrated(name):
    """The cached constants of the GPU whose name holds `name` (a table name, "H200"), the first
    by name when several do; else None."""
    devices = cached()
    matching = sorted(gpu for gpu in devices if name in gpu)
    return devices[matching[0]] if matching else None
