"""The Linear-like modules a fused op can compute in place of their own forward.

    nn.Linear                         y = x·Wᵀ + b
    transformers' FalconLinear        y = x @ Wᵀ + b (an nn.Linear whose forward adds the bias after the
                                      product: the same sum, rounded twice in bf16 where F.linear rounds once)
    transformers' Conv1D              y = x·W + b, W stored (in, out)
    peft's LoRA Linear around either  y = base(x) + Σ B(A(dropout(x))) · scale, over the active adapters

`projection(module)` says what a fused op must compute for `module` (a remat.ops.fused.Linear:
weight (out, in), bias and LoRA adapters, read at the time of the call), or why it cannot:
anything else (another wrapper, a LoRA variant such as DoRA, LoRA dropout in training, hooks,
parametrizations, quantised or subclassed weights) runs the module's own forward instead. A LoRA
layer's forward is checked against that formula once, on a small random input, the first time it
is met (peft's own forward is the reference), so a peft release that computes something else is
never silently fused.
"""

import torch
from torch import nn

from . import _zero3 as zero3
from ._guards import decided, from_transformers, hook_reason, kept_under, plain_reason
from ._numerics import rel_error
from ._tensor_memo import MISSING
from .ops.fused import Checked
from .specs import Linear, LoRA


def _is_transformers_class(module, name):
    """By class name and origin (transformers need not be imported), also for a module whose class
    remat.convert swapped (its stock class: remat_stock)."""
    kind = getattr(type(module), "remat_stock", type(module))
    return kind.__name__ == name and from_transformers(kind)


_CONV1D_CLASSES = {}  # class -> whether it is transformers' Conv1D (or remat's swap of it): asked at every call


def is_conv1d(module):
    """transformers' Conv1D (GPT-2's projections)."""
    kind = type(module)
    found = _CONV1D_CLASSES.get(kind)
    if found is None:
        found = _CONV1D_CLASSES[kind] = _is_transformers_class(module, "Conv1D")
    return found


def is_falcon_linear(module):
    """transformers' FalconLinear (Falcon's projections): an nn.Linear computing input @ weight.T + bias."""
    return _is_transformers_class(module, "FalconLinear")


def is_lora_linear(module):
    """peft's LoRA layer for Linear-like base layers (peft.tuners.lora.layer.Linear), also one whose class
    remat.convert swapped (its stock class: remat_stock)."""
    kind = getattr(type(module), "remat_stock", type(module))
    return kind.__name__ == "Linear" and kind.__module__ == "peft.tuners.lora.layer"


def widths(module):
    """(in_features, out_features) of a Linear-like module, or None."""
    base = module.base_layer if is_lora_linear(module) else module
    if type(base) is nn.Linear or is_falcon_linear(base):
        return base.in_features, base.out_features
    if is_conv1d(base):
        return tuple(base.weight.shape)
    return None


def base_layer(module):
    """The plain Linear or Conv1D inside `module` (itself, or a LoRA layer's base layer)."""
    return module.base_layer if is_lora_linear(module) else module


def _plain_base(module, label, allow=None):
    """(Linear without adapters, None) for a plain nn.Linear, FalconLinear or Conv1D, or (None, why not);
    hooks allow(hook) takes not counted."""
    kinds = (type(module),) if is_conv1d(module) or is_falcon_linear(module) else (nn.Linear,)
    reason = plain_reason(module, kinds, label, allow)
    return (None, reason) if reason else (plain_linear(module), None)


def plain_linear(module):
    """The Linear of a plain nn.Linear, FalconLinear or Conv1D (the weight read now; a Conv1D's as it stores
    it, (in, out): transposed, computed as Conv1D computes it, with no transposed view of it)."""
    return Linear(module.weight, module.bias, (), is_conv1d(module))


def projection(module, label="projection", allow=None):
    """(remat.ops.fused.Linear, None) when a fused op can compute `module` exactly at this call, else
    (None, why not); hooks allow(hook) takes (an engine's the fused op takes over) not counted, but on
    a LoRA layer."""
    if not is_lora_linear(module):
        return _plain_base(module, label, allow)
    reason = _lora_reason(module, label)
    if reason:
        return None, reason
    base, reason = _plain_base(module.base_layer, f"{label}.base_layer")
    if base is None:
        return None, reason
    if module.merged or module.disable_adapters:  # peft calls base_layer alone (merged: adapters inside it)
        return base, None
    adapters = tuple(_adapter(module, name) for name in _active(module))
    reason = _verified(module, base, adapters, label)
    if reason:
        return None, reason
    return base._replace(adapters=adapters), None


def projections(modules, labels, allow=None):
    """([remat.ops.fused.Linear] for each of the Linear-like `modules`, None), or (None, the first
    reason one of them cannot be computed at this call; `labels` name them)."""
    linears = []
    for module, label in zip(modules, labels, strict=True):
        linear, reason = projection(module, label, allow)
        if reason:
            return None, reason
        linears.append(linear)
    return linears, None


def decided_projections(owner, modules, labels, others=(), other_reason=None, allow=None, under=None):
    """(linears, None, checked): projections(modules, labels), then `other_reason()` (the check of `others`,
    further modules the fused op reads: its norm, its activation), both decided once on `owner`
    (_guards.decided, kept under `under` when given) while no module is a peft LoRA layer, whose
    adapters the fingerprint does not cover: those are checked at every call (checked is None then);
    else (None, why not, None). The Linears are read at every call (weights replaced in place stay
    seen); checked: the remat.ops.fused.Checked of this verdict, for the fused op's argument check kept
    with it. allow: as projection's."""
    def others_reason():
        return other_reason() if other_reason is not None else None

    if kept_under(owner, under) is MISSING and any(map(is_lora_linear, modules)):  # (a kept verdict: no LoRA)
        linears, why = projections(modules, labels)
        why = why or others_reason()
        return (None, why, None) if why else (linears, None, None)
    why, checked = decided(owner, [*modules, *others],
                           lambda: (projections(modules, labels, allow)[1] or others_reason(),
                                    Checked(keeps_calls=not zero3.any_partitioned([*modules, *others]))), under=under)
    return (None, why, None) if why else ([plain_linear(m) for m in modules], None, checked)


def _active(module):
    return [name for name in module.active_adapters if name in module.lora_A]


def _adapter(module, name):
    b = module.lora_B[name]
    return LoRA(module.lora_A[name].weight, b.weight, b.bias, module.scaling[name])


def _lora_reason(module, label):
    """Why peft's LoRA layer `module` is not the vanilla LoRA the fused ops compute, or None."""
    reason = hook_reason(module)
    if reason:
        return f"{label} {reason}"
    if module.disable_adapters:
        # peft unmerges a merged layer inside its forward here: let it
        return None if not module.merged else f"{label}: adapters disabled on a merged LoRA layer"
    if module.merged:
        return None
    for name in _active(module):
        if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False):
            return f"{label}: LoRA adapter {name!r} is a variant (DoRA or another), not vanilla LoRA"
        dropout = module.lora_dropout[name]
        if type(dropout) is nn.Dropout:
            if dropout.p > 0 and dropout.training:
                return f"{label}: LoRA dropout (p={dropout.p}) in training"
        elif type(dropout) is not nn.Identity:
            return f"{label}: LoRA dropout is {type(dropout).__name__}, not nn.Dropout or nn.Identity"
        for part in ("lora_A", "lora_B"):
            reason = plain_reason(getattr(module, part)[name], (nn.Linear,), f"{label}.{part}.{name}") \
                or hook_reason(dropout)
            if reason:
                return reason
        if module.lora_A[name].bias is not None:
            return f"{label}.lora_A.{name} has a bias, which peft's LoRA does not"
        dtypes = {module.lora_A[name].weight.dtype, module.lora_B[name].weight.dtype}
        if len(dtypes) > 1:
            return f"{label}: LoRA adapter {name!r} mixes dtypes {sorted(map(str, dtypes))}"
    return None


def _verified(module, base, adapters, label):
    """None when `module`'s own forward computes base + adapters on a small random input, else why not.

    Checked once per layer and set of active adapters (a cheap 2-row product), not on every call;
    under torch.compile an unchecked layer runs its own forward (no probe inside a graph).
    """
    key = tuple((name, float(module.scaling[name])) for name in _active(module))
    cache = module.__dict__.setdefault("remat_verified", {})
    if key in cache:
        return cache[key]
    if torch.compiler.is_compiling():
        return f"{label}: LoRA layer first met under torch.compile (not yet checked against peft's forward)"
    weight = base.weight.t() if base.transposed else base.weight  # (out, in)
    if weight.is_meta:
        return None  # nothing to run on: accepted on structure, as convert's probes do
    generator = torch.Generator().manual_seed(0)  # private: the caller's random stream is untouched
    x = torch.randn(2, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    own_forward = getattr(type(module), "remat_stock", type(module)).forward  # peft's, also under a remat class
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        want = own_forward(module, x)
        got = torch.nn.functional.linear(x, weight, base.bias)
        for lora in adapters:
            got = got + torch.nn.functional.linear(torch.nn.functional.linear(x.to(lora.a.dtype), lora.a),
                                                   lora.b, lora.b_bias) * lora.scale
        got = got.to(want.dtype)
    error = rel_error(got, want)
    tolerance = 1e-5 if weight.dtype in (torch.float32, torch.float64) else 1e-2
    reason = None if error <= tolerance else \
        f"{label}: this peft version's LoRA forward differs from base + B(A(x))·scale (relative error {error:.2g})"
    cache[key] = reason
    return reason


def needs_input(module):
    """Whether autograd keeps the input of the Linear-like `module` for a weight gradient: its
    weight trains, or a LoRA adapter's A does (its gradient needs the same input)."""
    params = [base_layer(module).weight]
    if is_lora_linear(module):
        params += [m.weight for m in module.lora_A.values()]
    return any(p.requires_grad for p in params)


def fused_saved_bytes(norm=None, readers=(), fc2=None, gated=False):
    """Bytes per token a fused op keeps less than the stock modules it stands in for: the output of
    `norm` (fused into the Linear-like `readers`) where one of them trains, and the activation output
    (fc2's input) where fc2 trains; for a gated MLP also act(gate), which stock keeps for up's
    gradient; in fc2's (and the readers') dtype. A frozen Linear keeps no input in stock PyTorch
    either, so there is nothing to save there. An RMSNorm's stock forward may keep more (a float32
    copy of x, in transformers' formula): that is not counted."""
    saved = 0
    if norm is not None and any(needs_input(m) for m in readers):
        saved += _norm_width(norm) * base_layer(readers[0]).weight.element_size()
    if fc2 is not None:
        width, elem = widths(fc2)[0], base_layer(fc2).weight.element_size()
        saved += width * elem * (int(needs_input(fc2)) + int(gated))
    return saved


def _norm_width(norm):
    shape = getattr(norm, "normalized_shape", None)
    return shape[0] if shape is not None else norm.weight.shape[0]
