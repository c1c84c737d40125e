"""What a benchmark case is, and the runner that measures every implementation of it."""

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Optional

import torch

from .. import _backend
from .._backend import use_backend as remat_backend
from ..saved import count_saved_bytes
from .check import Check, compare, outputs_and_grads
from .timing import QUANTILES, Timer, quantiles


@dataclasses.dataclass
class Implementation:
    """One way to run a case.

    `build(inputs)` returns a Built. `backend`: remat's backend, in force for everything the
    Built runs, backward included (remat's ops choose their backend when they run). `compiles`:
    built with torch.compile, so compiled on its first call (bench/warm_compile_cache.py
    compiles these ahead of a GPU run). `deterministic`: torch.use_deterministic_algorithms(True)
    in force likewise (the CUDA attention backward then runs its dQ kernel instead of atomics).
    """

    name: str
    ours: bool
    build: Callable
    backend: str | None = None
    compiles: bool = False
    deterministic: bool = False


@dataclasses.dataclass
class Built:
    """An implementation built on a case's inputs.

    step: the timed call. reset: runs untimed before each call. forward: the forward pass alone
    (a Forward), to measure what it keeps for the backward. outputs(): runs the implementation
    once, forward and backward, and returns its results by name (check.outputs_and_grads), for
    the case's Check.
    """

    step: Callable
    reset: Callable | None = None
    forward: Optional["Forward"] = None
    outputs: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Variant:
    """One implementation of an op before it is wrapped for a case: `fn` is what the suite's
    wrappers take (a function of the case's tensors, or a module builder)."""

    name: str
    ours: bool
    fn: Callable
    backend: str | None = None
    compiles: bool = False
    deterministic: bool = False

    def implementation(self, wrap):
        """The Implementation whose build is wrap(fn)."""
        return Implementation(self.name, self.ours, wrap(self.fn), self.backend, self.compiles, self.deterministic)


def ours_by_backend(device):
    """(name, backend) of each remat implementation to measure on `device`: on a GPU one per
    compiled backend this install has (the Triton kernels', the CUDA extension's), each in its rows."""
    if device.type != "cuda":
        return [(f"remat-{_backend.choose('bench', device)}", "auto")]
    return [(f"remat-{backend}", backend) for backend in ("triton", "cuda") if _backend.backends()[backend][0]]


@dataclasses.dataclass
class Forward:
    """An implementation's forward pass alone, module(x).

    On a GPU the timer reads what it leaves allocated; on any device remat.saved.count_saved_bytes
    counts what it saves for the backward, exactly: each storage once, leaving out the module's
    parameters, its input and its output (the caller holds those anyway).
    """

    module: torch.nn.Module
    x: torch.Tensor

    def __call__(self):
        return self.module(self.x)


class OpModule(torch.nn.Module):
    """A call of an op on tensors as a module, for Forward: `call()` is its forward, and the
    tensors it is given (the input, weights, keys, values) are held as its parameters, so the
    saved-bytes count leaves them out: the caller holds them anyway."""

    def __init__(self, call, *held):
        super().__init__()
        self.call = call
        self.held = torch.nn.ParameterList(
            torch.nn.Parameter(t, requires_grad=t.requires_grad) for t in held if t is not None)

    def forward(self, x):
        return self.call()


def op_built(mode, forward, leaves, dy):
    """The Built of an op, `forward()`, on the named tensors `leaves` (the first is its input x).

    mode "fwd" times the forward; "bwd" the backward alone (the forward runs untimed in reset);
    "fwd+bwd" both. The check's outputs are the op's output and the leaves' gradients.
    """
    saved = {}

    def reset():
        for leaf in leaves.values():
            leaf.grad = None
        if mode == "bwd":
            saved["out"] = forward()

    steps = {"fwd": forward, "bwd": lambda: saved["out"].backward(dy), "fwd+bwd": lambda: forward().backward(dy)}
    return Built(steps[mode], reset, Forward(OpModule(forward, *leaves.values()), next(iter(leaves.values()))),
                 lambda: outputs_and_grads(forward, leaves, dy))


def module_built(module, params, stock, x, dy):
    """The Built of a training step of `module` on x (forward, then backward of dy).

    Its check outputs are the output and the gradients of x and of `params`: the weights it
    trains, in the order of the `stock` module's parameters and named as those, so that every
    implementation's are compared with the reference's (fused layers hold copies of the weights).
    """
    leaves = {"x": x, **dict(zip([name for name, _ in stock.named_parameters()], params, strict=True))}

    def reset():
        for leaf in leaves.values():
            leaf.grad = None

    return Built(lambda: module(x).backward(dy), reset, Forward(module, x),
                 lambda: outputs_and_grads(lambda: module(x), leaves, dy))


def check_against(build, reference=None):
    """The Check that holds a case's implementations to the outputs of `build` (PyTorch's own
    implementation, built as theirs are), with its float64 reference (by default `build` on
    float64 copies of the inputs)."""
    return Check(lambda inputs: build(inputs).outputs(), reference)


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
    sbh_per_layer: int | None = None  # layers·s·b·h, to report saved bytes per layer in sbh units
    check: Check | None = None  # what every implementation's outputs are compared with before timing


@dataclasses.dataclass
class Result:
    case: Case
    implementation: str
    ours: bool
    p20_ms: float = math.nan
    p50_ms: float = math.nan
    p80_ms: float = math.nan
    peak_mb: float | None = None
    saved_bytes: int | None = None  # what the forward keeps for the backward (see Forward)
    check: str = ""  # "ok (1.02x)", "wrong", "unchecked"; "" when the case has no Check
    error: str = ""

    @property
    def saved_sbh_per_layer(self):
        """What the forward keeps for the backward, per layer, in bytes per s·b·h."""
        if self.saved_bytes is None or not self.case.sbh_per_layer:
            return None
        return self.saved_bytes / self.case.sbh_per_layer

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
    """Results of every implementation of `case`, checked, then timed in interleaved rounds.

    First each implementation's outputs are compared with the case's Check, when it has one:
    one whose output is wrong is not timed, and its result says what is wrong. Interleaving
    (A B C A B C ...) makes slow drift of the machine (clocks, temperature) fall on all
    implementations alike. A failure of one implementation (an error, out of memory) is
    recorded in its result and the others go on. Memory is measured after an implementation's
    first timing. Ctrl-C raises CaseInterrupted with the medians of the calls timed so far.
    """
    results, inputs, runnable = _built(case)
    samples = {name: [] for name in runnable}
    try:
        if case.check is not None and runnable:
            _check(case.check, inputs, runnable, results)
        for round_index in range(rounds):
            for name, run in list(runnable.items()):
                try:
                    samples[name] += timer.times_ms(run.step, run.reset)
                except Exception as error:
                    results[name].error = short_error(error)
                    del runnable[name]
                    continue
                if round_index == 0:  # right away: an interrupted run keeps the memory figures too
                    _measure_memory(results[name], timer, run)
    except KeyboardInterrupt:
        _set_times(results, samples, runnable)
        raise CaseInterrupted(list(results.values())) from None
    _set_times(results, samples, runnable)
    return list(results.values())


def check_case(case):
    """Results of the case's Check alone, nothing timed: the smoke test before a benchmark."""
    results, inputs, runnable = _built(case)
    if runnable and case.check is not None:
        _check(case.check, inputs, runnable, results)
    return list(results.values())


def _built(case):
    """({name: Result}, the case's inputs, {name: _Runnable}) with every implementation built
    on the inputs; a failure to make the inputs or to build is in the results."""
    results = {impl.name: Result(case, impl.name, impl.ours) for impl in case.implementations}
    try:
        inputs = case.make_inputs()
    except Exception as error:
        for result in results.values():
            result.error = f"inputs: {short_error(error)}"
        return results, None, {}
    runnable = {}
    for impl in case.implementations:
        try:
            runnable[impl.name] = _Runnable(impl.backend, impl.deterministic, impl.build(inputs))
        except Exception as error:  # a peer that cannot run this case is reported, not fatal
            results[impl.name].error = short_error(error)
    return results, inputs, runnable


class _Runnable:
    """A Built whose every call runs in remat's backend `backend` (None: leave it as it is) and,
    when `deterministic`, under torch.use_deterministic_algorithms(True)."""

    def __init__(self, backend, deterministic, built):
        self.backend, self.deterministic = backend, deterministic
        self.built, self.reset, self.forward = built, built.reset, built.forward
        self.step = self.in_backend(built.step)

    def in_backend(self, fn):
        if self.backend is None and not self.deterministic:
            return fn

        def run():
            with contextlib.ExitStack() as settings:
                if self.backend is not None:
                    settings.enter_context(remat_backend(self.backend))
                if self.deterministic:
                    settings.enter_context(deterministic_algorithms())
                return fn()

        return run


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside (warn_only: an op without a deterministic
    kernel, such as a reference's cuBLAS product, warns instead of failing), the setting before
    restored. Under it the CUDA attention kernels' backward runs its dQ kernel, bitwise
    reproducible, instead of adding dQ by atomics in one pass."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _check(check, inputs, runnable, results):
    """Compares each implementation's outputs with the reference; takes out of `runnable` those
    that are wrong or fail to run."""
    try:
        reference, pytorch = check.expected(inputs)
    except Exception as error:  # e.g. the float64 reference does not fit: timed, marked unchecked
        for name in runnable:
            results[name].check, results[name].error = "unchecked", f"reference: {short_error(error)}"
        return
    for name, run in list(runnable.items()):
        if run.built.outputs is None:
            results[name].check = "unchecked"
            continue
        try:
            verdict = compare(run.in_backend(run.built.outputs)(), reference, pytorch)
        except Exception as error:
            results[name].error = short_error(error)
            del runnable[name]
            continue
        results[name].check = verdict.text if verdict.ok else "wrong"
        if not verdict.ok:
            results[name].error = verdict.text
            del runnable[name]


def _set_times(results, samples, runnable):
    # Implementations whose timing failed were taken out of `runnable`: no figure for them.
    for name in runnable:
        if samples[name]:
            results[name].p20_ms, results[name].p50_ms, results[name].p80_ms = quantiles(samples[name])


def _measure_memory(result, timer, run):
    try:
        peak = timer.peak_memory_bytes(run.step, run.reset)
        result.peak_mb = None if peak is None else peak / 2**20
        if run.forward is not None:
            retained = timer.retained_memory_bytes(run.in_backend(run.forward), run.reset)
            if retained is None:  # no allocator to read (CPU): counted exactly instead
                retained = run.in_backend(lambda: saved_bytes(run.forward))()
            result.saved_bytes = retained
    except Exception as error:  # e.g. out of memory: the timings stand, the memory is unknown
        result.error = f"memory: {short_error(error)}"


def saved_bytes(forward):
    """Exact bytes a Forward keeps for the backward (remat.saved.count_saved_bytes on its module)."""

    return count_saved_bytes(forward.module, forward.x, offload=False)[0]


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


__all__ = ["Built", "Case", "CaseInterrupted", "Check", "Forward", "Implementation", "Result", "Variant",
           "measure_case", "check_against", "check_case", "module_built", "op_built", "best_peer_ratio", "Progress",
           "QUANTILES", "Timer"]
