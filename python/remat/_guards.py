"""When a fused path may stand in for modules, and what a converted module does when it may not.

A fused path computes several modules' work in one op, reading their parameters directly, so it
reproduces them only while they are the plain layers it was built for. A model changes after
conversion: peft wraps Linears in LoRA layers, users add hooks or parametrizations, weights become
quantised tensor subclasses. Every fused path therefore asks whether its modules are still plain
(these functions); where one is not, that call runs the modules' own forwards, and the converted
module records why (`fallback`), warning once per module and reason.

The answer is decided once and kept (`decided`) while a cheap fingerprint of the modules it read
stays the same: their identities and classes, training flags, hook counts and parameters'
identities, dtypes and shapes, and the global hooks' counts. Everything the checks read of a plain
module is in it; a peft LoRA layer's adapters are not, so a check that reads one runs at every call.
Where the extension remat._C is built, a kept fingerprint is compared with the modules in place, in
C++ (unchanged): a converted layer asks at every call.
"""

import collections
import warnings

import torch
from torch import nn
from torch.nn.modules import module as _module_globals

from ._tensor_memo import MISSING

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = tuple(getattr(_module_globals, name) for name in _GLOBAL_HOOKS)
_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)


class RematFallbackWarning(UserWarning):
    """A converted module ran its stock forward for a call (shown once per module and reason)."""


# Set by remat.convert, for the conversion's duration, on the modules its filter_fn rejects (and those below
# them): every rule asks hook_reason before it swaps, fuses or reads a module's parameters, so one mark
# keeps each such module stock, its own forward running, as a hook would.
EXCLUDED = "remat_excluded"


def hook_reason(module, skip=(), allow=None):
    """Why `module` must run its own forward because of hooks or parametrizations, or None; the hook
    dicts named in `skip` ("_forward_hooks") not counted, nor hooks for which allow(hook) is true (an
    engine's hooks a fused path takes over: _zero3.is_hook).

    Global module hooks (torch.nn.modules.module.register_module_forward_hook and the like) count
    too: they run on every module call, which a fused path would skip. A module remat.convert's
    filter_fn rejects is refused as a hooked one is, while the conversion runs.
    """
    excluded = getattr(module, "__dict__", {}).get(EXCLUDED)
    if excluded:
        return excluded
    if any(hook for name in _MODULE_HOOKS if name not in skip
           for hook in (getattr(module, name, None) or {}).values() if allow is None or not allow(hook)):
        return "has forward/backward hooks"
    if any(getattr(_module_globals, name, None) for name in _GLOBAL_HOOKS):
        return "global module hooks are registered"
    if getattr(module, "parametrizations", None) is not None:
        return "has parametrizations"
    return None


def excluded_below(module):
    """Why a module convert would swap must stay stock for remat.convert's filter_fn: a module below it
    that the filter rejects (a swapped module computes its children's work), or None."""
    return next((f"its {name} is {vars(below)[EXCLUDED]}" for name, below in module.named_modules()
                 if name and EXCLUDED in vars(below)), None)


def tensor_reason(name, tensor):
    """Why the parameter `tensor` cannot be read as a plain dense tensor, or None."""
    if tensor is None:
        return None
    if type(tensor) not in _PLAIN_TENSOR_TYPES:
        return f"{name} is a {type(tensor).__name__}, not a plain tensor (quantised or a tensor subclass)"
    if not tensor.is_floating_point():
        return f"{name} has dtype {tensor.dtype}, not a floating dtype"
    return None


def fingerprint(modules):
    """What can change in `modules` (None entries skipped) after conversion without a module being
    replaced by another: classes (parametrize swaps it), training flags, hook counts, parameters
    (identities: replaced by a quantised one; dtypes: cast in place by .to(); shapes: data replaced,
    which a fused op's kept argument check, remat.ops.fused.Checked, relies on), devices aside (a
    parameter's device moves with it, and Checked compares the input's), with the global hooks' counts.
    csrc/guards.cpp reads this very layout (unchanged): change both together."""
    # one flat list, each module's state read from its __dict__: without remat._C this runs at every fused call
    key = [*map(len, _GLOBAL_HOOK_DICTS)]
    for m in modules:
        if m is not None:
            state = m.__dict__
            key += (m, m.__class__, state["training"], len(state["_forward_hooks"]), len(state["_forward_pre_hooks"]),
                    len(state["_backward_hooks"]), len(state["_backward_pre_hooks"]))
            for p in state["_parameters"].values():
                if p is not None:
                    key += (id(p), p.__class__, p.dtype, p.shape)
    return key


def _native_comparison():
    """remat._C.same_fingerprint, the comparison of a kept fingerprint with `modules` read in place (about a
    tenth of taking it in Python), where the extension is built (a GPU machine, or REMAT_BUILD_CUDA=1); else None."""
    try:
        from . import _C
    except ImportError:
        return None
    return getattr(_C, "same_fingerprint", None)  # (None in an extension built before it had it)


_same_fingerprint = _native_comparison()


def native_comparison():
    """Whether kept fingerprints are compared in place by remat._C (unchanged), not taken again in Python."""
    return _same_fingerprint is not None


def unchanged(key, modules):
    """Whether fingerprint(modules) would equal `key`, where remat._C can tell without taking it: true only
    where it would (false also where it cannot tell: the caller then takes it)."""
    return _same_fingerprint is not None and _same_fingerprint(key, modules, _GLOBAL_HOOK_DICTS, _PLAIN_TENSOR_TYPES)


def decided(owner, modules, check, extra=(), under=None):
    """check(), kept on `owner` and computed again only when the fingerprint of `modules` (or `extra`,
    further state the check reads) changed since it was kept: a converted module's per-call question
    "are my modules still the plain ones I was built for?", asked once. The kept verdict holds the
    modules it describes, so their identities cannot be reused by others while it stands. Under
    torch.compile the check runs as it is (the graph's guards take its place).

    under: the verdict of a check whose fingerprint covers all of `modules` and was taken at this very
    call (a handoff's, Handoff.verdict): while it is the one this verdict was kept under, nothing it
    covers changed, and the fingerprint is not taken again (kept_under)."""
    if torch.compiler.is_compiling():
        return check()
    verdict = kept_under(owner, under)
    if verdict is not MISSING:
        return verdict
    kept = owner.__dict__.get("remat_decided")
    if kept is not None and kept[2] is under and kept[0][1] == extra and unchanged(kept[0][0], modules):
        return kept[1]
    key = fingerprint(modules), extra
    changed = kept is None or kept[0] != key
    if changed or kept[2] is not under:  # kept as it is otherwise: the same object (a handoff's verdict())
        kept = owner.__dict__["remat_decided"] = key, check() if changed else kept[1], under
    return kept[1]


def kept_under(owner, under):
    """The verdict `decided` kept on `owner` under the verdict `under` (see decided), or MISSING."""
    if under is None or torch.compiler.is_compiling():  # (nothing kept to compare while it traces)
        return MISSING
    kept = owner.__dict__.get("remat_decided")
    return kept[1] if kept is not None and kept[2] is under else MISSING


def from_transformers(kind):
    """Whether the class `kind` is defined by transformers (judged by its module: transformers need not
    be imported)."""
    return kind.__module__.startswith("transformers.")


def plain_reason(module, classes, label=None, allow=None):
    """None when `module` is exactly one of `classes`, without hooks (but those allow(hook) takes) or
    parametrizations, its own parameters plain floating tensors; else why not (naming `label`, or the class)."""
    label = label or type(module).__name__
    if type(module) not in classes:
        names = " or ".join(c.__name__ for c in classes)
        return f"{label} is {type(module).__name__}, not exactly {names}"
    reason = hook_reason(module, allow=allow)
    if reason:
        return f"{label} {reason}"
    for name, param in module.named_parameters(recurse=False):
        reason = tensor_reason(f"{label}.{name}", param)
        if reason:
            return reason
    return None


def fallback(module, reason, where=None, runs="its stock forward"):
    """Record that `module` runs `runs` (its stock forward, or a stock part of it) for this call
    because of `reason`; the first time for this module and reason, warn (RematFallbackWarning)
    naming `where` (default: the path convert gave the module). Counts: fallback_counts()."""
    if torch.compiler.is_compiling():
        return  # nothing to record from inside a graph; the eager calls record it
    counts = module.__dict__.setdefault("remat_fallbacks", collections.Counter())
    if reason not in counts:
        if where is None:
            path = module.__dict__.get("remat_path")
            where = f"{path} ({type(module).__name__})" if path else type(module).__name__
        warnings.warn(f"remat: {where} runs {runs}: {reason}", RematFallbackWarning, stacklevel=3)
    counts[reason] += 1


def fallback_counts(model):
    """{module path: {reason: calls}} of the converted modules in `model` that fell back to stock."""
    found = {}
    for path, module in model.named_modules():
        counts = module.__dict__.get("remat_fallbacks")
        if counts:
            found[path or "(root)"] = dict(counts)
    return found
