"""Model surgery: swap stock layers for remat's, keeping weights and state_dict keys.

    model = remat.convert(model)                     # a converted copy; inplace=True converts model itself
    model, report = remat.convert(model, report=True)
    print(report)                                    # one row per candidate: swapped, or skipped and why
    model = remat.revert(model)                      # stock modules again, same parameters

What is swapped (each only where it is provably the same computation):

    nn.LayerNorm                      -> remat.nn.LayerNorm (shares the parameters)           "layernorm"
    nn.GELU                           -> remat.nn.GELU                                         "gelu"
    nn.MultiheadAttention             -> RematMultiheadAttention: self-attention on            "attention"
                                         remat.attention, the stock computation otherwise
    in an nn.Sequential, consecutive
      (LayerNorm, Linear)             -> remat.nn.LayerNormLinear                              "layernorm"
      (Linear, GELU, Linear)          -> remat.nn.MLP                                          "mlp"
      (LayerNorm, Linear, GELU, Linear) -> remat.nn.LayerNormMLP                               "mlp" + "layernorm"
    in any other module's forward     -> the same three fusions, found by a torch.fx trace     as above
      (ln -> fc, fc1 -> GELU -> fc2,     of that forward: its rewritten forward calls remat's
       ln -> fc1 -> GELU -> fc2)         fused functions on the same submodules
    Hugging Face models (remat.hf)    -> attention classes on remat.attention (the stock       "attention", "mlp",
                                         forward for padding masks, KV caches, output_attentions), "layernorm"
                                         MLP blocks fused, pre-LN LayerNorms fused into the
                                         projection after them

The fusions are where the memory goes (design.md §1): a lone LayerNorm or GELU that recomputes
saves nothing, because the Linear after it keeps its output anyway.

Parameters are shared, never copied: the converted modules hold the very nn.Parameter objects
(and, for fusions, the very nn.LayerNorm/nn.Linear submodules) of the original, so an optimizer
built before conversion still works with inplace=True, and revert() gives the same parameters
back.

state_dict: unchanged keys, in the same order, and the original checkpoint loads (strict). A
fused run inside an nn.Sequential becomes the fused module at the run's first index and
nn.Identity at the others (len() and indices stay), and the Sequential becomes a
RematSequential whose state_dict()/load_state_dict() translate between the fused module's
names (`0.norm.weight`, `0.linear.weight`) and the original ones (`0.weight`, `1.weight`).
named_parameters() shows the fused names.

The torch.fx path (modules other than torch's, transformers' and remat's own, holding a
LayerNorm and a Linear or two Linears): the module's forward is traced with every submodule
call kept as one node, once per training mode. A run is fused where its graph shows each
layer's output going to the next layer and nowhere else (a dropout or anything else in
between stops it), the layers are the exact stock classes without hooks, and widths, devices
and dtypes chain. The module keeps its class, submodules, parameters and state_dict; an
instance attribute `forward` runs the rewritten graph for calls like the traced one (arguments
that have defaults left at them, the module's scalar attributes unchanged, the fused
submodules in place without hooks) and the class's forward for any other call. A forward
that does not trace (data-dependent control flow, *args), sets its own attributes or switches
grad or autocast mode is reported and left alone. What a trace cannot see stays the user's
promise: Python state other than the module's own scalar attributes and training flag
(globals, config objects) is read once, at conversion. A rewritten module does not pickle
whole (torch.save(model)): save its state_dict, or revert() first.

Never swapped: subclasses of the stock classes (they may override forward), modules with
forward/backward hooks or parametrizations, nn.Sequential subclasses, LayerNorms over more than
the last dimension or without affine parameters (for fusion), Linear pairs whose widths do not
chain back (MLP needs fc2: ffn -> hidden), mixed bias/no-bias pairs, modules on different
devices or dtypes. The report says which rule stopped each one.
"""

import collections
import contextlib
import copy
import functools
import inspect
import types
import warnings
import weakref

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from . import nn as remat_nn
from ._guards import fallback, fallback_counts, hook_reason
from ._linears import fused_saved_bytes, projection
from ._validate import autocast_dtype
from .ops.attention import multihead_self_attention
from .ops.fused import layer_norm_linear, mlp

LAYERS = frozenset({"layernorm", "gelu", "attention", "mlp"})

__all__ = ["ConversionReport", "RematMultiheadAttention", "RematSequential", "RematWarning", "ReportRow", "convert",
           "revert"]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

# saves: a function giving the activation bytes per token the swap keeps less than stock, under the
# model's requires_grad when it is called (None for skipped rows).
ReportRow = collections.namedtuple("ReportRow", "path type action reason saves", defaults=(None,))


def _no_saving():
    return 0


class ConversionReport(list):
    """A list of ReportRow(path, type, action, reason, saves); str() is a table.

    saved_bytes_per_token() totals what the swaps keep less than stock, per token of a layer's input
    (the bytes of the activation dtype, taken as the parameters'), for layers whose input requires
    grad, under the requires_grad of the model's parameters at the time of asking: freeze weights or
    add LoRA adapters after conversion and it changes as the saving does. fallbacks() counts the
    calls that ran a stock forward instead, per module and reason.
    """

    model = None  # a weak reference to the converted model, set by convert()

    def add(self, path, module, action, reason="", saves=None):
        if action != "skipped" and saves is None:
            saves = _no_saving
        self.append(ReportRow(path or "(root)", type(module).__name__, action, reason, saves))

    @property
    def swapped(self):
        return [row for row in self if row.action != "skipped"]

    @property
    def skipped(self):
        return [row for row in self if row.action == "skipped"]

    def saved_bytes_per_token(self):
        """Activation bytes per token all the swaps keep less than stock, at the current requires_grad."""
        return sum(row.saves() for row in self.swapped)

    def fallbacks(self):
        """{module path: {reason: calls}} of the converted modules that ran their stock forward."""
        model = self.model() if self.model is not None else None
        return fallback_counts(model) if model is not None else {}

    def __str__(self):
        header = ("module", "type", "action", "saves B/token", "reason")
        rows = [header] + [(row.path, row.type, row.action, "" if row.saves is None else str(row.saves()),
                            row.reason) for row in self]
        widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
        lines = []
        for n, row in enumerate(rows):
            cells = [str(row[i]).ljust(widths[i]) for i in range(4)] + [row[4]]
            lines.append("  ".join(cells).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths) + "  ------")
        lines.append(f"{len(self.swapped)} swapped, {len(self.skipped)} skipped; "
                     f"{self.saved_bytes_per_token()} activation bytes saved per token "
                     "(for layers whose input requires grad, at the current requires_grad)")
        return "\n".join(lines)

    def __repr__(self):
        return (f"ConversionReport({len(self)} rows: {len(self.swapped)} swapped, {len(self.skipped)} skipped, "
                f"{self.saved_bytes_per_token()} bytes/token saved)")


# ---------------------------------------------------------------------------------------------
# Checks shared by the rules (also used by remat.hf)
# ---------------------------------------------------------------------------------------------


def uniform_reason(*modules):
    """None when all parameters of `modules` share one device and dtype, else why not."""
    params = [p for m in modules for p in m.parameters(recurse=False)]
    if len({(p.device, p.dtype) for p in params}) > 1:
        return "parameters on different devices or dtypes"
    return None


def gelu_approximate(module):
    """"none" or "tanh" for the GELU modules remat computes exactly, else None."""
    if type(module) in (nn.GELU, remat_nn.GELU):
        return module.approximate if module.approximate in ("none", "tanh") else None
    from . import hf

    return hf.activation_approximate(module)


def layer_norm_fusable(norm, width=None, need_bias=False):
    """None when `norm` (an exact nn.LayerNorm) can be fused into a following Linear, else why not."""
    if type(norm) not in (nn.LayerNorm, remat_nn.LayerNorm):
        return f"{type(norm).__name__} is not exactly nn.LayerNorm"
    if len(norm.normalized_shape) != 1:
        return "LayerNorm over more than the last dimension"
    if not norm.elementwise_affine:
        return "LayerNorm without affine parameters (elementwise_affine=False) is not supported by the fused layers"
    if need_bias and norm.bias is None:
        return "LayerNorm without bias is not supported by LayerNormMLP"
    if width is not None and norm.normalized_shape[0] != width:
        return f"LayerNorm width {norm.normalized_shape[0]} != the Linear's in_features {width}"
    return hook_reason(norm)


def mlp_fusable(fc1, act, fc2):
    """None when fc1 -> act -> fc2 (exact nn.Linear, GELU, nn.Linear) is remat.nn.MLP, else why not."""
    for name, m in (("fc1", fc1), ("fc2", fc2)):
        if type(m) is not nn.Linear:
            return f"{name} is {type(m).__name__}, not exactly nn.Linear"
    if gelu_approximate(act) is None:
        return f"activation {type(act).__name__} is not a GELU remat computes (exact or tanh)"
    if fc2.in_features != fc1.out_features or fc2.out_features != fc1.in_features:
        return (f"widths do not chain: {fc1.in_features}->{fc1.out_features} then "
                f"{fc2.in_features}->{fc2.out_features} (MLP needs hidden->ffn->hidden)")
    if (fc1.bias is None) != (fc2.bias is None):
        return "one Linear has a bias and the other none"
    for m in (fc1, act, fc2):
        if hook_reason(m):
            return f"{type(m).__name__} {hook_reason(m)}"
    return uniform_reason(fc1, fc2)


def on_meta(*modules):
    return any(p.is_meta for m in modules for p in m.parameters())


# ---------------------------------------------------------------------------------------------
# Fused modules that share the original submodules
# ---------------------------------------------------------------------------------------------


def _meta_module(cls, *args, **kwargs):
    """cls(*args) with its own parameters on the meta device: they are replaced right after."""
    return cls(*args, **kwargs, device="meta")


def fused_layer_norm_linear(norm, linear, recompute):
    new = _meta_module(remat_nn.LayerNormLinear, linear.in_features, linear.out_features, recompute=recompute)
    new.norm, new.linear = norm, linear
    return new


def fused_mlp(norm, fc1, act, fc2, recompute):
    activation = "gelu_tanh" if gelu_approximate(act) == "tanh" else "gelu"
    if norm is None:
        new = _meta_module(remat_nn.MLP, fc1.in_features, fc1.out_features, activation, recompute=recompute)
    else:
        new = _meta_module(remat_nn.LayerNormMLP, fc1.in_features, fc1.out_features, activation,
                           recompute=recompute)
        new.norm = norm
    new.fc1, new.fc2 = fc1, fc2
    new.__dict__["remat_activation"] = act  # not a submodule (keys unchanged): for revert, and fallbacks
    return new


# ---------------------------------------------------------------------------------------------
# Attention: nn.MultiheadAttention with remat's self-attention path
# ---------------------------------------------------------------------------------------------


def _is_causal_mask(mask, seq):
    """True when `mask` is exactly the (seq, seq) causal mask (bool: True = masked; float: -inf above).

    Under torch.compile only the shape is checked: the values would have to come back to the
    host, a graph break. The caller's is_causal=True hint is then trusted, as
    nn.MultiheadAttention itself trusts it for need_weights=False without key_padding_mask
    (it drops the mask and runs causal attention).
    """
    if mask.shape != (seq, seq):
        return False
    if torch.compiler.is_compiling():
        return True
    upper = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, upper))
    return bool(((mask == float("-inf")) == upper).all() and (mask.masked_fill(upper, 0) == 0).all())


class RematMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention whose self-attention runs on remat.attention.

    Same constructor, parameters, state_dict keys and call convention. remat's path runs when
    the call is self-attention (query is key is value, a 3-D batch), need_weights=False, no
    key_padding_mask, attn_mask None (or exactly the causal mask with is_causal=True; under
    torch.compile any (seq, seq) mask with is_causal=True, see _is_causal_mask), no dropout in
    effect, a packed in-projection without bias_k/add_zero_attn, and the input in the parameters'
    dtype or autocast on. Every other call runs the stock
    nn.MultiheadAttention.forward, so conversion never breaks a model that worked. The
    remat path returns (output, None): no attention weights, as need_weights=False does.
    Autograd then keeps q, k, v, the output and fp32 log-sum-exps, never seq x seq.
    """

    def remat_path(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """None when the remat path applies to this call, else the reason it does not."""
        if key is not query or value is not query:
            return "not self-attention"
        if need_weights:
            return "need_weights=True"
        if key_padding_mask is not None:
            return "key_padding_mask"
        if query.dim() != 3:
            return "unbatched input"
        if not self._qkv_same_embed_dim or self.bias_k is not None or self.add_zero_attn:
            return "unpacked in-projection, bias_k or add_zero_attn"
        if self.dropout > 0 and self.training:
            return "attention dropout"
        # Under autocast the projections autocast, as torch's own do; outside it, a dtype mismatch is
        # torch's error, which the stock forward raises.
        if autocast_dtype(query.device.type) is None and query.dtype != self.in_proj_weight.dtype:
            return "input dtype differs from the parameters'"
        if attn_mask is not None:
            seq = query.shape[1] if self.batch_first else query.shape[0]
            if not (is_causal and _is_causal_mask(attn_mask, seq)):
                return "attn_mask other than the causal mask"
        elif is_causal:
            return "is_causal without attn_mask"
        return None

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        reason = self.remat_path(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if reason is not None:
            fallback(self, reason)
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        x = query if self.batch_first else query.transpose(0, 1)
        out = multihead_self_attention(
            x, self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias,
            self.num_heads, self.num_heads, attn_mask is not None,
        )
        return (out if self.batch_first else out.transpose(0, 1)), None


def _with_class(module, cls):
    """A shallow copy of `module` as class `cls` (a stock class or its state-free remat subclass):
    the same parameter, buffer and submodule objects."""
    new = copy.copy(module)
    new.__class__ = cls
    return new


# ---------------------------------------------------------------------------------------------
# nn.Sequential with fused runs, keeping the original state_dict keys
# ---------------------------------------------------------------------------------------------


class RematSequential(nn.Sequential):
    """An nn.Sequential in which runs of children were fused by remat.convert.

    The fused module sits at the run's first index and nn.Identity at the others, so the
    default forward is unchanged. `remat_runs` maps the fused child's name to
    {submodule name: original child name}, e.g. {"0": {"norm": "0", "linear": "1"}};
    state_dict() and load_state_dict() translate through it, so keys are the original ones.
    """

    remat_runs: dict  # set by remat.convert on the instance

    def _to_original(self, prefix):
        """{fused key prefix: original key prefix}, e.g. {"seq.0.linear.": "seq.1."}."""
        return {f"{prefix}{first}.{sub}.": f"{prefix}{orig}."
                for first, subs in self.remat_runs.items() for sub, orig in subs.items()}

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        local = collections.OrderedDict()
        local._metadata = collections.OrderedDict()
        super().state_dict(*args, destination=local, prefix=prefix, keep_vars=keep_vars)
        renames = self._to_original(prefix)

        def original_key(key):
            for fused, orig in renames.items():
                if key.startswith(fused):
                    return orig + key[len(fused):]
            return key

        order = {name: i for i, name in enumerate(self._modules)}

        def position(key):  # the original child's position, for the original order
            return order.get(key[len(prefix):].split(".", 1)[0], -1)

        items = sorted(((original_key(k), v) for k, v in local.items()), key=lambda kv: position(kv[0]))
        if destination is None:
            destination = collections.OrderedDict()
            destination._metadata = collections.OrderedDict()
        destination.update(items)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None:
            fused_children = {f"{prefix}{first}" for first in self.remat_runs}
            for key, value in local._metadata.items():
                mapped = original_key(key + ".")[:-1]
                if key in fused_children:
                    continue  # the fused module itself: no counterpart in the original
                metadata[mapped] = value
        return destination

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Original keys -> fused keys, before the children read theirs from this same dict.
        for first, subs in self.remat_runs.items():
            fused = self._modules[first]
            for sub, orig in subs.items():
                names = set(fused.get_submodule(sub).state_dict(keep_vars=True))
                for name in names:
                    old = f"{prefix}{orig}.{name}"
                    if old in state_dict:
                        state_dict[f"{prefix}{first}.{sub}.{name}"] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def _sequential_runs(seq, layers, recompute, path, report):
    """Fuse runs among the children of the nn.Sequential `seq`; {child name: handled}."""
    names = list(seq._modules)
    children = [seq._modules[n] for n in names]
    runs, handled = {}, set()
    i = 0
    while i < len(children):
        fused = None
        m = children[i]
        window = children[i:i + 4]
        if "mlp" in layers and "layernorm" in layers and len(window) == 4 and type(m) is nn.LayerNorm \
                and type(window[1]) is nn.Linear and type(window[3]) is nn.Linear:
            norm, fc1, act, fc2 = window
            reason = mlp_fusable(fc1, act, fc2) or layer_norm_fusable(norm, fc1.in_features, need_bias=True) \
                or uniform_reason(norm, fc1, fc2)
            if reason is None:
                fused = (fused_mlp(norm, fc1, act, fc2, recompute), {"norm": 0, "fc1": 1, "fc2": 3}, 4)
            else:
                report.add(_join(path, names[i]), m, "skipped", f"LayerNormMLP: {reason}")
        if fused is None and "mlp" in layers and len(window) >= 3 and type(m) is nn.Linear \
                and type(window[2]) is nn.Linear and gelu_approximate(window[1]) is not None:
            fc1, act, fc2 = window[:3]
            reason = mlp_fusable(fc1, act, fc2)
            if reason is None:
                fused = (fused_mlp(None, fc1, act, fc2, recompute), {"fc1": 0, "fc2": 2}, 3)
            else:
                report.add(_join(path, names[i]), m, "skipped", f"MLP: {reason}")
        if fused is None and "layernorm" in layers and len(window) >= 2 and type(m) is nn.LayerNorm \
                and type(window[1]) is nn.Linear:
            norm, linear = window[:2]
            reason = layer_norm_fusable(norm, linear.in_features) or hook_reason(linear) \
                or uniform_reason(norm, linear)
            if reason is None:
                fused = (fused_layer_norm_linear(norm, linear, recompute), {"norm": 0, "linear": 1}, 2)
            else:
                report.add(_join(path, names[i]), m, "skipped", f"LayerNormLinear: {reason}")
        if fused is None:
            i += 1
            continue
        module, subs, length = fused
        members = names[i:i + length]
        seq._modules[members[0]] = module
        for name in members[1:]:
            seq._modules[name] = nn.Identity()
        runs[members[0]] = {sub: names[i + offset] for sub, offset in subs.items()}
        handled.update(members)
        types = ", ".join(type(c).__name__ for c in children[i:i + length])
        report.add(_join(path, members[0]), children[i], f"swapped to {type(module).__name__}",
                   f"fused ({types}) from {members[0]} to {members[-1]}; Identity at the rest",
                   module.saved_bytes_per_token)
        i += length
    if runs:
        seq.__class__ = RematSequential
        seq.remat_runs = runs
    return handled


def _join(path, name):
    return f"{path}.{name}" if path else name


# ---------------------------------------------------------------------------------------------
# torch.fx: the same fusions inside any module's own forward
# ---------------------------------------------------------------------------------------------
#
# A module such as
#
#     def forward(self, x):
#         x = x + self.attn(self.ln1(x))
#         return x + self.fc2(self.act(self.fc1(self.ln2(x))))
#
# holds its layers as attributes, so module structure alone does not say which feeds which.
# torch.fx records the forward as a graph of calls; where a LayerNorm's (or an fc1 -> GELU's)
# output goes to the next Linear and nowhere else, the run becomes one call of remat's fused
# function on the same submodules. The module keeps its class, submodules, parameters and
# state_dict; only its forward becomes the rewritten graph, and only for calls like the traced
# one (FxRewrite.arguments): any other call runs the original forward.


class _OwnForwardTracer(torch.fx.Tracer):
    """Records the module's own forward: every submodule call stays one call_module node, never
    inlined, so submodules keep their hooks and mode-dependent code and are converted on their own."""

    def is_leaf_module(self, module, qualified_name):
        return True


# kind: "LayerNormLinear", "MLP" or "LayerNormMLP"; nodes: the run's graph nodes; targets: their
# modules' names (None for F.gelu); approximate: the GELU's, for the MLPs.
Fusion = collections.namedtuple("Fusion", "kind nodes targets approximate")

_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()


def _is_plain(value):
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def _plain_state(module):
    """The module's own public scalar attributes: the trace read any of them as constants."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training" and _is_plain(v)}


def _unchanged(current, value):
    return _is_plain(current) and type(current) is type(value) and current == value


def _same_value(value, default):
    return value is default or (type(value) is type(default) and isinstance(default, _PLAIN) and value == default)


class FxRewrite:
    """What the fx path did to one module, and when its rewritten forward applies.

    programs: {training flag: forward generated from that mode's rewritten graph}. The trace
    fixed each argument with a default to that default and read the module's scalar attributes as
    constants, so a call runs the program only while both hold: defaulted arguments at their
    defaults, the same scalar attributes. Any other call runs the class's own forward: the same
    computation without the fusion. The fused submodules are looked up by name at each call, and
    each fused function runs them by their own forwards where they are no longer plain (hooks,
    another module, a wrapper other than peft's LoRA). fusions: ((kind, module names, training
    flag or None for both modes), ...).
    """

    def __init__(self, module, programs, required, defaults, positional, fused, fusions):
        self.programs = programs
        self.required, self.defaults = tuple(required), dict(defaults)  # argument names, {name: default}
        self.names = (*required, *defaults)
        self.positional = positional  # how many arguments may be passed by position
        self.state = _plain_state(module)
        self.fused = fused  # ((qualified name, module), ...): the submodules the programs no longer call
        self.fusions = fusions

    def arguments(self, module, args, kwargs):
        """The required arguments, in order, when this call may run the program; else None."""
        if len(args) > self.positional:
            return None  # the original forward raises the TypeError
        values = dict(zip(self.names, args))
        for name, value in kwargs.items():
            if name in values or name not in self.names:
                return None
            values[name] = value
        if any(name not in values for name in self.required):
            return None
        for name, default in self.defaults.items():
            if name in values and not _same_value(values[name], default):
                return None
        if not all(_unchanged(getattr(module, name, _MISSING), value) for name, value in self.state.items()):
            return None
        # The fused submodules are read at each call by name: the fused functions check them
        # then, and call whatever sits there now by its own forward where it is not plain.
        return [values[name] for name in self.required]


def _fx_forward(self, *args, **kwargs):
    """The forward of a module rewritten by the fx path (bound to the instance)."""
    rewrite = self.__dict__["remat_fx"]
    required = rewrite.arguments(self, args, kwargs)
    if required is None:
        return type(self).forward(self, *args, **kwargs)
    return rewrite.programs[self.training](self, *required)


def fx_layer_norm_linear(x, norm, linear, recompute, label):
    """linear(norm(x)) on remat.ops.fused, reading the modules' parameters at call time; by their
    own forwards where they are not plain any more (label: the run, for the warning)."""
    proj, reason = projection(linear, "the Linear")
    reason = remat_nn.norm_reason(norm, "the LayerNorm") or reason
    if reason:
        fallback(norm, reason, where=label)
        return linear(norm(x))
    return layer_norm_linear(x, norm.weight, norm.bias, proj.weight, proj.bias, norm.eps, recompute, proj.adapters)


def fx_mlp(x, norm, fc1, act, fc2, approximate, recompute, label):
    """fc2(gelu(fc1(norm(x)))) on remat.ops.fused; norm None for fc2(gelu(fc1(x))), act None for F.gelu."""
    first, reason = projection(fc1, "fc1")
    second, reason2 = projection(fc2, "fc2")
    reason = reason or reason2 or (remat_nn.norm_reason(norm, "the LayerNorm") if norm is not None else None)
    if reason is None and act is not None and gelu_approximate(act) != approximate:
        reason = f"the activation is now {type(act).__name__}"
    reason = reason or (f"the activation {hook_reason(act)}" if act is not None and hook_reason(act) else None)
    if reason:
        fallback(norm if norm is not None else fc1, reason, where=label)
        h = fc1(norm(x) if norm is not None else x)
        return fc2(act(h) if act is not None else F.gelu(h, approximate=approximate))
    norm_args = {} if norm is None else dict(norm_weight=norm.weight, norm_bias=norm.bias, eps=norm.eps,
                                             layer_norm=True)
    return mlp(x, first.weight, first.bias, second.weight, second.bias, approximate, recompute,
               fc1_adapters=first.adapters, fc2_adapters=second.adapters, **norm_args)


def _fx_owned(module):
    """Modules the fx path may rewrite: not torch's own (leaves, containers, and composites whose
    fast-path checks do not trace), not transformers' (remat.hf's rules), not remat's, not peft's
    (its wrappers run their own forwards; the fused layers compute LoRA layers in place)."""
    origin = type(module).__module__
    return not origin.startswith(("torch.", "transformers.", "remat.", "peft.")) \
        and not isinstance(module, FUSED_TYPES) and not getattr(module, "remat_fused", False)


def fx_candidate(module):
    """True when `module`'s forward may hold a run to fuse: its layers (direct, or in a
    ModuleList/ModuleDict) include a LayerNorm and a Linear, or two Linears."""
    if "remat_fx" in vars(module) or not _fx_owned(module):
        return False
    linears = norms = 0
    stack = list(module._modules.values())
    while stack:
        child = stack.pop()
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            stack.extend(child._modules.values())
        linears += isinstance(child, nn.Linear)
        norms += isinstance(child, nn.LayerNorm)
    return linears >= 2 or (linears >= 1 and norms >= 1)


def _forward_arguments(module):
    """(required names, {name: default}, how many may be positional) of module.forward, or why it is not traced."""
    required, defaults, positional = [], {}, 0
    for name, param in inspect.signature(module.forward).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            return f"not traced: forward takes {'*' if param.kind is param.VAR_POSITIONAL else '**'}{name}"
        if param.kind is param.POSITIONAL_ONLY:
            return f"not traced: forward's argument {name} is positional-only"
        positional += param.kind is param.POSITIONAL_OR_KEYWORD
        if param.default is not param.empty:
            defaults[name] = param.default
        elif param.kind is param.KEYWORD_ONLY:
            return f"not traced: forward's argument {name} is keyword-only without a default"
        else:
            required.append(name)
    return required, defaults, positional


def _trace(module, defaults, training):
    """The graph of module.forward in the given mode, each defaulted argument fixed to its default."""
    was = module.training
    module.training = training  # the module's own flag only: its submodules are called, not traced
    try:
        return _OwnForwardTracer().trace(module, concrete_args=dict(defaults))
    finally:
        module.training = was


# --- finding the runs in a graph ---


def _called(root, node, kind):
    """The submodule `node` calls on one positional argument when it is a `kind`, else None."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return None
    module = root.get_submodule(node.target)
    return module if isinstance(module, kind) else None


def _gelu_node(root, node):
    """"none" or "tanh" when `node` applies a GELU remat computes to its one input, else None."""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        return gelu_approximate(root.get_submodule(node.target))
    if node.op == "call_function" and node.target is F.gelu and len(node.args) == 1 \
            and set(node.kwargs) <= {"approximate"}:
        approximate = node.kwargs.get("approximate", "none")
        return approximate if approximate in ("none", "tanh") else None
    return None


def _target(node):
    return node.target if node.op == "call_module" else None


def _describe(nodes):
    return ", ".join(str(n.target) if n.op == "call_module" else n.name for n in nodes)


def _only_user(node, what):
    """(the single node that uses `node`'s value, None) or (None, why there is not one)."""
    users = list(node.users)
    if len(users) != 1:
        return None, (f"{what}'s output has {len(users)} users ({_describe(users)}); "
                      "fused only when the next layer is its only user")
    return users[0], None


def _mlp_tail(root, fc1_node):
    """((GELU node, fc2 node, approximate), None) when fc1's output goes through a GELU into a
    Linear and nowhere else; (None, why not) when it goes to a GELU otherwise; (None, None)
    when no GELU uses it (not an MLP run)."""
    if not any(_gelu_node(root, user) is not None for user in fc1_node.users):
        return None, None
    act, reason = _only_user(fc1_node, fc1_node.target)
    if act is None:
        return None, reason
    fc2_node, reason = _only_user(act, "the GELU")
    if fc2_node is None:
        return None, reason
    if _called(root, fc2_node, nn.Linear) is None:
        return None, (f"the GELU output goes to {_describe([fc2_node])}, not straight into an nn.Linear "
                      "(fused only with nothing in between)")
    return (act, fc2_node, _gelu_node(root, act)), None


def _act_module(root, act_node, approximate):
    """The GELU module the checks look at (for F.gelu, which has no hooks, an nn.GELU stand-in)."""
    if act_node.op == "call_module":
        return root.get_submodule(act_node.target)
    return nn.GELU(approximate)


def _runs(root, graph, layers):
    """([Fusion], [(module name, module, why skipped)]) for the runs in `graph`, in node order."""
    fusions, skips, taken = [], [], set()
    for node in graph.nodes:
        if node in taken:
            continue
        fusion = None
        norm = _called(root, node, nn.LayerNorm)
        if norm is not None and "layernorm" in layers:
            fusion = _norm_run(root, node, norm, layers, skips)
        linear = _called(root, node, nn.Linear)
        if fusion is None and linear is not None and "mlp" in layers:
            fusion = _mlp_run(root, node, linear, skips)
        if fusion is not None:
            fusions.append(fusion)
            taken.update(fusion.nodes)
    return fusions, skips


def _mlp_run(root, node, fc1, skips):
    """The MLP Fusion starting at the Linear `node`, or None (with a skip row where a GELU uses its output)."""
    tail, reason = _mlp_tail(root, node)
    if tail is not None:
        act, fc2_node, approximate = tail
        reason = mlp_fusable(fc1, _act_module(root, act, approximate), root.get_submodule(fc2_node.target))
        if reason is None:
            return Fusion("MLP", (node, act, fc2_node), (node.target, _target(act), fc2_node.target), approximate)
    if reason:
        skips.append((node.target, fc1, f"MLP: {reason}"))
    return None


def _norm_run(root, node, norm, layers, skips):
    """The Fusion starting at the LayerNorm `node` (LayerNormMLP before LayerNormLinear), or None
    (with a skip row where a Linear uses its output)."""
    if not any(_called(root, user, nn.Linear) is not None for user in node.users):
        return None  # the LayerNorm feeds no Linear: nothing to fuse it with
    fc1_node, reason = _only_user(node, node.target)
    if fc1_node is None:
        skips.append((node.target, norm, f"LayerNormLinear: {reason}"))
        return None
    fc1 = root.get_submodule(fc1_node.target)
    tail = _mlp_tail(root, fc1_node)[0] if "mlp" in layers else None
    if tail is not None:
        act, fc2_node, approximate = tail
        fc2 = root.get_submodule(fc2_node.target)
        reason = mlp_fusable(fc1, _act_module(root, act, approximate), fc2) \
            or layer_norm_fusable(norm, fc1.in_features, need_bias=True) or uniform_reason(norm, fc1, fc2)
        if reason is None:
            return Fusion("LayerNormMLP", (node, fc1_node, act, fc2_node),
                          (node.target, fc1_node.target, _target(act), fc2_node.target), approximate)
        skips.append((node.target, norm, f"LayerNormMLP: {reason}"))
    reason = (None if type(fc1) is nn.Linear else f"{fc1_node.target} is {type(fc1).__name__}, not exactly nn.Linear") \
        or layer_norm_fusable(norm, fc1.in_features) or hook_reason(fc1) or uniform_reason(norm, fc1)
    if reason is None:
        return Fusion("LayerNormLinear", (node, fc1_node), (node.target, fc1_node.target), None)
    skips.append((node.target, norm, f"LayerNormLinear: {reason}"))
    return None


# --- rewriting ---


def _fuse(graph, fusion, recompute, label_path):
    """Replace the run's nodes by one call of remat's fused function on the same submodules."""
    x, last = fusion.nodes[0].args[0], fusion.nodes[-1]
    with graph.inserting_before(last):  # after every input of the run
        label = f"{label_path} ({_run_names(fusion)})"
        if fusion.kind == "LayerNormLinear":
            norm, linear = (graph.get_attr(t) for t in fusion.targets)
            fused = graph.call_function(fx_layer_norm_linear, (x, norm, linear, recompute, label))
        else:
            norm = graph.get_attr(fusion.targets[0]) if fusion.kind == "LayerNormMLP" else None
            act_target = fusion.targets[-2]
            act = graph.get_attr(act_target) if act_target is not None else None
            fc1, fc2 = graph.get_attr(fusion.targets[-3]), graph.get_attr(fusion.targets[-1])
            fused = graph.call_function(fx_mlp, (x, norm, fc1, act, fc2, fusion.approximate, recompute, label))
    last.replace_all_uses_with(fused)
    for node in reversed(fusion.nodes):
        graph.erase_node(node)


def _program(module, graph):
    """The function torch.fx generates from `graph`: forward(self, ...), reading self's submodules."""
    graph.lint()
    return type(torch.fx.GraphModule(module, graph)).forward


def _run_names(fusion):
    return " -> ".join(t if t is not None else "F.gelu" for t in fusion.targets)


@contextlib.contextmanager
def _watching_mode_switches(seen):
    """Append to `seen` each grad, autocast or inference mode switch made inside: torch.no_grad(),
    torch.autocast() and the like run while tracing but leave nothing in the graph."""
    switches = ((torch._C, "_set_grad_enabled", "torch.no_grad, enable_grad or set_grad_enabled"),
                (torch, "set_autocast_enabled", "torch.autocast"),
                (torch._C, "_InferenceMode", "torch.inference_mode"))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in switches]

    def watched(label, original):
        def call(*args, **kwargs):
            seen.append(label)
            return original(*args, **kwargs)
        return call

    for (owner, name, original), (_, _, label) in zip(originals, switches):
        setattr(owner, name, watched(label, original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _restore_plain_state(module, state):
    """Put back the scalar attributes a traced forward changed (tracing runs it); returns their names."""
    after = _plain_state(module)
    changed = sorted(k for k in {*after, *state} if not _unchanged(after.get(k, _MISSING), state.get(k, _MISSING)))
    for name in changed:
        if name in state:
            setattr(module, name, state[name])
        else:
            delattr(module, name)
    return changed


def _traces(module, defaults):
    """{training flag: graph} (one graph for both when the forward does not depend on
    self.training), or why the graphs would not be the forward."""
    state, switches = _plain_state(module), []
    try:
        with _watching_mode_switches(switches):
            train, evaluate = (_trace(module, defaults, training) for training in (True, False))
    finally:
        changed = _restore_plain_state(module, state)
    if changed:
        return f"not rewritten: forward sets {', '.join(changed)}, which a torch.fx graph does not do"
    if switches:
        return (f"not rewritten: forward switches grad or autocast mode ({switches[0]}), "
                "which a torch.fx graph does not record")
    if train.python_code("self").src == evaluate.python_code("self").src:
        return {True: train}
    return {True: train, False: evaluate}


def fx_convert(module, layers, recompute, path, report):
    """Rewrite `module`'s forward with the fusions its fx traces prove; returns the ids of the fused submodules."""
    signature = _forward_arguments(module)
    if isinstance(signature, str):
        report.add(path, module, "skipped", signature)
        return set()
    required, defaults, positional = signature
    try:
        graphs = _traces(module, defaults)
    except Exception as error:  # noqa: BLE001 - whatever stops the trace, the module stays as it is
        lines = str(error).strip().splitlines() or [type(error).__name__]
        report.add(path, module, "skipped", f"does not trace: {lines[0][:200]}")
        return set()
    if isinstance(graphs, str):
        report.add(path, module, "skipped", graphs)
        return set()
    consumed, fusions = {}, []
    for training, graph in graphs.items():
        # Each mode's graph is rewritten by what its own trace proves.
        mode = "" if len(graphs) == 1 else f" (in {'train' if training else 'eval'} mode)"
        runs, skips = _runs(module, graph, layers)
        for target, sub, reason in skips:
            report.add(_join(path, target), sub, "skipped", reason + mode)
        for fusion in runs:
            _fuse(graph, fusion, recompute, path or "(root)")
            first = module.get_submodule(fusion.targets[0])
            report.add(_join(path, fusion.targets[0]), first, f"fused to {fusion.kind} (torch.fx)",
                       f"{_run_names(fusion)} in {type(module).__name__}.forward{mode}",
                       functools.partial(_fx_saved_bytes, weakref.ref(module), fusion.kind, fusion.targets))
            consumed.update((t, module.get_submodule(t)) for t in fusion.targets if t is not None)
            fusions.append((fusion.kind, fusion.targets, training if mode else None))
    if not fusions:
        return set()
    programs = {training: _program(module, graph) for training, graph in graphs.items()}
    programs.setdefault(False, programs[True])
    module.__dict__["remat_fx"] = FxRewrite(module, programs, required, defaults, positional,
                                            tuple(consumed.items()), tuple(fusions))
    module.__dict__["forward"] = types.MethodType(_fx_forward, module)
    return {id(m) for m in consumed.values()}


def _fx_saved_bytes(module_ref, kind, targets):
    """Bytes per token an fx fusion keeps less than stock, from its submodules as they are now."""
    module = module_ref()
    if module is None:
        return 0
    get = module.get_submodule
    if kind == "LayerNormLinear":
        return fused_saved_bytes(get(targets[0]), [get(targets[1])])
    norm = get(targets[0]) if kind == "LayerNormMLP" else None
    return fused_saved_bytes(norm, [get(targets[-3])], get(targets[-1]))


def fx_consumed(module):
    """The ids of the submodules a previous fx rewrite of `module` fused (empty when there was none)."""
    rewrite = vars(module).get("remat_fx")
    return {id(m) for _, m in rewrite.fused} if rewrite is not None else set()


def _fx_revert(module):
    """The original forward again: the rewrite only added an instance attribute over the class's forward."""
    del module.__dict__["forward"], module.__dict__["remat_fx"]


# ---------------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------------

FUSED_TYPES = (remat_nn.LayerNormLinear, remat_nn.MLP)  # LayerNormMLP is an MLP


def _leaf_swap(module, layers, path, report):
    """The replacement for a single module, or None (with a report row when it was a candidate)."""
    kind = type(module)
    if kind is nn.LayerNorm and "layernorm" in layers:
        reason = hook_reason(module)
        if reason is None:
            report.add(path, module, "swapped to remat.nn.LayerNorm")
            return remat_nn.LayerNorm.from_torch(module)
        report.add(path, module, "skipped", reason)
    elif kind is nn.GELU and "gelu" in layers:
        reason = hook_reason(module) or (None if gelu_approximate(module) else "unknown approximate")
        if reason is None:
            report.add(path, module, "swapped to remat.nn.GELU")
            return remat_nn.GELU(module.approximate)
        report.add(path, module, "skipped", reason)
    elif kind is nn.MultiheadAttention and "attention" in layers:
        reason = hook_reason(module)
        if reason is None:
            note = "self-attention calls with need_weights=False and no masks run remat.attention; others run torch"
            if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
                note = "kdim/vdim, bias_k or add_zero_attn: every call runs torch"
            report.add(path, module, "swapped to RematMultiheadAttention", note)
            return _with_class(module, RematMultiheadAttention)
        report.add(path, module, "skipped", reason)
    elif isinstance(module, (nn.LayerNorm, nn.GELU, nn.MultiheadAttention)) and not isinstance(
            module, (remat_nn.LayerNorm, remat_nn.GELU, RematMultiheadAttention)):
        report.add(path, module, "skipped", "subclass of a stock layer (its forward may differ)")
    elif _unsupported_kind(module):
        report.add(path, module, "skipped", _unsupported_kind(module))
    return None


GATED_MLP_NAMES = ({"gate_proj", "up_proj", "down_proj"}, {"gate_up_proj", "down_proj"}, {"w1", "w2", "w3"})


def _unsupported_kind(module):
    """Why a module remat recognises is not converted (RMSNorm, gated MLPs), or None."""
    if type(module).__name__.endswith("RMSNorm"):  # torch.nn.RMSNorm, LlamaRMSNorm, T5LayerNorm's kin
        return "RMSNorm: remat has no RMSNorm kernel yet; it runs as it is and saves nothing"
    children = set(module._modules)
    if any(names <= children for names in GATED_MLP_NAMES):
        return "gated MLP (act(gate) * up -> down): not fused yet; it runs as it is and saves nothing"
    return None


def _convert_children(parent, layers, recompute, path, report, hf_rules, consumed):
    """Convert below `parent`. consumed: ids of modules that fx rewrites call no more (left alone)."""
    handled = set()
    if hf_rules is not None:
        handled |= hf_rules.convert_children(parent, layers, recompute, path, report)
    if fx_candidate(parent) and ("mlp" in layers or "layernorm" in layers):
        consumed |= fx_convert(parent, layers, recompute, path, report)
    consumed |= fx_consumed(parent)
    if type(parent) is nn.Sequential and ("mlp" in layers or "layernorm" in layers):
        if hook_reason(parent) is not None:
            report.add(path, parent, "skipped", f"Sequential {hook_reason(parent)}: no fusion inside")
        elif any(id(child) in consumed for child in parent):
            report.add(path, parent, "skipped", "a forward rewritten by torch.fx calls its layers: no fusion inside")
        else:
            handled |= _sequential_runs(parent, layers, recompute, path, report)
    elif isinstance(parent, nn.Sequential) and not isinstance(parent, RematSequential):
        report.add(path, parent, "skipped", "nn.Sequential subclass: no fusion inside (forward may differ)")
    for name, child in list(parent._modules.items()):
        if child is None or name in handled or id(child) in consumed:
            continue
        child_path = _join(path, name)
        if isinstance(child, FUSED_TYPES) or getattr(child, "remat_fused", False):
            continue  # already converted
        new = _leaf_swap(child, layers, child_path, report)
        if new is not None:
            parent._modules[name] = new
        else:
            _convert_children(child, layers, recompute, child_path, report, hf_rules, consumed)


class RematWarning(UserWarning):
    """remat.convert found nothing to fuse: the converted model keeps as many activation bytes as before."""


def _peft_inner(model):
    """(the model a peft PeftModel and its tuner wrap, and its path in `model`), or (model, "").

    peft's wrappers are not transformers models and their forwards take *args: the family rules
    apply to the model inside, whose modules keep their names under base_model.model.
    """
    path = ""
    while type(model).__module__.startswith("peft."):
        name = next((n for n in ("base_model", "model") if isinstance(model._modules.get(n), nn.Module)), None)
        if name is None:
            break
        model, path = model._modules[name], _join(path, name)
    return model, path


def _layer_set(layers):
    if isinstance(layers, str):  # a single name, not its letters
        layers = (layers,)
    try:
        layers = frozenset(layers)
    except TypeError:
        raise TypeError(f"layers must be a name or a collection of names from {sorted(LAYERS)}, "
                        f"got {layers!r}") from None
    unknown = layers - LAYERS
    if unknown:
        raise ValueError(f"layers must be a subset of {sorted(LAYERS)}, got unknown {sorted(map(str, unknown))}")
    return layers


def convert(model, inplace=False, layers=LAYERS, recompute=True, report=False):
    """Swap `model`'s layers for remat's where that is provably the same computation.

    inplace: convert `model` itself (its parameters stay the same objects) instead of a deep
    copy. layers: which rules to apply, one of or a subset of {"layernorm", "gelu", "attention",
    "mlp"} ("layernorm" also fuses LayerNorm -> Linear; LayerNorm -> MLP needs "mlp" and
    "layernorm"). recompute: the fused layers' switch (False keeps what eager keeps, to compare).
    report: also return a ConversionReport (print it for a table, with the bytes each swap saves).

    Returns the converted model, or (model, report). state_dict keys are unchanged and the
    original checkpoint loads into the result. Hugging Face models (transformers
    PreTrainedModel, also inside a peft PeftModel) also get the family rules of remat.hf. Warns
    (RematWarning) when the conversion saves no activation memory at all.
    """
    layers = _layer_set(layers)
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be True or False, got {recompute!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    rows = ConversionReport()
    from . import hf

    inner, inner_path = _peft_inner(model)
    hf_rules = hf if hf.is_hf_model(inner) else None
    order = {path or "(root)": i for i, (path, _) in enumerate(model.named_modules())}
    root = _leaf_swap(model, layers, "", rows) if inner is model else None
    if root is not None:
        model = root
    else:
        _convert_children(inner, layers, recompute, inner_path, rows, hf_rules, set())
    rows.sort(key=lambda row: order.get(row.path, len(order)))  # rows in the model's module order
    rows.model = weakref.ref(model)
    if rows.saved_bytes_per_token() == 0:
        fused = "no fusion applies" if not rows.swapped else \
            f"{len(rows.swapped)} modules swapped, none of them keeping less than stock"
        warnings.warn(f"remat.convert saves no activation memory on this {type(inner).__name__}: {fused} "
                      "(convert(model, report=True) says why for each module)", RematWarning, stacklevel=2)
    return (model, rows) if report else model


# ---------------------------------------------------------------------------------------------
# Revert
# ---------------------------------------------------------------------------------------------


def _revert_sequential(seq):
    names = list(seq._modules)
    for first, subs in seq.remat_runs.items():
        fused = seq._modules[first]
        for sub, orig in subs.items():
            seq._modules[orig] = _revert_module(fused.get_submodule(sub))
        if isinstance(fused, remat_nn.MLP):  # the GELU between fc1 and fc2
            act_index = names[names.index(subs["fc1"]) + 1]
            seq._modules[act_index] = fused.__dict__["remat_activation"]
    seq.__class__ = nn.Sequential
    del seq.remat_runs


def _revert_module(module):
    for name in ("remat_fallbacks", "remat_verified"):  # left on stock modules by fallbacks and LoRA checks
        module.__dict__.pop(name, None)
    if type(module) is remat_nn.LayerNorm:
        return _with_class(module, nn.LayerNorm)
    if type(module) is remat_nn.GELU:
        return nn.GELU(module.approximate)
    if type(module) is RematMultiheadAttention:
        return _with_class(module, nn.MultiheadAttention)
    if "remat_fx" in vars(module):
        _fx_revert(module)
    revert_fn = getattr(module, "remat_revert", None)
    if revert_fn is not None:
        module = revert_fn()
    if isinstance(module, RematSequential):
        _revert_sequential(module)
    for name, child in list(module._modules.items()):
        if child is not None:
            module._modules[name] = _revert_module(child)
    return module


def revert(model):
    """Undo remat.convert in place: stock modules again, holding the same parameters. Returns the model."""
    return _revert_module(model)
