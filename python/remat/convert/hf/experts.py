"""remat's experts as a transformers experts implementation, named "remat".

transformers routes the expert MLPs of its mixture-of-experts families through a public extension
point: a class decorated with `@use_experts_implementation` calls the function that
`config._experts_implementation` names in its ExpertsInterface, as `fn(module, hidden_states,
top_k_index, top_k_weights)`, after its router chose. `register()` adds "remat" there, so that
`from_pretrained(..., experts_implementation="remat")`, `model.set_experts_implementation("remat")`
and remat.convert run those experts on remat.experts: the forward keeps the tokens and the routing
only and the backward rebuilds each expert's up projection and activation tile by tile. The router
is the model's and runs once: nothing here calls it again.

What an experts module computes is read from the module, once (`spec`), with no per-family code:
- its weights, by the decorator's attributes and names: `gate_up_proj` (or `up_proj` without a gate),
  `down_proj`, their `_bias` when `has_bias`, transposed when `is_transposed`, gate and up interleaved
  when not `is_concatenated`;
- its activation, by calling the module's own gate (`_apply_gate`, or `act_fn` without a gate) on a
  float64 probe that spans the clamp limits, and comparing it with each activation remat.experts has
  (gated SiLU, GELU, tanh-GELU, gpt-oss's clamped SwiGLU with the module's alpha and limit; plain
  SiLU, GELU, tanh-GELU, ReLU, squared ReLU): the one that agrees is the module's, and where none
  does (a clamp remat has not, a gate of two functions) the experts run stock, with the reason.
Parametrizations on the experts' parameters (peft LoRA's `target_parameters`) are taken: the
function reads `module.gate_up_proj` as the stock forward does, its value with the adapter in, and
remat.experts hands its gradient back through it. Each call checks only what a call can change (the
weights' types and dtypes, the input's shape); what it cannot take runs the implementation the model
had before ("eager" or the previous one's function), with the reason recorded (fallback_counts()).

The router (the module structure.routes finds projecting the tokens with its own weight) takes the
norm before it into that projection: _RematNormedRouter, at the end of this file.
"""

import collections
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..._guards import EXCLUDED, decided, excluded_below, tensor_reason
from ..._validate import autocast_dtype
from ...ops import experts as experts_op
from ...ops.fused import norm_linears
from ...ops.layer_norm import layer_norm
from ...ops.rms_norm import rms_norm
from ...specs import Linear
from .handoff import _between_reason, _shared_statistics, fed_norm
from .modules import _layer_norm_reason, _RematModule, norm_spec, record_call, stock_norm

NAME = "remat"

# What remat.experts needs of an experts module besides its call's tensors, decided once per module.
# gate_up: the name of the up projection's weight ("gate_up_proj", or "up_proj" without a gate);
# gate_up_bias: its bias's name, or None (then down_proj has none either: the decorator's has_bias).
Spec = collections.namedtuple("Spec", "gate_up gate_up_bias activation gated interleaved transposed "
                                      "alpha limit")

_PROBE_ROWS, _PROBE_WIDTH = 8, 12  # the activation probe: (rows, 2 x width) pre-activations
_PROBE_SPAN = 24.0  # beyond any clamp limit a family uses (gpt-oss: 7) and far into each activation's tails


def register():
    """Make "remat" an experts implementation of transformers (once; later calls do nothing)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The "remat" experts implementation: the routed experts' weighted sum on remat.experts."""
    norm, broken = fed_norm(module, hidden_states)  # the norm before the experts, fused in (rules.py)
    if module.__dict__.get("remat_experts_stock"):  # reverted apart from its model
        reason = "reverted"
    else:
        spec = module.__dict__.get("remat_experts_spec")
        if spec is None:
            spec = module.__dict__["remat_experts_spec"] = module_spec(module)
        reason = spec if isinstance(spec, str) else _call_reason(module, spec, hidden_states, top_k_index)
        if reason is None and norm is not None:
            reason = decided(module, [norm], lambda: _layer_norm_reason(norm))
        _trace(module, reason or broken)
    if reason is not None:
        if norm is not None:  # the norm handed its input over: apply it, as stock
            hidden_states = stock_norm(norm, hidden_states)
        return stock_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    return experts_op.experts(
        hidden_states, top_k_index, top_k_weights, getattr(module, spec.gate_up), module.down_proj,
        getattr(module, spec.gate_up_bias) if spec.gate_up_bias else None,
        module.down_proj_bias if spec.gate_up_bias else None, activation=spec.activation, gated=spec.gated,
        interleaved=spec.interleaved, transposed=spec.transposed, alpha=spec.alpha, limit=spec.limit,
        keep_hidden=module.__dict__.get("remat_experts_keep_hidden", False),
        norm=norm_spec(norm) if norm is not None else None,
        shared=_shared_statistics(module) if norm is not None else None)


def _trace(module, reason):
    """Record why this call runs stock (None: remat.experts computes it): modules.record_call, named by
    the path convert_experts gave the module."""
    path = module.__dict__.get("remat_experts_path") if reason is not None else None
    record_call(module, reason, where=f"{path} ({type(module).__name__})" if path else None, runs="its stock experts")


def stock_forward(module):
    """The experts function the module runs without remat's: the implementation the model had before
    remat.convert set "remat", else the class's own (eager) forward, which the decorator wraps."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    previous = module.__dict__.get("remat_experts_previous", "eager")
    if previous != "eager" and previous in ALL_EXPERTS_FUNCTIONS:
        return ALL_EXPERTS_FUNCTIONS[previous]
    wrapped = getattr(type(module).forward, "__wrapped__", None)
    return wrapped if wrapped is not None else ALL_EXPERTS_FUNCTIONS["batched_mm"]


# ---------------------------------------------------------------------------------------------
# What a module computes: decided once
# ---------------------------------------------------------------------------------------------


def module_spec(module):
    """The module's Spec, or the reason remat.experts cannot compute it (a str)."""
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm), which remat.experts does not apply"
    gated = bool(getattr(module, "has_gate", True))
    gate_up = "gate_up_proj" if gated else "up_proj"
    has_bias = bool(getattr(module, "has_bias", False))
    for name in (gate_up, "down_proj") + ((gate_up + "_bias", "down_proj_bias") if has_bias else ()):
        if not isinstance(getattr(module, name, None), torch.Tensor):
            return f"no tensor {name} (the experts decorator's weight names)"
    interleaved = gated and not getattr(module, "is_concatenated", True)
    found = _activation(module, gated, interleaved)
    if isinstance(found, str):
        return found
    activation, alpha, limit = found
    return Spec(gate_up, gate_up + "_bias" if has_bias else None, activation, gated,
                interleaved, bool(getattr(module, "is_transposed", False)), alpha, limit)


def _clamp_options(module):
    """(alpha, limit) pairs to try for gpt-oss's clamped SwiGLU: the module's own, under either name."""
    alpha = getattr(module, "alpha", getattr(module, "swiglu_alpha", None))
    limit = getattr(module, "limit", getattr(module, "swiglu_limit", None))
    if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
        return [(float(alpha), float(limit))]
    return []


def _candidates(module, gated):
    """(activation, alpha, limit) of remat.experts, the module's clamp options for the clamped SwiGLU."""
    default = (experts_op.GPT_OSS_ALPHA, experts_op.GPT_OSS_LIMIT)
    if not gated:
        return [(name, *default) for name in experts_op.PLAIN_ACTIVATIONS]
    plain = [(name, *default) for name in experts_op.GATED_ACTIVATIONS if name != "swiglu_clamped"]
    return plain + [("swiglu_clamped", alpha, limit) for alpha, limit in _clamp_options(module)]


def _activation(module, gated, interleaved):
    """(activation, alpha, limit) whose values equal the module's own gate on a float64 probe, or why none."""
    width = 2 * _PROBE_WIDTH if gated else _PROBE_WIDTH
    generator = torch.Generator().manual_seed(0)
    h = (torch.rand(_PROBE_ROWS, width, generator=generator, dtype=torch.float64) * 2 - 1) * _PROBE_SPAN
    h[0] = torch.linspace(-_PROBE_SPAN, _PROBE_SPAN, width, dtype=torch.float64)
    try:
        with torch.no_grad():
            own = module._apply_gate(h.clone()) if gated else module.act_fn(h.clone())
    except Exception as error:  # noqa: BLE001 - any failure: the gate is not one remat knows
        return f"its gate could not be probed ({type(error).__name__}: {error})"
    for activation, alpha, limit in _candidates(module, gated):
        ours, _ = experts_op.activation_and_derivatives(h, activation, gated, interleaved, alpha, limit)
        if own.shape == ours.shape and _agrees(own.double(), ours):
            return activation, alpha, limit
    what = "_apply_gate" if gated else "act_fn"
    return (f"its {what} computes none of remat.experts' activations (gated or not: "
            f"{', '.join(sorted(set(experts_op.GATED_ACTIVATIONS + experts_op.PLAIN_ACTIVATIONS)))}) "
            f"on its layout")


def _agrees(own, ours):
    """Equal to fp32 rounding (a gate computed in fp32, as some families' is, agrees; GELU's tanh form is
    1e-3 away from its erf form, and every other pair further)."""
    return bool(torch.allclose(own, ours, rtol=1e-5, atol=1e-5 * (1 + ours.abs().max().item())))


def _call_reason(module, spec, x, top_k_index):
    """Why this call runs stock, or None: what a call can change since the spec was decided."""
    weights = [(spec.gate_up, getattr(module, spec.gate_up)), ("down_proj", module.down_proj)]
    if spec.gate_up_bias:
        weights += [(spec.gate_up_bias, getattr(module, spec.gate_up_bias)), ("down_proj_bias", module.down_proj_bias)]
    for name, w in weights:
        reason = tensor_reason(name, w)
        if reason is not None:
            return reason
    if x.dim() != 2 or top_k_index.dim() != 2:
        return (f"hidden_states of shape {tuple(x.shape)} and top_k_index of {tuple(top_k_index.shape)}, not "
                "(tokens, ...)")
    if top_k_index.shape[1] > experts_op.MAX_TOP_K:
        return f"top-{top_k_index.shape[1]} routing (remat.experts takes up to {experts_op.MAX_TOP_K})"
    if autocast_dtype(x.device.type) is not None:
        return None  # remat.experts casts x and the weights to the autocast dtype, as the stock experts' products
    dtypes = {w.dtype for _, w in weights[:2]}
    if dtypes != {x.dtype}:
        return (f"hidden_states are {x.dtype} and the expert weights {', '.join(sorted(map(str, dtypes)))} "
                "(remat.experts computes in one dtype)")
    return None


# ---------------------------------------------------------------------------------------------
# remat.convert
# ---------------------------------------------------------------------------------------------


def experts_modules(model):
    """(name, module) of every experts module in `model` that calls transformers' experts interface."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


# What `@use_experts_implementation`'s __init__ sets on every instance (module attributes, its public shape).
_DECORATOR_ATTRIBUTES = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def is_experts_module(module):
    """Whether the module is a `@use_experts_implementation` class: its instance carries the decorator's
    attributes and its forward wraps the class's own (functools.wraps), which it dispatches from."""
    forward = getattr(type(module), "forward", None)
    return getattr(forward, "__wrapped__", None) is not None and all(
        isinstance(module.__dict__.get(name), bool) for name in _DECORATOR_ATTRIBUTES)


def convert_experts(model, path, report, keep_hidden=False):
    """Make "remat" the experts implementation of the Hugging Face `model` (remat.convert), where it has
    experts modules that call the interface; each module's row says whether remat.experts computes it
    (decided here, once) or why not. keep_hidden: the experts keep their pre-activation (no second up
    projection in the backward, more memory): remat.convert's recompute=False."""
    from ..swap import join

    found = experts_modules(model)
    if not found:
        return
    previous = model.config._experts_implementation
    if previous not in ("eager", "grouped_mm", "batched_mm"):
        report.add(path, model, "skipped", f"experts implementation {previous!r} kept (remat replaces eager, "
                                           "grouped_mm and batched_mm)")
        return
    register()
    try:
        model.set_experts_implementation(NAME)
    except (ValueError, KeyError, RuntimeError) as error:
        report.add(path, model, "skipped", f"experts implementation {previous!r} kept: {error}")
        return
    model.__dict__["remat_experts_implementation"] = previous
    saved = []
    for name, module in found:
        module_path = join(path, name)
        module.__dict__.update(remat_experts_previous=previous, remat_experts_path=module_path,
                               remat_experts_keep_hidden=keep_hidden)
        module.__dict__.pop("remat_experts_stock", None)
        if EXCLUDED in vars(module):  # its hooks see the module's call either way: only convert's filter_fn counts
            module.__dict__.pop("remat_experts_keep_hidden")
            module.__dict__["remat_experts_stock"] = True
            report.add(module_path, module, "skipped",
                       f"runs its stock experts ({previous!r}): {vars(module)[EXCLUDED]}")
            continue
        spec = module.__dict__["remat_experts_spec"] = module_spec(module)
        if isinstance(spec, str):
            report.add(module_path, module, "skipped", f"runs its stock experts ({previous!r}): {spec}")
            continue
        saved.append(functools.partial(saved_bytes_per_token, module, spec))
        report.add(module_path, module, "kept", f"runs remat.experts ({spec.activation}"
                   f"{', gated' if spec.gated else ''}; the tokens and routing kept, "
                   f"{'the pre-activation kept' if keep_hidden else 'each expert rebuilt in the backward'})")
    report.add(path, model, f"experts implementation {previous!r} -> {NAME!r}",
               f"{len(saved)} of {len(found)} experts modules run remat.experts",
               lambda: sum(saves() for saves in saved))


def runs_remat_experts(module):
    """Whether `module` is an experts module that remat.convert set to run remat.experts."""
    found = module.__dict__
    return isinstance(found.get("remat_experts_spec"), Spec) and not found.get("remat_experts_stock")


def keep_experts_hidden(module, keep):
    """Set the policy of the experts modules below `module` that run remat.experts (a plan's per-layer
    choice): keep their pre-activation, or rebuild it in the backward. Returns how many there are."""
    found = [m for m in module.modules() if runs_remat_experts(m)]
    for m in found:
        m.__dict__["remat_experts_keep_hidden"] = keep
    return len(found)


def revert_experts(module):
    """Give the model `module` back the experts implementation it had before convert_experts. An experts
    module below such a model, reverted apart from it (remat.revert of one layer, as a plan does for
    the layers it keeps stock), keeps the model's "remat" implementation, which every layer reads
    from the shared config: it runs its stock experts instead."""
    previous = module.__dict__.pop("remat_experts_implementation", None)
    if previous is not None:
        module.set_experts_implementation(previous)
        for below in module.modules():
            for key in ("remat_experts_previous", "remat_experts_path", "remat_experts_keep_hidden",
                        "remat_experts_spec", "remat_experts_stock"):
                below.__dict__.pop(key, None)
    elif "remat_experts_previous" in module.__dict__:
        module.__dict__["remat_experts_stock"] = True
    if is_experts_module(module):  # a norm fused into it (rules.py) is reverted with its layer
        for key in ("remat_handoff", "remat_decided"):
            module.__dict__.pop(key, None)


def saved_bytes_per_token(module, spec):
    """The activation bytes per token one experts module keeps less under remat.experts than under
    transformers' grouped_mm experts (docs/memory.md, "Experts"), at the weights' current dtype and
    the module's current policy (a plan may change it per layer), its weights taken as trained."""
    keep_hidden = module.__dict__.get("remat_experts_keep_hidden", False)
    gate_up = getattr(module, spec.gate_up)
    n1 = gate_up.shape[2 if spec.transposed else 1]
    width = module.down_proj.shape[2 if spec.transposed else 1]
    top_k = _top_k(module)
    element = gate_up.element_size()
    return grouped_mm_bytes_per_token(width, n1, spec.gated, top_k, element) - \
        remat_bytes_per_token(n1, top_k, element, keep_hidden)


def _top_k(module):
    config = getattr(module, "config", None)
    return getattr(module, "top_k", None) or getattr(config, "num_experts_per_tok", None) or 1


def grouped_mm_bytes_per_token(width, n1, gated, top_k, element):
    """What transformers' grouped_mm experts keep per token besides the router's weights, as autograd
    saves it (each of the token's top_k pairs): the gathered input (width), the up projection's output
    (n1, kept by the activation), the gate's activation (n1 / 2, kept by the product with up, gated
    only), the down projection's input (the activation's output) and output (width, kept by the
    routing weights' product), in the activation dtype; and three int64 indices (the gather's, the
    weights' and the output's order). A lower bound where the activation keeps more (a clamp keeps
    its masks)."""
    inter = n1 // 2 if gated else n1
    return top_k * ((2 * width + n1 + inter + (inter if gated else 0)) * element + 3 * 8)


def remat_bytes_per_token(n1, top_k, element, keep_hidden):
    """What remat.experts keeps per token besides the router's weights and x (which the router's own
    projection keeps too): the sorted order (int32 per pair), and with keep_hidden the pre-activation."""
    return top_k * (4 + (n1 * element if keep_hidden else 0))


# ---------------------------------------------------------------------------------------------
# The router, with the norm before it fused into its projection
# ---------------------------------------------------------------------------------------------


def router_reason(router, label):
    """Why the norm before the router `label` cannot be fused into its projection, or None: hooks that
    would see the norm's input (transformers' recorders of its logits see the same outputs), or weights
    that are no plain tensors. Its own forward runs, hooks and all."""
    if "forward" in vars(router):
        return f"{label}'s forward is replaced on the instance"
    reason = _between_reason(router) or excluded_below(router)
    if reason:
        return f"{label} {reason}"
    return next(filter(None, (tensor_reason(f"{label}.{n}", p) for n, p in router.named_parameters(recurse=False))),
                None)


# Functions that read a tensor's metadata only (shape, dtype, device, ...): not a use of its values.
METADATA = frozenset({"__get__", "size", "dim", "ndimension", "numel", "nelement", "__len__", "stride",
                      "is_floating_point", "is_complex", "is_contiguous", "get_device", "element_size"})

# Functions whose output holds their input's rows unchanged (a mixture of experts' block and its router
# flatten the tokens): followed as the input itself, by the structure probe and by _RouterProjection.
RESHAPES = frozenset({"view", "reshape", "flatten"})


class _RouterProjection(TorchFunctionMode):
    """Inside a router's stock forward, called on the norm's input x instead of norm(x): its projection
    F.linear(tokens, weight[, bias]) of x (or of a reshape of it) is computed by `project(tokens, bias)`
    with the norm fused in; anything else that reads x or a reshape of it (a cast before an fp32
    projection, DeepSeek-V3's) reads norm(x), computed once by `normed(x)`: never x itself."""

    def __init__(self, x, weight, project, normed):
        super().__init__()
        self.weight, self.project, self.normed = weight, project, normed
        self.tokens = {id(x): x}  # x and its reshapes (held: ids stay theirs while the forward runs)
        self.materialised = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if id(first) in self.tokens and self.tokens[id(first)] is first:
            if getattr(func, "__name__", None) in RESHAPES:
                out = func(*args, **kwargs)
                self.tokens[id(out)] = out
                return out
            if func is F.linear and len(args) > 1 and args[1] is self.weight:
                return self.project(first, args[2] if len(args) > 2 else kwargs.get("bias"))
        if getattr(func, "__name__", None) in METADATA:  # x's shape, dtype, ...: norm(x)'s too
            out = func(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                return out
        args = tuple(self._normed(a) for a in args)
        kwargs = {k: self._normed(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _normed(self, value):
        """norm(value) for x or a reshape of it, else value."""
        if not isinstance(value, torch.Tensor) or self.tokens.get(id(value)) is not value:
            return value
        if id(value) not in self.materialised:
            self.materialised[id(value)] = self.normed(value)
        return self.materialised[id(value)]


def remat_norm(spec, x):
    """spec (a remat.specs.Norm) applied to x on remat's own norm ops, rounded as the stock norm: autograd
    keeps x and the fp32 statistics, never the output."""
    if spec.kind == "rms_norm":
        return rms_norm(x, x.shape[-1:], spec.weight, spec.eps, spec.style)
    return layer_norm(x, x.shape[-1:], spec.weight, spec.bias, spec.eps)


class _RematNormedRouter(_RematModule):
    """A mixture of experts' router (a module projecting the tokens with its own weight into the experts'
    logits, then choosing: structure.routes) with the norm before it fused into that projection: its
    stock forward runs on the norm's input x, and its F.linear with its weight computes weight · norm(x)
    on norm_linears, which keeps x and the norm's fp32 statistics, never norm(x). A router that casts
    the tokens first (to project in fp32) reads norm(x) from remat's norm op instead (x and the
    statistics kept, not the norm's fp32 copies), and its projection keeps what stock's keeps. The
    choices are made once, in the forward: nothing of the router runs in the backward."""

    remat_prefix = "RematNormed"

    def forward(self, hidden_states, *args, **kwargs):
        norm, reason = fed_norm(self, hidden_states)
        if norm is None:  # the norm computed itself, or a call apart from the layer: hidden_states are norm(x)
            self._remat_fallback(reason)
            return self.remat_stock.forward(self, hidden_states, *args, **kwargs)
        reason = decided(self, [self, norm], lambda: router_reason(self, self.remat_path) or _layer_norm_reason(norm))
        if reason:
            self._remat_fallback(reason)
            return self.remat_stock.forward(self, stock_norm(norm, hidden_states), *args, **kwargs)
        self._remat_fallback(None)
        spec, shared = norm_spec(norm), _shared_statistics(self)

        def project(tokens, bias):
            return norm_linears(tokens, spec, [Linear(self.weight, bias)], self.remat_recompute, shared)[0]

        with _RouterProjection(hidden_states, self.weight, project, lambda tokens: remat_norm(spec, tokens)):
            return self.remat_stock.forward(self, hidden_states, *args, **kwargs)
