"""remat.plan: a budget of bytes kept for the backward in, the fastest mix of choices per block out.

    plan = remat.plan(model, example_inputs, budget=8 * 2**30)
    print(plan)              # per unit: choice, saved bytes, predicted extra time; totals
    plan.apply(model)        # in place; remat.revert(model) undoes it
    plan.saved_bytes         # exactly what the applied model keeps at example_inputs' shapes

The model's repeated blocks are the units (units.py). Each choice's saved bytes per unit are
counted exactly, once per choice for all units at once (counting.py), on the device of the example
inputs: pass meta tensors (and a model on meta) to count at any size without memory. The time of
each choice comes from a cost model (cost.py) and the exact solver (solver.py) picks the fastest
plan that fits. On a GPU (or planning for one from meta tensors, device="H200"), offloading a
block's saved tensors to pinned host memory is a choice too (offload.py). budget_kind="peak"
makes the budget a whole training step's peak on the device: parameters, gradients, optimizer
state, the bytes kept and the backward's largest transient (a model: peak.py).

A causal LM's LM head and loss are a choice too, when remat.convert fuses them
(convert/hf/loss.py) and the example is a training call with labels: "stock" (logits and
transformers' loss) or "fused" (remat.linear_cross_entropy). Their bytes are what the forward keeps
from the last unit's return on (the final norm, the head and the loss), counted as the units' are;
the fused one's extra time is the logits its backward recomputes (cost.py). Otherwise (no labels,
not such a model) they are no choice: plan.head is None, they stay stock and count among the bytes
kept outside the units.
"""

import copy
import dataclasses
import json

import torch
import torch.utils._pytree as pytree

from ..convert import revert
from .calibrate import measured_choices, model_signature
from .cost import DEVICES, device_constants, extra_seconds, fused_loss_seconds
from .counting import count_forward, saved_bytes_of, split_inputs
from .peak import OPTIMIZER_STATES, fixed_bytes, transient_bytes
from .solver import Option, fastest_fitting, fastest_under_peak, frontier
from .units import (
    CHOICES,
    HEAD_CHOICES,
    ON_ANY_DEVICE,
    REMAT_CHOICES,
    apply_choices,
    find_units,
    fused_head,
    is_planned,
    run_remat_experts,
)

__all__ = ["CHOICES", "DEVICES", "HEAD_CHOICES", "OPTIMIZER_STATES", "Plan", "fixed_bytes", "meta_copy",
           "offers_offload", "plan", "saved_bytes_of"]


@dataclasses.dataclass
class Plan:
    """One choice per unit (by its dotted path), and for a causal LM one for its LM head and loss,
    with the predicted bytes and extra time."""

    units: list
    choices: list
    unit_bytes: list  # bytes kept that each unit adds, in order (shared storages to the first keeper)
    unit_seconds: list  # predicted extra step time of each unit's choice
    base_bytes: int  # kept outside the units (embeddings; the head and loss too when they are no choice)
    budget: int
    device: str
    budget_kind: str = "saved"
    fixed_bytes: int = 0  # "peak": parameters, buffers, gradients and optimizer state
    transient_bytes: int = 0  # "peak": the backward's largest transient, as peak.py models it
    host_bytes: int = 0  # the offloaded units' saved tensors, in pinned host memory
    measured: bool = False  # the extra times are remat.calibrate's measurements of this model, not the cost model's
    head: str = None  # the LM head and loss: one of HEAD_CHOICES, or None where they are no choice (stock)
    head_bytes: int = 0  # what the head's choice keeps: from the last unit's return on (final norm, head, loss)
    head_seconds: float = 0.0  # the predicted extra step time of the head's choice (the cost model's)

    @property
    def saved_bytes(self):
        """Bytes the applied model keeps for the backward at the example inputs' shapes."""
        return self.base_bytes + self.head_bytes + sum(self.unit_bytes)

    @property
    def peak_bytes(self):
        """The predicted peak of a training step (budget_kind "peak"; peak.py's model)."""
        return self.fixed_bytes + self.saved_bytes + self.transient_bytes

    @property
    def extra_seconds(self):
        return sum(self.unit_seconds) + self.head_seconds

    def __str__(self):
        lines = [f"{'unit':40s} {'choice':10s} {'saved bytes':>14s} {'extra ms':>9s}"]
        lines += [f"{u:40s} {c:10s} {b:14d} {s * 1e3:9.3f}"
                  for u, c, b, s in zip(self.units, self.choices, self.unit_bytes, self.unit_seconds)]
        if self.head is not None:
            lines.append(f"{'(LM head + loss)':40s} {self.head:10s} {self.head_bytes:14d} "
                         f"{self.head_seconds * 1e3:9.3f}")
        lines.append(f"{'(outside the units)':40s} {'':10s} {self.base_bytes:14d}")
        lines.append(f"{'total':40s} {'':10s} {self.saved_bytes:14d} {self.extra_seconds * 1e3:9.3f}")
        if self.host_bytes:
            lines.append(f"{'(offloaded to host memory)':40s} {'':10s} {self.host_bytes:14d}")
        if self.budget_kind == "peak":
            lines.append(f"{'+ parameters, gradients, optimizer state':40s} {'':10s} {self.fixed_bytes:14d}")
            lines.append(f"{'+ largest backward transient (a model)':40s} {'':10s} {self.transient_bytes:14d}")
            lines.append(f"{'predicted peak':40s} {'':10s} {self.peak_bytes:14d}")
        kind = "bytes of the step's peak" if self.budget_kind == "peak" else "bytes kept for the backward"
        how = "measured on" if self.measured else "predicted for"
        lines.append(f"budget {self.budget} {kind}; times {how} {self.device}")
        return "\n".join(lines)

    def apply(self, model):
        """Apply the plan to `model` in place (a model like the one planned, not converted yet);
        returns it. remat.revert(model) undoes it."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if is_planned(model):
            raise ValueError("model is converted or planned already: remat.revert(model) first")
        if find_units(model) != self.units:
            raise ValueError(f"model's units {find_units(model)} are not the plan's {self.units}")
        apply_choices(model, self.units, self.choices, self.head)
        if self.head == "fused" and fused_head(model) is None:  # its probe failed on this model's weights
            revert(model)
            raise ValueError("the plan fuses the LM head and loss, but remat.convert keeps this model's stock "
                             "(remat.convert(model, report=True) says why)")
        return model

    def to_json(self):
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text):
        fields = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if not isinstance(fields, dict) or not required <= set(fields) <= names:
            raise ValueError(f"text is not a remat plan: it needs the fields {sorted(required)}, "
                             f"and may have {sorted(names - required)}")
        unknown = set(fields["choices"]) - set(CHOICES)
        if unknown or len(fields["choices"]) != len(fields["units"]):
            raise ValueError(f"text is not a remat plan: one choice of {CHOICES} per unit needed")
        if fields.get("head") not in (None, *HEAD_CHOICES):
            raise ValueError(f"text is not a remat plan: its head must be one of {HEAD_CHOICES} or null, "
                             f"got {fields['head']!r}")
        return cls(**fields)


def meta_copy(model):
    """A copy of `model` on the meta device, its weights not copied: to count at any size."""
    return _shell(model, on_meta=True)


def _shell(model, on_meta):
    """A copy of the model's modules for measuring: on meta, with meta parameters and buffers;
    otherwise sharing the model's own (nothing is copied but the module objects)."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = (torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                       if on_meta else p)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta") if on_meta else b
    return copy.deepcopy(model, memo)


def _on_meta(model, args, kwargs):
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return any(t.is_meta for t in tensors) or any(p.is_meta for p in model.parameters())


def _to_meta(tree):
    return pytree.tree_map(lambda t: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                           if isinstance(t, torch.Tensor) else t, tree)


def measure(model, example_inputs, choices=ON_ANY_DEVICE):
    """{choice: ForwardSaves of the model with every unit under that choice}, for each of
    `choices`; the unit paths; and, when "remat" is among them, whether remat.convert changes each
    unit (the others get no "remat" choice). "remat-keep" is measured only for a model whose experts
    remat.experts computes (elsewhere it is "remat")."""
    args, kwargs = split_inputs(example_inputs)
    on_meta = _on_meta(model, args, kwargs)
    if on_meta:
        args, kwargs = _to_meta((args, kwargs))
    paths = find_units(model)
    saves, fusable = {}, None
    for choice in choices:
        shell = _shell(model, on_meta).train(model.training)
        units = apply_choices(shell, paths, [choice] * len(paths))
        if choice == "remat-keep" and not run_remat_experts(units):
            continue
        if choice == "remat":
            fusable = [is_planned(u) for u in units]
        saves[choice] = count_forward(shell, args, kwargs, units)
        if choice == "offload":
            for unit, unit_saves in zip(units, saves[choice].units):
                unit_saves.offloaded_bytes = unit.remat_offload.host_bytes
    return saves, paths, fusable


def measure_fused_head(model, example_inputs, paths):
    """(the saves of the model with every unit stock and its LM head and loss fused, the head's
    (tokens, hidden, vocab)); None where the head is no choice: an example without labels or a
    model not training (the fused path runs for training calls with labels only), or a model whose
    head remat.convert does not fuse (not a causal LM of convert/hf/loss.py, or its probe failed)."""
    args, kwargs = split_inputs(example_inputs)
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor) or not model.training:
        return None
    on_meta = _on_meta(model, args, kwargs)
    if on_meta:
        args, kwargs = _to_meta((args, kwargs))
    shell = _shell(model, on_meta).train()
    units = apply_choices(shell, paths, ["stock"] * len(paths), head="fused")
    fused = fused_head(shell)
    if fused is None:
        return None
    vocab, hidden = fused.get_output_embeddings().weight.shape
    return count_forward(shell, args, kwargs, units), (labels.numel(), hidden, vocab)


def offers_offload(constants, example_inputs):
    """Offloading is a choice for a GPU: constants with a host link, and example inputs on a GPU or
    on meta (planning for the GPU of `constants`). Plans for CPU tensors never offload."""
    args, kwargs = split_inputs(example_inputs)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return constants.host_bytes_per_s is not None and all(t.device.type in ("cuda", "meta") for t in tensors)


def _check_budget(budget, budget_kind, optimizer):
    if budget_kind not in ("saved", "peak"):
        raise ValueError(f"budget_kind must be \"saved\" (bytes kept for the backward) or \"peak\" (a training "
                         f"step's peak), got {budget_kind!r}")
    if budget_kind == "saved" and optimizer is not None:
        raise ValueError("optimizer counts towards a budget of the step's peak only: pass budget_kind=\"peak\"")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int number of bytes, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be a number of bytes >= 0, got {budget}")


def plan(model, example_inputs, budget, budget_kind="saved", device=None, optimizer=None):
    """The fastest plan for `model` whose saved bytes at `example_inputs` fit `budget`.

    example_inputs: a tuple of positional arguments or a dict of keyword arguments (their shapes
    matter, not their values). budget: bytes kept for the backward, parameters left out; with
    budget_kind="peak", bytes of a whole training step's peak (peak.py: parameters, buffers,
    gradients, `optimizer`'s state, the bytes kept and the backward's largest transient).
    optimizer (peak only): None, one of OPTIMIZER_STATES ("adam": two states per parameter element
    in its dtype, as torch.optim keeps them) or an int of bytes per parameter element.
    device: whose constants time the choices: one of DEVICES, or a torch device (default: the
    example inputs' device; meta and cpu plan with the "cpu" figures). "offload" is a choice when
    the device is a GPU and the example inputs are on it or on meta (offers_offload), never for
    CPU tensors. Where remat.calibrate(model, example_inputs) timed this model's choices on that
    GPU, those times replace the cost model's (Plan.measured). A causal LM whose head and loss
    remat.convert fuses, given `labels` in a dict example and in training mode, also gets its head
    and loss as a choice (Plan.head: "stock" or "fused"); otherwise they stay stock (Plan.head
    None). A ValueError naming the smallest achievable bytes if the budget is below them.
    """
    _check_budget(budget, budget_kind, optimizer)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_planned(model):
        raise ValueError("model is converted or planned already: plan the stock model")
    args, kwargs = split_inputs(example_inputs)
    if device is None:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else "cpu"
    constants = device_constants(device)
    measured = measured_choices(constants.name, model_signature(model, example_inputs))
    fixed = fixed_bytes(model, optimizer) if budget_kind == "peak" else 0
    choices = CHOICES if offers_offload(constants, example_inputs) else ON_ANY_DEVICE
    saves, paths, fusable = measure(model, example_inputs, choices)
    outside = _same_outside(saves)
    key_bytes = {k: b for s in saves.values() for k, b in s.key_bytes.items()}
    options = [_unit_options(saves, i, fusable[i], constants, measured) for i in range(len(paths))]
    head_options = _head_options(saves["stock"], measure_fused_head(model, example_inputs, paths), constants)
    if head_options:  # the head is a choice: the solver's last "unit", holding what is kept after the units
        always, _ = _split_at_head(saves["stock"])
        solved, floor = [*options, head_options], min(o.transient_bytes for o in head_options)
    else:
        always, floor = frozenset(outside.shared_keys), 2 * outside.work.largest_output
        solved = options
    if budget_kind == "saved":
        front = frontier(solved, outside.internal_bytes, always, key_bytes)
        best, transient, least = fastest_fitting(front, budget), 0, front[0].saved_bytes
    else:
        best, transient, least = fastest_under_peak(solved, outside.internal_bytes, always, key_bytes,
                                                    budget - fixed, floor=floor)
    if best is None:
        if budget_kind == "saved":
            raise ValueError(f"budget {budget} bytes is below the least this model can keep at these inputs: "
                             f"{least} bytes")
        raise ValueError(f"budget {budget} bytes is below the least peak this model can reach at these inputs: "
                         f"{least + fixed} bytes ({fixed} of them parameters, buffers, gradients and optimizer state)")
    result = _plan_of(best, options, head_options, paths, outside.internal_bytes, always, key_bytes, budget,
                      constants.name)
    host = sum(saves["offload"].units[i].offloaded_bytes for i, c in enumerate(result.choices) if c == "offload")
    return dataclasses.replace(result, budget_kind=budget_kind, fixed_bytes=fixed, transient_bytes=transient,
                               host_bytes=host, measured=measured is not None)


def _unit_options(saves, i, fusable, constants, measured=None):
    """The Options of unit i: each choice's bytes, kept shared storages, extra time (measured by
    remat.calibrate where it timed the choice for this model, else the cost model's) and transient."""
    stock = saves["stock"].units[i]
    measured = measured or {}
    return [Option(c, saves[c].units[i].internal_bytes, frozenset(saves[c].units[i].shared_keys),
                   measured[c] if c in measured else extra_seconds(c, stock, saves[c].units[i], constants),
                   transient_bytes(c, stock, saves[c].units[i]))
            for c in CHOICES if c in saves and (c not in REMAT_CHOICES or fusable)]


def _same_outside(saves):
    """What is kept outside the units, the same under every choice (else the plan cannot add up)."""
    first = saves["stock"].outside
    for choice, s in saves.items():
        if (s.outside.internal_bytes, s.outside.shared_keys) != (first.internal_bytes, first.shared_keys):
            raise RuntimeError(f"the model keeps other bytes outside its units under {choice!r}: "
                               "its saved bytes do not add up over units")
    return first


def _split_at_head(saves):
    """(the keys of what is kept outside the units that was made before the last unit returned, the
    bytes kept that were made after it: the final norm's, the LM head's and the loss's). No unit can
    keep what is made after them all, so those bytes are the head's alone."""
    before, after = set(), 0
    for key in saves.outside.shared_keys:
        if key[0] == "outside" and key[1] >= saves.after_units:
            after += saves.key_bytes[key]
        else:
            before.add(key)
    return frozenset(before), after


def _head_options(stock, fused, constants):
    """The Options of the LM head and loss, from the saves of the all-stock forward (the head stock)
    and measure_fused_head's (None: no choice, no options); their bytes are what is kept after the
    units, their transient twice the largest op output outside the units (peak.py)."""
    if fused is None:
        return []
    fused, dims = fused
    before, stock_bytes = _split_at_head(stock)
    fused_before, fused_bytes = _split_at_head(fused)
    if _run_independent(stock, before) != _run_independent(fused, fused_before):
        raise RuntimeError("the model keeps other bytes in or before its units when its LM head and loss are fused: "
                           "its saved bytes do not add up over units and head")
    return [Option("stock", stock_bytes, frozenset(), 0.0, 2 * stock.outside.work.largest_output),
            Option("fused", fused_bytes, frozenset(), fused_loss_seconds(*dims, constants),
                   2 * fused.outside.work.largest_output)]


def _run_independent(saves, before_head):
    """What the units and the outside before the head keep, by the keys that name the same storage in
    every run (not the "unseen" ones, named by a run's own storage): equal whatever the head."""
    units = [(u.internal_bytes, {k for k in u.shared_keys if k[0] != "unseen"}) for u in saves.units]
    return units, {k for k in before_head if k[0] != "unseen"}


def _plan_of(best, options, head_options, paths, outside_bytes, always, key_bytes, budget, device_name):
    """The Plan of the solver's best Candidate: per unit, its bytes (the shared storages it keeps
    first) and time, in order; then the head's choice, last among the Candidate's, if it had one."""
    kept = set(always)
    unit_bytes, unit_seconds = [], []
    for unit_options, choice in zip(options, best.choices):
        option = next(o for o in unit_options if o.choice == choice)
        new_keys = option.keys - kept
        kept |= new_keys
        unit_bytes.append(option.internal_bytes + sum(key_bytes[k] for k in new_keys))
        unit_seconds.append(option.seconds)
    base = outside_bytes + sum(key_bytes[k] for k in always)
    result = Plan(paths, list(best.choices[:len(paths)]), unit_bytes, unit_seconds, base, budget, device_name)
    if head_options:
        head = next(o for o in head_options if o.choice == best.choices[-1])
        result = dataclasses.replace(result, head=head.choice, head_bytes=head.internal_bytes,
                                     head_seconds=head.seconds)
    assert result.saved_bytes == best.saved_bytes  # the solver's total and the table's agree
    return result
