"""What a benchmark case is, and the runner that measures every implementation of it."""

import dataclasses
import functools
import math
import sys
from typing import Callable, Optional

import torch

from .._backend import use_backend as remat_backend
from .timing import QUANTILES, Timer, quantiles


@dataclasses.dataclass
class Implementation:
    """One way to run a case.

    `build(inputs)` returns (fn, reset) or (fn, reset, forward): fn is timed, reset runs untimed
    before each call, and forward (when given) runs the forward pass alone, to measure the memory
    it leaves allocated for the backward. `backend`: remat's backend, in force for every call
    of fn and forward, backward included (remat's ops choose their backend when they run).
    """

    name: str
    ours: bool
    build: Callable
    backend: Optional[str] = None


@dataclasses.dataclass
class Case:
    op: str  # "layernorm", "gelu", ...
    mode: str  # "fwd", "fwd+bwd"
    dtype: torch.dtype
    shape: str  # for people: "M=32768 N=1024"
    size: int  # the x axis of the plots
    unit: str  # "GB/s" or "TFLOP/s"
    work: float  # bytes moved or FLOPs per call, by the op's explicit model
    make_inputs: Callable
    implementations: list
    sbh_per_layer: Optional[int] = None  # layers·s·b·h, to report saved bytes per layer in sbh units


@dataclasses.dataclass
class Result:
    case: Case
    implementation: str
    ours: bool
    p20_ms: float = math.nan
    p50_ms: float = math.nan
    p80_ms: float = math.nan
    peak_mb: Optional[float] = None
    retained_mb: Optional[float] = None
    error: str = ""

    @property
    def saved_sbh_per_layer(self):
        """What the forward keeps for the backward, per layer, in bytes per s·b·h."""
        if self.retained_mb is None or not self.case.sbh_per_layer:
            return None
        return self.retained_mb * 2**20 / self.case.sbh_per_layer

    @property
    def rate(self):
        """Effective GB/s or TFLOP/s at the median time."""
        scale = 1e9 if self.case.unit == "GB/s" else 1e12
        return self.case.work / (self.p50_ms * 1e-3) / scale


class CaseInterrupted(Exception):
    """Ctrl-C (SIGINT) during a case: carries the results of what was measured before it."""

    def __init__(self, results):
        super().__init__("interrupted")
        self.results = results


def measure_case(case, timer, rounds=3):
    """Results of every implementation of `case`, timed in interleaved rounds.

    Interleaving (A B C A B C ...) makes slow drift of the machine (clocks, temperature)
    fall on all implementations alike. A failure of one implementation (an error, out of
    memory) is recorded in its result and the others go on. Memory is measured after an
    implementation's first timing. Ctrl-C raises CaseInterrupted with the medians of the calls
    timed so far.
    """
    results = {impl.name: Result(case, impl.name, impl.ours) for impl in case.implementations}
    try:
        inputs = case.make_inputs()
    except Exception as error:
        for result in results.values():
            result.error = f"inputs: {short_error(error)}"
        return list(results.values())
    runnable = {}
    for impl in case.implementations:
        try:
            fn, reset, *forward = impl.build(inputs)
            in_backend = functools.partial(_in_backend, impl.backend)
            runnable[impl.name] = (in_backend(fn), reset, *[in_backend(f) for f in forward])
        except Exception as error:  # a peer that cannot run this case is reported, not fatal
            results[impl.name].error = short_error(error)
    samples = {name: [] for name in runnable}
    try:
        for round_index in range(rounds):
            for name, (fn, reset, *forward) in list(runnable.items()):
                try:
                    samples[name] += timer.times_ms(fn, reset)
                except Exception as error:
                    results[name].error = short_error(error)
                    del runnable[name]
                    continue
                if round_index == 0:  # right away: an interrupted run keeps the memory figures too
                    _measure_memory(results[name], timer, fn, reset, forward)
    except KeyboardInterrupt:
        _set_times(results, samples, runnable)
        raise CaseInterrupted(list(results.values())) from None
    _set_times(results, samples, runnable)
    return list(results.values())


def _in_backend(backend, fn):
    if backend is None:
        return fn

    def run():
        with remat_backend(backend):
            return fn()

    return run


def _set_times(results, samples, runnable):
    # Implementations whose timing failed were taken out of `runnable`: no figure for them.
    for name in runnable:
        if samples[name]:
            results[name].p20_ms, results[name].p50_ms, results[name].p80_ms = quantiles(samples[name])


def _measure_memory(result, timer, fn, reset, forward):
    try:
        peak = timer.peak_memory_bytes(fn, reset)
        result.peak_mb = None if peak is None else peak / 2**20
        if forward:
            retained = timer.retained_memory_bytes(forward[0], reset)
            result.retained_mb = None if retained is None else retained / 2**20
    except Exception as error:  # e.g. out of memory: the timings stand, the memory is unknown
        result.error = f"memory: {short_error(error)}"


def short_error(error, limit=160):
    """The exception's type and the first line of its message (CUDA's out-of-memory runs long)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:limit]


def best_peer_ratio(results):
    """For each result of ours: its rate over the best peer's rate in the same case."""
    timed = [r for r in results if not math.isnan(r.p50_ms)]  # a memory error leaves the timing valid
    peers = [r.rate for r in timed if not r.ours]
    best = max(peers) if peers else math.nan
    ratios = {r.implementation: math.nan for r in results}
    ratios.update({r.implementation: r.rate / best for r in timed if r.ours})
    return ratios


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total, enabled=True):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0

    def step(self, label):
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label[:60]:<60}")
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


__all__ = ["Case", "CaseInterrupted", "Implementation", "Result", "measure_case", "best_peer_ratio", "Progress", "QUANTILES", "Timer"]
