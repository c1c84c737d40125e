"""The exact solver: one choice per unit, the least predicted time whose saved bytes fit a budget.

A multiple-choice knapsack over units. Each option of a unit costs its internal bytes and extra
time, and keeps a set of shared storages (keys) that cost their bytes once whoever keeps them. A
dynamic programme over units keeps every partial plan that no other dominates: another with a
subset of its kept keys, no more internal bytes and no more time. A key no later unit can keep is
paid for as soon as the last unit that can keep it is decided, so the kept sets stay small.

Under a peak budget (peak.py) a plan also pays its largest transient, the most of its options'
transient bytes (and at least a floor, the transient outside the units): not a sum, so the
knapsack runs once per cap on it, over the options within the cap, with the budget less the cap.
The plan with the cap at its own largest transient is among those, so the fastest is exact.
"""

import dataclasses
import itertools


@dataclasses.dataclass(frozen=True)
class Option:
    choice: str
    internal_bytes: int
    keys: frozenset
    seconds: float
    transient_bytes: int = 0  # what the unit's backward holds besides the kept bytes (peak.py)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A whole plan: its choice per unit, its bytes and its predicted extra seconds."""

    choices: tuple
    saved_bytes: int
    seconds: float


def _last_use(options, always_kept):
    last = {}
    for i, unit in enumerate(options):
        for option in unit:
            for key in option.keys - always_kept:
                last[key] = i
    return last


def frontier(options, base_bytes, always_kept, key_bytes):
    """Every plan on the bytes/time Pareto frontier, fewest bytes first. options: per unit, its
    Options; base_bytes: bytes kept whatever the plan; always_kept: keys kept whatever the plan."""
    last = _last_use(options, always_kept)
    # partial plans: (paid bytes, seconds, open keys, choices)
    partial = [(0, 0.0, frozenset(), ())]
    for i, unit in enumerate(options):
        grown = {}
        for paid, seconds, open_keys, choices in partial:
            for option in unit:
                keys = open_keys | (option.keys - always_kept)
                closed = {k for k in keys if last[k] <= i}
                state = (paid + option.internal_bytes + sum(key_bytes[k] for k in closed),
                         seconds + option.seconds, frozenset(keys - closed), choices + (option.choice,))
                grown.setdefault(state[2], []).append(state)
        partial = []
        for group in grown.values():
            group.sort(key=lambda s: (s[0], s[1]))
            best_seconds = float("inf")
            for state in group:  # within one open set: keep those faster than every smaller one
                if state[1] < best_seconds:
                    partial.append(state)
                    best_seconds = state[1]
    base = base_bytes + sum(key_bytes[k] for k in always_kept)
    plans = sorted((Candidate(c, base + paid, seconds) for paid, seconds, open_keys, c in partial
                    if not open_keys), key=lambda p: (p.saved_bytes, p.seconds))
    front, best_seconds = [], float("inf")
    for plan in plans:
        if plan.seconds < best_seconds:
            front.append(plan)
            best_seconds = plan.seconds
    return front


def fastest_fitting(front, budget):
    """The fastest plan of the frontier whose bytes fit the budget, or None."""
    fitting = [p for p in front if p.saved_bytes <= budget]
    return min(fitting, key=lambda p: (p.seconds, p.saved_bytes)) if fitting else None


def fastest_under_peak(options, base_bytes, always_kept, key_bytes, budget, floor):
    """(the fastest plan whose saved bytes plus largest transient, at least `floor`, fit `budget`,
    or None; the transient it was planned with; the least that sum can be at all)."""
    best, best_transient, least = None, None, None
    caps = sorted({floor} | {o.transient_bytes for unit in options for o in unit if o.transient_bytes > floor})
    for cap in caps:
        allowed = [[o for o in unit if o.transient_bytes <= cap] for unit in options]
        if not all(allowed):
            continue
        front = frontier(allowed, base_bytes, always_kept, key_bytes)
        least = front[0].saved_bytes + cap if least is None else min(least, front[0].saved_bytes + cap)
        fit = fastest_fitting(front, budget - cap)
        if fit is not None and (best is None or (fit.seconds, fit.saved_bytes + cap)
                                < (best.seconds, best.saved_bytes + best_transient)):
            best, best_transient = fit, cap
    return best, best_transient, least


def brute_force(options, base_bytes, always_kept, key_bytes, budget, floor=None):
    """The same answers by trying every plan (for the tests, on small cases); with a floor, the
    budget holds the saved bytes and the largest transient, as fastest_under_peak's."""
    best, best_size = None, None
    for combination in itertools.product(*options):
        keys = set(always_kept).union(*(o.keys for o in combination))
        saved = base_bytes + sum(o.internal_bytes for o in combination) + sum(key_bytes[k] for k in keys)
        size = saved if floor is None else saved + max(floor, *(o.transient_bytes for o in combination))
        seconds = sum(o.seconds for o in combination)
        if size <= budget and (best is None or (seconds, size) < (best.seconds, best_size)):
            best, best_size = Candidate(tuple(o.choice for o in combination), saved, seconds), size
    return best
