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
holds it. The measured rates are what these kernels reach, below the data sheet's peaks.

Given a model and example inputs, calibrate also measures each choice's real extra time once: a
training step of the model with every unit under that choice (the layers outside the units the
same in each), timed against the all-stock step, the difference split evenly over the units (they
are repeated blocks of one class at one shape). Cached in planner-choices.json for that GPU and
the model's signature (model_signature: its classes, unit count, parameter count and dtype, and the
example inputs' shapes and dtypes), remat.plan then uses these times, not cost.py's formulas, for
that model on that GPU (also when planning from meta tensors, device= the GPU's table name).
"""

import json
import os
import tempfile
import time
import warnings

import torch

from ..triton_kernels import _autotune
from .devices import Device

CACHE_FILE = "planner-constants.json"
CHOICES_FILE = "planner-choices.json"
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


def calibrate(model=None, example_inputs=None, device=None, timer=_cuda_seconds):
    """Measure the cost model's constants on a CUDA GPU (default: the current one), cache them for
    its name and return them (a cost.Device). With `model` (on that GPU) and `example_inputs`, also
    each plan choice's extra time per unit, cached for the model's signature (see the module
    docstring). A RuntimeError without a GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("remat.calibrate() measures a CUDA GPU and torch sees none; without one, "
                           "remat.plan uses the data-sheet constants of remat.planner.DEVICES")
    if (model is None) != (example_inputs is None):
        raise ValueError("model and example_inputs go together: pass both to time the plan choices, or neither")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device to calibrate, got {device}")
    name = torch.cuda.get_device_name(device)
    with torch.cuda.device(device):
        constants = measure_constants(name, timer, device)
        store(constants)
        if model is not None:
            store_choices(name, model_signature(model, example_inputs), measure_choices(model, example_inputs, timer))
    return constants


def model_signature(model, example_inputs):
    """What a model's measured choice times are kept under: its class, its units' class and count,
    its parameter count and dtype, and the example inputs' shapes and dtypes (not their values or
    device, so that a meta copy planned for the GPU finds them)."""
    from .counting import split_inputs
    from .units import find_units

    paths = find_units(model)
    unit = model.get_submodule(paths[0])
    parameters = list(model.parameters())
    dtype = str(parameters[0].dtype).replace("torch.", "") if parameters else "none"
    args, kwargs = split_inputs(example_inputs)
    inputs = [f"{name}:{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"
              for name, t in [*enumerate(args), *sorted(kwargs.items())] if isinstance(t, torch.Tensor)]
    return "|".join([type(model).__name__, f"{len(paths)}x{type(unit).__name__}",
                     f"{sum(p.numel() for p in parameters)}{dtype}", *inputs])


def _step_loss(output):
    """The loss a training step of the model backpropagates: its .loss, else the sum of its first
    floating-point output (the times, not the values, are measured)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    import torch.utils._pytree as pytree

    first = next(t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.float().sum()


def measure_choices(model, example_inputs, timer=_cuda_seconds, choices=None):
    """{choice: extra seconds per unit over stock}: timer(choice, step) for a training step of a copy
    of `model` (sharing its parameters) with every unit under each choice; the differences to the
    stock step over the number of units, 0 at least. The parameters' .grad are left as they were.
    choices: default every choice of units.CHOICES the inputs' device offers (offloading on CUDA;
    "remat-keep" for a model with experts on remat.experts)."""
    from . import _shell
    from .counting import split_inputs
    from .units import CHOICES, ON_ANY_DEVICE, apply_choices, find_units, run_remat_experts

    args, kwargs = split_inputs(example_inputs)
    paths = find_units(model)
    parameters = list(model.parameters())
    on_gpu = any(p.is_cuda for p in parameters)
    choices = choices or (CHOICES if on_gpu else ON_ANY_DEVICE)
    grads = [p.grad for p in parameters]

    def step(shell):
        _step_loss(shell(*args, **kwargs)).backward()
        for p in parameters:
            p.grad = None

    seconds = {}
    try:
        for choice in choices:
            shell = _shell(model, on_meta=False).train(model.training)
            units = apply_choices(shell, paths, [choice] * len(paths))
            if choice == "remat-keep" and not run_remat_experts(units):
                continue  # no experts on remat.experts: the same as "remat"
            seconds[choice] = timer(choice, lambda shell=shell: step(shell))
    finally:
        for p, grad in zip(parameters, grads):
            p.grad = grad
    return {choice: max(0.0, (t - seconds["stock"]) / len(paths)) for choice, t in seconds.items()}


def _choices_path():
    return os.path.join(_autotune.cache_dir(), CHOICES_FILE)


def _read_json(path, what):
    """The cache file's content ({} when there is none, with a warning when it is unreadable)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a format-{_FORMAT} {what} file")
        return data
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError, AttributeError) as error:
        warnings.warn(f"remat.plan: ignoring the unreadable calibration cache {path} ({error}); "
                      f"using the {what} of the cost model", stacklevel=4)
        return {}


def _write_json(path, content):
    """Write the cache file whole, through a temporary file in its folder."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"format": _FORMAT, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **content},
                  handle, indent=1)
    os.replace(temp, path)


def store_choices(gpu, signature, seconds):
    """Keep one model's measured extra seconds per unit and choice for GPU `gpu`."""
    gpus = _read_json(_choices_path(), "choice times").get("gpus", {})
    gpus.setdefault(gpu, {})[signature] = {choice: float(s) for choice, s in seconds.items()}
    _write_json(_choices_path(), {"gpus": gpus})


def measured_choices(gpu, signature):
    """{choice: extra seconds per unit} measured for that GPU (its full name) and model signature, or None."""
    entry = _read_json(_choices_path(), "choice times").get("gpus", {}).get(gpu, {}).get(signature)
    if entry is None:
        return None
    try:
        return {str(choice): float(s) for choice, s in entry.items()}
    except (AttributeError, TypeError, ValueError):
        return None


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
    _write_json(cache_path(), {"devices": entries})


def calibrated(name):
    """The cached constants of the GPU whose name holds `name` (a table name, "H200"), the first
    by name when several do; else None."""
    devices = cached()
    matching = sorted(gpu for gpu in devices if name in gpu)
    return devices[matching[0]] if matching else None
