"""Timing and peak memory of one implementation on one case.

On a GPU: CUDA events around each call, the L2 cache flushed before each call (so a case that
fits in L2 is not flattered by the previous call), warm-up calls excluded, quantiles over all
calls. On CPU: wall-clock time of each call; a functional run, not a performance figure.
"""

import statistics
import time

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2 (H200: 50 MB)
QUANTILES = (0.2, 0.5, 0.8)


class Timer:
    """Times zero-argument callables on one device; `reset` runs before each call, untimed."""

    def __init__(self, device, warmup=3, reps=20):
        self.device = torch.device(device)
        self.warmup = warmup
        self.reps = reps
        self._flush = (
            torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=self.device)
            if self.device.type == "cuda" else None
        )

    def times_ms(self, fn, reset=None):
        """Milliseconds of each of `reps` calls after `warmup` untimed ones."""
        for _ in range(self.warmup):
            if reset:
                reset()
            fn()
        if self.device.type == "cuda":
            return self._cuda_times(fn, reset)
        return self._cpu_times(fn, reset)

    def _cuda_times(self, fn, reset):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            if reset:
                reset()
            self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) for start, end in zip(starts, ends)]

    def _cpu_times(self, fn, reset):
        times = []
        for _ in range(self.reps):
            if reset:
                reset()
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
        return times

    def peak_memory_bytes(self, fn, reset=None):
        """Peak device memory allocated during one call, above what was allocated before it."""
        if self.device.type != "cuda":
            return None
        if reset:
            reset()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def retained_memory_bytes(self, forward, reset=None):
        """Device memory a forward pass leaves allocated besides its output: what autograd saved."""
        if self.device.type != "cuda":
            return None
        if reset:
            reset()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        output = forward()
        torch.cuda.synchronize(self.device)
        retained = torch.cuda.memory_allocated(self.device) - before - output.untyped_storage().nbytes()
        del output
        return retained


def quantiles(times_ms):
    """(p20, p50, p80) of the samples."""
    if len(times_ms) == 1:
        return (times_ms[0],) * 3
    cuts = statistics.quantiles(times_ms, n=10, method="inclusive")
    return cuts[1], statistics.median(times_ms), cuts[7]

