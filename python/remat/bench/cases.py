"""What a benchmark case is, and the runner that measures every implementation of it."""

import dataclasses
import math
import sys
from typing import Callable, Optional

import torch

from .timing import QUANTILES, Timer, quantiles


@dataclasses.dataclass
class Implementation:
    """One way to run a case.

    `build(inputs)` returns (fn, reset) or (fn, reset, forward): fn is timed, reset runs untimed
    before each call, and forward (when given) runs the forward pass alone, to measure the memory
    it leaves allocated for the backward.
    """

    name: str
    ours: bool
    build: Callable


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


def measure_case(case, timer, rounds=3):
    """Results of every implementation of `case`, timed in interleaved rounds.

    Interleaving (A B C A B C ...) makes slow drift of the machine (clocks, temperature)
    fall on all implementations alike.
    """
    inputs = case.make_inputs()
    runnable, results = {}, {}
    for impl in case.implementations:
        results[impl.name] = Result(case, impl.name, impl.ours)
        try:
            runnable[impl.name] = impl.build(inputs)
        except Exception as error:  # a peer that cannot run this case is reported, not fatal
            results[impl.name].error = _short(error)
    samples = {name: [] for name in runnable}
    for _ in range(rounds):
        for name, (fn, reset, *_) in list(runnable.items()):
            try:
                samples[name] += timer.times_ms(fn, reset)
            except Exception as error:
                results[name].error = _short(error)
                del runnable[name]
    for name, (fn, reset, *forward) in runnable.items():
        result = results[name]
        result.p20_ms, result.p50_ms, result.p80_ms = quantiles(samples[name])
        peak = timer.peak_memory_bytes(fn, reset)
        result.peak_mb = None if peak is None else peak / 2**20
        if forward:
            retained = timer.retained_memory_bytes(forward[0], reset)
            result.retained_mb = None if retained is None else retained / 2**20
    return list(results.values())


def _short(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def best_peer_ratio(results):
    """For each result of ours: its rate over the best peer's rate in the same case."""
    ratios = {}
    peers = [r.rate for r in results if not r.ours and not r.error]
    best = max(peers) if peers else math.nan
    for result in results:
        ratios[result.implementation] = result.rate / best if result.ours and not result.error else math.nan
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


__all__ = ["Case", "Implementation", "Result", "measure_case", "best_peer_ratio", "Progress", "QUANTILES", "Timer"]
