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
