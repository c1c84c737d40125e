"""The correctness check a benchmark case runs before it times anything.

Every implementation of a case is run once on the case's inputs, forward and backward, and each
of its outputs (the forward's output and every gradient) is compared with a float64 reference
computed from the same inputs. The bound is the house rule: an error at most twice PyTorch's own
in the same dtype, both measured against that reference. An implementation that fails is not
timed; its row says why.
"""

import copy
import dataclasses
from collections.abc import Callable

import torch

from .._numerics import rel_error

# The floor under "at most twice PyTorch's own error". In fp32 both errors are ~1e-7, rounding
# noise of the summation order, where a factor of 2 means nothing; in fp16 and bf16 every output
# is rounded to the dtype (relative error >= ~1e-4), so the floor changes nothing there and only
# keeps an output that both compute exactly (error 0) from failing on a 1e-9.
ERROR_FLOOR = 1e-6


@dataclasses.dataclass
class Check:
    """What a case's implementations are held to.

    pytorch(inputs) -> {name: tensor}: PyTorch's own outputs in the case's dtype, named as each
    Implementation's outputs(inputs) names them. reference(inputs): the same in float64; by
    default pytorch() on float64 copies of the inputs.
    """

    pytorch: Callable
    reference: Callable | None = None

    def expected(self, inputs):
        """(float64 reference, PyTorch's own) outputs for `inputs`.

        Kept for the last inputs seen: cases that share their inputs (attention's forward,
        backward and forward + backward) compute the reference once.
        """
        if _LAST.get("check") is self and _LAST.get("inputs") is inputs:
            return _LAST["expected"]
        _LAST.clear()  # one reference alive at a time: they can take gigabytes
        reference = self.reference(inputs) if self.reference else self.pytorch(float64_copy(inputs))
        expected = ({name: t.double() for name, t in reference.items()}, self.pytorch(inputs))
        _LAST.update(check=self, inputs=inputs, expected=expected)
        return expected


_LAST = {}  # the check, inputs and expected outputs computed last (see Check.expected)


def float64_copy(inputs):
    """The case's inputs in float64: tensors copied (requires_grad kept), modules deep-copied."""
    def convert(item):
        if isinstance(item, torch.Tensor):
            return item.detach().double().requires_grad_(item.requires_grad)
        if isinstance(item, torch.nn.Module):
            return copy.deepcopy(item).double()
        return item

    return tuple(convert(item) for item in inputs)


def randomize_norms(module):
    """LayerNorm and RMSNorm weights and biases away from their init (1 and 0), so that the check sees
    a wrong use of them; `module` is returned."""
    with torch.no_grad():
        for norm in (m for m in module.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))):
            norm.weight.normal_(1.0, 0.1)
            if getattr(norm, "bias", None) is not None:
                norm.bias.normal_(0.0, 0.1)
    return module


def outputs_and_grads(forward, leaves, dy):
    """{"out": forward()} and {"d" + name: gradient} for each named leaf after out.backward(dy).

    A leaf that gets no gradient maps to None (the check reports it). The leaves' .grad are
    cleared before and after, so the timed calls that follow start as they always do.
    """
    for leaf in leaves.values():
        leaf.grad = None
    out = forward()
    out.backward(dy)
    found = {"out": out.detach()}
    for name, leaf in leaves.items():
        found[f"d{name}"] = leaf.grad
        leaf.grad = None
    return found


@dataclasses.dataclass
class Verdict:
    ok: bool
    text: str  # "ok (1.02x)": the worst ratio of its error to PyTorch's; else what is wrong


def compare(got, reference, pytorch):
    """Verdict on `got` (an implementation's outputs) against the float64 reference."""
    worst = 0.0
    for name, want in reference.items():
        ours = got.get(name)
        if ours is None:
            return Verdict(False, f"wrong output: no {name}")
        if ours.shape != want.shape:
            return Verdict(False, f"wrong output: {name} has shape {tuple(ours.shape)}, not {tuple(want.shape)}")
        if not torch.isfinite(ours).all():
            return Verdict(False, f"wrong output: {name} has non-finite values")
        error, theirs = rel_error(ours, want), rel_error(pytorch[name], want)
        if error > 2 * theirs + ERROR_FLOOR:
            return Verdict(False, f"wrong output: {name} error {error:.2e} > 2x PyTorch's {theirs:.2e}")
        if theirs > 0:
            worst = max(worst, error / theirs)
    return Verdict(True, f"ok ({worst:.2f}x)")
