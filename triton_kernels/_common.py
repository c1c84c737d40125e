"""Small helpers shared by the Triton op families: block sizing, grid sizing, the launch device."""

import functools

import torch

# Short dtype names for the ahead-of-time cases' names (aot_cases() in each op module).
TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# Stand-in for the SM count when kernels run on CPU tensors under the Triton
# interpreter (TRITON_INTERPRET=1): a few programs, so persistent loops and the
# (G, N) partial-sum buffers are exercised with G > 1 without making tests slow.
CPU_NUM_SMS = 4


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; CPU_NUM_SMS for any other device.

    Grid sizes derived from this depend only on the device, never on timing, so
    results that depend on the grid (partial-sum reductions) are reproducible.
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    return CPU_NUM_SMS


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim has stride 1, else a contiguous copy.

    The kernels index the last dim with stride 1: anything else gets a copy, never a wrong answer.
    """
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def on_input_device(launcher):
    """Run `launcher` with the current CUDA device set to its first argument's.

    Triton launches on the current device and its current stream, whatever device the tensors
    are on: a caller holding tensors on cuda:1 while cuda:0 is current would get a kernel on the
    wrong GPU (the CUDA extension's kernels take a device guard for the same reason).
    """

    @functools.wraps(launcher)
    def launch(first, *args, **kwargs):
        if first.device.type != "cuda":
            return launcher(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return launcher(first, *args, **kwargs)

    return launch


# --- argument checks -----------------------------------------------------------------------------
# The launchers of the newer op families check their arguments themselves: a weight of the wrong
# length or a dy of the wrong shape would otherwise be read out of bounds, silently. Each error
# names the argument.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_float_tensor(name, t, dims=None, shape=None, like=None, dtypes=FLOAT_DTYPES):
    """t must be a tensor of one of `dtypes`, with `dims` dims or exactly `shape`, on the device of
    like = (its name, a tensor) when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if like is not None and t.device != like[1].device:
        raise ValueError(f"{name} is on {t.device} but {like[0]} is on {like[1].device}")


def check_eps(eps):
    """A finite non-negative number: a negative one makes rsqrt(var + eps) NaN."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
