"""budget_kind="peak": the fixed part is the model's parameters, buffers, gradients and optimizer
state, counted here independently after a real optimizer step; every plan's predicted peak fits
its budget; the solver under a peak budget is exact against brute force."""

import random
import re

import pytest
import torch

import remat
from remat.planner import meta_copy
from remat.planner.peak import fixed_bytes
from remat.planner.solver import Option, brute_force, fastest_under_peak

from hf_models import build, inputs


def _on_meta(batch):
    return {k: torch.empty_like(v, device="meta") for k, v in batch.items()}


def _bytes_after_an_adam_step(model, batch):
    """What a real training step with torch.optim.Adam leaves on the device: every parameter and
    buffer storage (tied weights once), the gradients and Adam's per-element states (its `step`
    counters are host scalars: left out)."""
    optimizer = torch.optim.Adam(model.parameters())
    model(**batch).loss.backward()
    optimizer.step()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    states = sum(v.untyped_storage().nbytes() for p in model.parameters() for v in optimizer.state[p].values()
                 if v.shape == p.shape)
    return sum(storages.values()), grads, states


def _least_peak(model, batch, **kwargs):
    with pytest.raises(ValueError, match="below the least peak") as error:
        remat.plan(model, batch, 0, budget_kind="peak", **kwargs)
    return int(re.search(r"reach at these inputs: (\d+) bytes", str(error.value)).group(1))


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_the_fixed_part_is_what_a_real_adam_step_holds(family):
    model, _ = build(family)
    batch = inputs(family, "cpu")
    weights, grads, states = _bytes_after_an_adam_step(model, batch)
    assert grads == weights - sum(b.untyped_storage().nbytes() for b in model.buffers())  # every weight trains
    meta_model = meta_copy(model)
    plan = remat.plan(meta_model, _on_meta(batch), 10**9, budget_kind="peak", optimizer="adam")
    assert plan.fixed_bytes == weights + grads + states
    assert fixed_bytes(meta_model) == weights + grads  # no optimizer given: no state
    assert fixed_bytes(meta_model, optimizer=12) == weights + grads + 12 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("device", [None, "H200"])  # for a GPU, offloading is a choice too
@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_every_plan_under_a_peak_budget_fits_it(family, device):
    model, _ = build(family)
    model, batch = meta_copy(model), _on_meta(inputs(family, "cpu"))
    least = _least_peak(model, batch, optimizer="adamw", device=device)
    plans = [remat.plan(model, batch, budget, budget_kind="peak", optimizer="adamw", device=device)
             for budget in (least, least + 2000, least + 8000, 10**9)]
    assert len({tuple(p.choices) for p in plans}) >= 2
    for plan in plans:
        assert plan.saved_bytes + plan.fixed_bytes + plan.transient_bytes == plan.peak_bytes <= plan.budget
        assert plan.transient_bytes > 0 and plan.budget_kind == "peak"
        plan.apply(model)
        try:  # the kept part of the peak is counted exactly, as for a budget of saved bytes
            assert remat.planner.saved_bytes_of(model, batch) == plan.saved_bytes
        finally:
            remat.revert(model)
    assert plans[0].peak_bytes == least
    assert plans[-1].extra_seconds <= plans[0].extra_seconds
    assert "predicted peak" in str(plans[0]) and remat.Plan.from_json(plans[0].to_json()) == plans[0]


def test_a_peak_budget_below_the_least_names_it_and_the_fixed_part():
    model, _ = build("vit")
    model, batch = meta_copy(model), _on_meta(inputs("vit", "cpu"))
    fixed = fixed_bytes(model, "adam")
    with pytest.raises(ValueError, match=f"\\({fixed} of them parameters, buffers, gradients and optimizer state"):
        remat.plan(model, batch, fixed, budget_kind="peak", optimizer="adam")


def test_bad_optimizer_arguments_get_clear_errors():
    model, _ = build("vit")
    model, batch = meta_copy(model), _on_meta(inputs("vit", "cpu"))
    with pytest.raises(ValueError, match="optimizer must be None, one of sgd, momentum, adam, adamw"):
        remat.plan(model, batch, 10**9, budget_kind="peak", optimizer="lion")
    with pytest.raises(ValueError, match="optimizer must be"):
        remat.plan(model, batch, 10**9, budget_kind="peak", optimizer=-4)
    with pytest.raises(ValueError, match="optimizer counts towards a budget of the step's peak only"):
        remat.plan(model, batch, 10**9, optimizer="adam")


def _random_case(rng, units, choices):
    shared = [("s", i) for i in range(2)]
    key_bytes = {k: rng.randint(1, 50) for k in shared}
    options = []
    for u in range(units):
        key_bytes[("out", u)] = rng.randint(1, 50)
        options.append([Option(f"c{c}", rng.randint(0, 100),
                               frozenset(k for k in (*shared, ("out", u)) if rng.random() < 0.5),
                               rng.choice([0.0, 0.5, 1.0, rng.random()]), rng.randint(0, 80)) for c in range(choices)])
    return options, rng.randint(0, 20), frozenset(shared[:1]), key_bytes


def _peak(options, choices, base, always, key_bytes, floor):
    chosen = [next(o for o in unit if o.choice == c) for unit, c in zip(options, choices)]
    keys = set(always).union(*(o.keys for o in chosen))
    saved = base + sum(o.internal_bytes for o in chosen) + sum(key_bytes[k] for k in keys)
    return saved + max(floor, *(o.transient_bytes for o in chosen))


@pytest.mark.parametrize("seed", range(30))
def test_the_peak_solver_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    options, base, always, key_bytes = _random_case(rng, units=rng.randint(1, 4), choices=rng.randint(1, 4))
    floor = rng.randint(0, 60)
    _, _, least = fastest_under_peak(options, base, always, key_bytes, 0, floor)
    for budget in range(least - 5, least + 300, 11):
        best, transient, _ = fastest_under_peak(options, base, always, key_bytes, budget, floor)
        expected = brute_force(options, base, always, key_bytes, budget, floor)
        assert (best is None) == (expected is None) == (budget < least)
        if best is not None:
            peak = _peak(options, best.choices, base, always, key_bytes, floor)
            assert peak <= best.saved_bytes + transient <= budget
            assert (best.seconds, best.saved_bytes + transient) == (
                expected.seconds, _peak(options, expected.choices, base, always, key_bytes, floor))


def test_the_transient_holds_at_least_the_logits_gradient_twice():
    # GPT-2's largest op output is its fp32 logits (batch x seq x vocab): the peak model holds
    # twice that in the backward (the logits' gradient and its input's), whatever the plan
    from hf_models import BATCH, SEQ, VOCAB

    model, _ = build("gpt2")
    plan = remat.plan(meta_copy(model), _on_meta(inputs("gpt2", "cpu")), 10**9, budget_kind="peak")
    assert plan.transient_bytes >= 2 * BATCH * SEQ * VOCAB * 4
