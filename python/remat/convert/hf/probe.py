"""The numerical check of a fusion at convert time: the stock forward and the one with the new modules
in place, called on the same small random input (eval mode, no grad, the caller's RNG untouched),
must agree, and each new module must have taken its remat path (recorded in its trace: a module that
fell back would agree with stock and hide the fusion not holding). A forward the check cannot call,
or one that disagrees, leaves the modules stock, with the reason (PROBE_BROKEN: convert warns)."""

import contextlib

import torch

from ..._numerics import rel_error
from .handoff import submodule


@contextlib.contextmanager
def training_mode(training, *modules):
    """Every submodule of `modules` in training mode `training` (False: eval mode, no dropout) for the
    duration, then as it was."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    for m, _ in flags:
        m.training = training
    try:
        yield
    finally:
        for m, was_training in flags:
            m.training = was_training


# The probe's reasons that mean a rule no longer matches the stock forward it was written for (a
# transformers release changed it): convert warns about these, not only the report.
PROBE_BROKEN = ("probe failed", "probe mismatch")


def failed(error):
    """The reason of a probe whose forward raised `error`."""
    return f"probe failed ({type(error).__name__}: {error})"


def mismatch(got, want, dtype, why):
    """None when `got` is `want` within the tolerance of `dtype` (the probe's weights'), else the reason,
    `why` after the relative error."""
    error = rel_error(got, want)
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if not error <= tolerance:
        return f"probe mismatch (relative error {error:.2g}): {why}"
    return None


def first_output(output):
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def tracing(modules):
    """Inside: each of `modules` records, per call, why it ran stock (None: its remat path ran)."""
    traces = []
    for module in modules:
        traces.append([])
        module.__dict__["remat_trace"] = traces[-1]
    try:
        yield traces
    finally:
        for module in modules:
            del module.__dict__["remat_trace"]


def _traced(before, after, traced, width, param, modules):
    """None when before(x) == after(x) on a small random x (or when it cannot run: on meta) and the
    calls of each of `traced` inside after(x) were one remat path, else why not."""
    if param.is_meta:
        return None  # nothing to run on: not probed
    generator = torch.Generator().manual_seed(0)  # private: the caller's RNG stream is untouched
    x = torch.randn(2, 3, width, generator=generator).to(param.device, param.dtype)
    try:
        with torch.no_grad(), training_mode(False, *modules):
            with tracing(traced):  # a consumer that stays in place (an experts module) sees the stock call too
                want = before(x)
            with tracing(traced) as traces:
                got = after(x)
    except Exception as error:  # noqa: BLE001 - a forward this rule does not know how to call: leave it alone
        return failed(error)
    reason = mismatch(got, want, param.dtype, "this transformers version's forward differs")
    for trace in traces if reason is None else ():
        if trace != [None]:
            return f"the probe call did not take the remat path ({trace[0] if trace else 'not called'})"
    return reason


def install(owner, modules):
    """Put `modules` ({dotted path below owner: module}) in their places; the ones they replace."""
    replaced = {}
    for path, module in modules.items():
        parent_path, _, name = path.rpartition(".")
        parent = submodule(owner, parent_path) if parent_path else owner
        replaced[path] = parent._modules[name]
        parent._modules[name] = module
    return replaced


def swap_probe(owner, swaps, width, param, traced, call):
    """None when call(owner, x) (the owner called as the structure probe called it) is unchanged with
    `swaps` ({dotted path: new module}) in place, and the remat path of each of `traced` (swapped
    modules) is what ran; else why not."""

    def after(x):
        originals = install(owner, swaps)
        try:
            return call(owner, x)
        finally:
            install(owner, originals)

    return _traced(lambda x: call(owner, x), after, traced, width, param, [owner, *swaps.values()])


def self_probe(module, new, width, param, extra):
    """Probe of a swapped module on its own, called with `extra` keyword arguments besides its input:
    its remat path against the stock forward."""
    return _traced(lambda x: first_output(module(x, **extra)), lambda x: first_output(new(x, **extra)),
                         [new], width, param, [module, new])
