"""The swapped transformers modules: each is the stock instance with a remat class mixed in
(same submodules, parameters and attributes), computing what the stock forward computes on
remat's fused ops, and the stock forward itself for any call those do not compute exactly.

Handoff links a module whose work the next module does (a pre-LN LayerNorm, BERT's intermediate)
to that module; bloom.py's attention, the one module swapped by its class, subclasses _RematModule.
"""

import collections
import sys
import weakref

import torch
from torch import nn

from ... import _tensor_parallel as tensor_parallel
from ... import _zero3 as zero3
from ..._guards import decided, fallback, hook_reason, kept_under, plain_reason
from ..._linears import decided_projections, fused_saved_bytes, plain_linear, projection, projections, widths
from ..._tensor_memo import MISSING, TensorMemo
from ...ops.fused import Checked, SharedStatistics, fused_mlp, norm_linears
from ...specs import Activation, gelu, norm_of
from ..patterns import (
    MLP,
    activation_reason,
    fusable,
    gated_activation_name,
    gated_activation_reason,
    gelu_approximate,
    uniform_reason,
)
from ..swap import strip

# A transformers MLP module: the names of its fc1, activation, fc2 and (or None) dropout, and the
# remat class it is swapped to (None: _RematMLP). A gated MLP (mixin
# _RematGatedMLP) names its (gate, up) projections as fc1, or its one gate_up projection. The dropout
# is after fc2 in a plain MLP (applied by the fused one too), before fc2 in a gated one (T5's: fused
# while it does nothing).
MLPParts = collections.namedtuple("MLPParts", "fc1 act fc2 dropout mixin", defaults=(None,))


def fc1_names(parts):
    """The names of the projections reading an MLP's input: (fc1,), or a gated MLP's (gate, up)."""
    return parts.fc1 if isinstance(parts.fc1, tuple) else (parts.fc1,)


# ---------------------------------------------------------------------------------------------
# Handoffs: a module's work done, fused, by the module after it
# ---------------------------------------------------------------------------------------------


def submodule(layer, path):
    """The module at the dotted `path` below `layer` ("self_attention.query_key_value"), or None."""
    module = layer
    for name in path.split("."):
        module = module._modules.get(name) if module is not None else None
    return module


def _path_modules(layer, path):
    """The modules along `path` below `layer`, the last one at `path` (None where one is missing)."""
    modules, module = [], layer
    for name in path.split("."):
        module = module._modules.get(name) if module is not None else None
        modules.append(module)
    return modules


def _attribute(layer, path, default=0):
    """The attribute at the dotted `path` below `layer` (a dropout probability, a setting), or `default`."""
    owner_path, _, name = path.rpartition(".")
    return getattr(submodule(layer, owner_path) if owner_path else layer, name, default)


class Handoff:
    """Work moved from modules of a layer to a module after them: each producer (a pre-LN LayerNorm,
    BERT's intermediate, the fc1 and activation a layer holds itself) returns its input unchanged,
    and each consumer does the producers' work inside its own fused op (a pre-LN LayerNorm into the
    q/k/v projection or fc1; BERT's intermediate into its output; a layer's fc1 and activation into
    its fc2). A LayerNorm whose output feeds several modules (a parallel attention and
    MLP) has several consumers, each applying it inside its own op.

    producers: {role: path}, the roles ("norm", "intermediate", "fc1", "act") naming what each
    consumer reads; consumers: paths. Paths are dotted below the layer ("fc1",
    "self_attention.query_key_value"). dropout: the names of the layer attributes holding the
    probability of a dropout the layer's forward applies between a producer and its consumer
    (BART's activation_dropout, and any other attribute that held the same value at convert time):
    the handoff holds only while that dropout does nothing (each of them 0, or the layer in eval mode).
    settings: ((dotted attribute path, value), ...) the forward of a module holding producers and their
    consumer read when the probe saw it call them (BloomMLP's pretraining_tp and slow_but_exact): the
    handoff holds only while each is the value it was (another may take a path that calls no consumer).

    A LayerNorm with several consumers gets one SharedStatistics (statistics): the first consumer's
    fused op leaves its fp32 statistics there, and the next ones, applying it to the same x, keep
    those instead of their own, so the layer keeps x and the statistics once. Consumers that are
    projections of a stock module (q, k and v of an attention run through the interface) share one
    SiblingOutputs (outputs): the first one called computes all of them in one fused op.

    It holds only while every member sits in its place in the layer without hooks, and so do the
    modules between the layer and it (checked at every call: by each producer, and by a consumer
    not called on the tensor its producer handed over): otherwise each producer runs its own
    forward and each consumer takes what it gets, as stock. The layer is held
    by a weak reference; a deepcopy of the whole model points the copy at the copied layer, while a
    copy of one member alone keeps pointing at the original layer, where it does not sit, so the
    copy computes itself.
    """

    def __init__(self, layer, producers, consumers, dropout=(), settings=()):
        self._layer = weakref.ref(layer)
        self.producers, self.consumers, self.dropout = dict(producers), tuple(consumers), tuple(dropout)
        self.settings = tuple(settings)
        self.statistics = SharedStatistics() if len(self.consumers) > 1 else None
        self.outputs = SiblingOutputs() if len(self.consumers) > 1 else None
        self._given = TensorMemo()  # the verdict for the tensor a producer handed over
        self._fed = TensorMemo()  # that tensor, until the next hand-over (reaches)

    def reason(self):
        """None while the handoff holds, else why not: decided again only when the modules it watches
        (_watched), or their fingerprint, changed."""
        layer = self._layer()
        if layer is None:
            return "the layer holding it is gone"
        state = tuple(_attribute(layer, name) for name in (*self.dropout, *(path for path, _ in self.settings))) \
            if self.dropout or self.settings else ()
        return decided(self, self._watched(layer), lambda: self._reason(layer), extra=state)

    def verdict(self):
        """The verdict reason() kept, as an object a consumer's own check is kept under (_guards.decided's
        under): it watched every module the consumers' fused ops read. Ask right after reason() (received)."""
        return self.__dict__.get("remat_decided")

    def _watched(self, layer):
        """The layer, every module along the paths, and each consumer's children (an MLP's projections
        and activation, which its fused op reads): what the handoff's verdict is kept for."""
        modules, (steps, consumers) = [layer], self._walk
        for parent, name in steps:
            owner = modules[parent]
            modules.append(owner._modules.get(name) if owner is not None else None)
        for index in consumers:
            if modules[index] is not None:
                modules.extend(modules[index]._modules.values())
        return modules

    def give(self, x):
        """reason(), left for `x`, the tensor a producer hands over unchanged: the consumer called on
        that very tensor acts on the same verdict (received) without deciding again. Not while
        torch.compile traces (the graph's guards stand for the checks)."""
        reason = self.reason()
        if not torch.compiler.is_compiling():
            self._given.put(x, reason)
            self._fed.put(x, None)
        return reason

    def _lend(self, layer):
        """ZeRO-3: the producers' parameters gathered with each consumer's, which reads them (_zero3.py).
        Asked with the handoff's check: deepspeed.initialize partitions the parameters and hooks every
        module at once, which changes the fingerprint the check is kept under."""
        zero3.lend([submodule(layer, path) for path in self.producers.values()],
                   [submodule(layer, path) for path in self.consumers])

    def reaches(self, x):
        """Whether `x` is the tensor a producer handed over at its last call, or a view of it (a mixture of
        experts' block flattens its tokens before routing them): the consumer is fed by the layer, not
        called apart from it, when it computes stock. Taken as so while torch.compile traces (no memo
        there: the graph was traced from the layer's call)."""
        if torch.compiler.is_compiling():
            return True
        return self._fed.get(x) is not MISSING or (x._base is not None and self._fed.get(x._base) is not MISSING)

    def received(self, x):
        """The verdict given for `x` (taken: once), else reason()."""
        if torch.compiler.is_compiling():
            return self.reason()
        given = self._given.get(x)
        self._given.clear()
        return self.reason() if given is MISSING else given

    def _reason(self, layer):
        for path in self._paths:
            modules = _path_modules(layer, path)
            if modules[-1] is None or modules[-1].__dict__.get("remat_handoff") is not self:
                base = getattr(modules[-1], "base_layer", None)
                if base is not None and base.__dict__.get("remat_handoff") is self:
                    return (f"{path} was wrapped by {type(modules[-1]).__name__} after convert (remat.revert, then "
                            "remat.convert the model to fuse it)")
                return f"{path} is no longer the module converted"
            reason = next(filter(None, map(_between_reason, modules)), None)
            if reason:
                return f"{path} {reason}"
        changed = self._changed_setting(layer)
        if changed:
            path, now, value = changed
            return f"{path} is {now!r}, not the {value!r} its forward was probed with"
        dropping = [name for name in self.dropout if _attribute(layer, name) > 0] if layer.training else []
        if dropping:
            return f"{dropping[0]} (p={_attribute(layer, dropping[0])}) in training"
        self._lend(layer)
        return None

    @property
    def _paths(self):
        return (*self.producers.values(), *self.consumers)

    @property
    def _along(self):
        """Every path to a module along the paths, once, parents first ("self_attn", "self_attn.q_proj", ...)."""
        along = self.__dict__.get("_along_paths")
        if along is None:
            along = self._along_paths = tuple(dict.fromkeys(
                ".".join(path.split(".")[:i]) for path in self._paths for i in range(1, path.count(".") + 2)))
        return along

    @property
    def _walk(self):
        """((index of its parent in _watched's list, 0 the layer; its name) of each module along the paths,
        the consumers' indices in that list), worked out once."""
        walk = self.__dict__.get("_walk_steps")
        if walk is None:
            index = {"": 0, **{path: i + 1 for i, path in enumerate(self._along)}}
            steps = tuple((index[path.rpartition(".")[0]], path.rpartition(".")[2]) for path in self._along)
            walk = self._walk_steps = steps, tuple(index[path] for path in self.consumers)
        return walk

    def consumer_replaced(self):
        """Whether a consumer's place holds a module of its own now, which does not say why the handoff
        broke (peft's merge_and_unload puts a LoRA layer's plain base layer back)."""
        def says(module):  # a consumer, or one wrapped by peft after convert (its base layer says it)
            return any(m is not None and m.__dict__.get("remat_handoff") is self
                       for m in (module, getattr(module, "base_layer", None)))

        layer = self._layer()
        return layer is not None and not all(says(_path_modules(layer, path)[-1]) for path in self.consumers)

    def unheard(self, producer):
        """Whether `producer` is to say why the handoff broke, no consumer being called to say it: its
        first producer, where a consumer's place holds a module of its own (consumer_replaced) or a
        setting changed (the holder's forward then takes a path that calls no consumer)."""
        layer = self._layer()
        if layer is None or submodule(layer, next(iter(self.producers.values()))) is not producer:
            return False
        return self.consumer_replaced() or self._changed_setting(layer) is not None

    def _changed_setting(self, layer):
        """(path, value now, value probed) of the first setting that changed, or None."""
        for path, value in self.settings:
            now = _attribute(layer, path, None)
            if now != value:
                return path, now, value
        return None

    def consumer_modules(self):
        """The modules at the consumers' paths (call only while reason() is None)."""
        return [submodule(self._layer(), path) for path in self.consumers]

    def source(self, role="norm"):
        """The producer of `role` (call only while reason() is None), or None when it has none."""
        path = self.producers.get(role)
        return submodule(self._layer(), path) if path is not None else None

    def __deepcopy__(self, memo):
        layer = self._layer()
        new = Handoff.__new__(Handoff)
        memo[id(self)] = new
        new._layer = weakref.ref(memo.get(id(layer), layer)) if layer is not None else self._layer
        new.producers, new.consumers, new.dropout = dict(self.producers), self.consumers, self.dropout
        new.settings = self.settings
        new.statistics = SharedStatistics() if self.statistics is not None else None
        new.outputs = SiblingOutputs() if self.outputs is not None else None
        new._given, new._fed = TensorMemo(), TensorMemo()
        return new

    def __reduce__(self):  # pickling a model: the layer itself, which pickle keeps once
        return Handoff, (self._layer(), self.producers, self.consumers, self.dropout, self.settings)


class SiblingOutputs:
    """The outputs of a norm's projections that a stock module calls one after the other on the same
    input (q_proj, k_proj and v_proj), computed by one norm_linears call at the first one's call and
    handed to each of the others when it is called on the same tensor, unmodified: x is read and
    normalised once, in one op. A sibling called on anything else computes its own output."""

    def __init__(self):
        self._stored = TensorMemo()  # {id(module): its output}, for x

    def take(self, module, x):
        """`module`'s output stored for `x`, once, or None."""
        outputs = self._stored.get(x)
        if outputs is MISSING:
            return None
        out = outputs.pop(id(module), None)
        if not outputs:
            self._stored.clear()
        return out

    def store(self, x, outputs):
        self._stored.put(x, outputs)


def _records_outputs(hook):
    """A forward hook of transformers' output capturing, installed on a model's attention modules
    and layers the first time it is called with output_attentions or output_hidden_states: it reads
    what the module returns (the attention weights), and the input of a layer only."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _between_reason(module):
    """hook_reason of a module between a layer and a handoff's member, whose own forward runs (the
    attention holding q_proj): its input is the norm's input instead of its output then, which
    transformers' output recorders do not read, nor the hooks of remat's fused q/k norms
    (head_norm.py: they read the call's position_embeddings and cache, and change nothing)."""
    skip = tuple(name for name in ("_forward_hooks", "_forward_pre_hooks")
                 if getattr(module, name) and all(map(_reads_no_input, getattr(module, name).values())))
    return hook_reason(module, skip)


def _reads_no_input(hook):
    """Whether a hook may see a norm's input in place of its output: transformers' output recorders and
    the hooks of remat's fused q/k norms do not read it; tensor parallel's layout hooks (parallelize_module)
    only place it on the ranks, by tokens or whole, and the member a handoff reaches through them checks the
    placement its input arrives in (_tensor_parallel.column_input); ZeRO-3's gather the module's parameters
    and set up its backward, and those a producer hands over are lent to its consumers (Handoff.give)."""
    return _records_outputs(hook) or getattr(hook, "remat_reads_no_hidden_states", False) or \
        tensor_parallel.is_layout_hook(hook) or zero3.is_hook(hook)


def link(layer, members, producers, consumers, dropout=(), settings=()):
    """One Handoff in `layer` for the new modules `members` ({path: module}, not installed yet)."""
    handoff = Handoff(layer, producers, consumers, dropout, settings)
    for module in members.values():
        module.__dict__["remat_handoff"] = handoff
    return handoff


def _handed_over(module, x, role="norm"):
    """(the producer of `role` whose work `module` does at this call on `x`, or None; why a handoff
    no longer holds, or None)."""
    handoff = module.__dict__.get("remat_handoff")
    if handoff is None:
        return None, None
    reason = handoff.received(x)
    return (None, _not_fused(handoff, reason)) if reason else (handoff.source(role), None)


def fed_norm(module, x):
    """(the norm the producer of `module`'s handoff handed `x` over for, or None: x is the norm's input, or
    a view of it; why the handoff no longer holds, or None). None, None where `module` is called apart
    from its layer (x is not what the norm handed over): x is then what it reads, as stock."""
    handoff = module.__dict__.get("remat_handoff")
    if handoff is None or not handoff.reaches(x):
        return None, None
    reason = handoff.reason()
    return (None, _not_fused(handoff, reason)) if reason else (handoff.source("norm"), None)


def _under(module, norm):
    """The verdict of `module`'s handoff while it holds at this call (`norm` handed over), which watched
    every module `module`'s fused op reads: its own check is kept under it (_guards.decided); else None."""
    return module.remat_handoff.verdict() if norm is not None else None


def _shared_statistics(module):
    """The SharedStatistics of the norm `module` applies, when other modules apply it too, or None."""
    handoff = module.__dict__.get("remat_handoff")
    return handoff.statistics if handoff is not None else None


def _not_fused(handoff, reason):
    names = list(handoff.producers.values())
    return f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} not fused any more: {reason}"


_REMAT_CLASSES = {}


def remat_class(mixin, stock_class, **attributes):
    """Remat<Stock>(mixin, stock): the class a stock transformers module is swapped to, with the
    class `attributes` the structure gives (an MLP's submodule names)."""
    key = (mixin, stock_class, tuple(sorted(attributes.items())))
    cls = _REMAT_CLASSES.get(key)
    if cls is None:
        name = f"{mixin.remat_prefix}{stock_class.__name__}"
        fixed = {"remat_stock": stock_class, **attributes, "__module__": __name__, "__qualname__": name}
        cls = type(name, (mixin, stock_class), fixed)
        globals()[name] = cls  # importable by name, so a converted model pickles
        _REMAT_CLASSES[key] = cls
    return cls


def record_call(module, reason, **where):
    """Record why a call of a converted module ran stock (None: its remat path ran): in the convert
    probe's trace while the probe runs, else as a fallback (a RematFallbackWarning; `where`: fallback's
    where and runs)."""
    trace = module.__dict__.get("remat_trace")
    if trace is not None:  # set by the conversion probe only
        trace.append(reason)
    elif reason is not None:
        fallback(module, reason, **where)


class _RematModule:
    """What every swapped transformers module shares: the probe's trace, fallbacks, revert."""

    remat_fused = True
    remat_prefix = "Remat"  # the swapped class is named remat_prefix + the stock class's name
    remat_stock: type  # the stock class

    def _remat_fallback(self, reason):
        """Record a call that runs stock (or the probe's trace of it)."""
        record_call(self, reason)

    def remat_revert(self):
        return strip(self, self.remat_stock)


class _RematFusedNorm(_RematModule):
    """A pre-norm block's norm (an nn.LayerNorm, or a transformers RMSNorm class: LlamaRMSNorm,
    GemmaRMSNorm, ...) whose consumer (the attention's q/k/v projection or the MLP's first
    projection) applies it, fused: while their handoff holds, forward returns its input; otherwise
    the stock module's own forward runs. Still an instance of its stock class with its own weight
    and eps (same objects, same state_dict keys, found by isinstance checks such as weight-decay
    groups); remat_revert() gives the stock module back."""

    remat_prefix = "RematFused"
    remat_style = None  # None: a LayerNorm; else the RMSNorm rounding (remat.specs.RMS_NORM_STYLES)

    def forward(self, hidden_states):
        reason = self.remat_handoff.give(hidden_states)
        if reason is None:
            return hidden_states
        if self.remat_handoff.unheard(self):  # no consumer says it: said here
            self._remat_fallback(_not_fused(self.remat_handoff, reason))
        return self.remat_stock.forward(self, hidden_states)

    def extra_repr(self):
        return f"{super().extra_repr()}, applied fused by the next projection"


class RematFusedLayerNorm(_RematFusedNorm, nn.LayerNorm):
    """The fused norm of an nn.LayerNorm (see _RematFusedNorm)."""

    remat_stock = nn.LayerNorm


def stock_norm(norm, hidden_states):
    """What the fused norm `norm` computes by its stock module's own forward."""
    return norm.remat_stock.forward(norm, hidden_states)


def norm_spec(norm):
    """The remat.specs.Norm of the fused norm `norm`: a LayerNorm, or an RMSNorm in its style."""
    return norm_of(norm, norm.remat_style)


def _layer_norm_reason(norm):
    """Why a fused norm's parameters cannot be read by a fused op at this call, or None (also when there is none)."""
    return plain_reason(norm, (type(norm),), "the fused norm", zero3.is_hook) if norm is not None else None


# ---------------------------------------------------------------------------------------------
# The swapped MLP modules
# ---------------------------------------------------------------------------------------------


class _RematMLP(_RematModule):
    """A transformers MLP module (GPT2MLP, ViTMLP, PhiMLP, ...) on remat.mlp:
    dropout(fc2(gelu(fc1(x)))) keeping x and the fc1 output only, with the LayerNorm before it
    fused in when it was handed over. Any call remat cannot compute runs the stock forward."""

    remat_parts: "MLPParts"  # the stock module's submodule names, as the structure probe found them
    remat_need_bias = True  # remat.mlp takes LayerNorms with a bias only
    remat_dropped = "the GELU output is"  # what the report says it does not keep

    @classmethod
    def remat_parts_reason(cls, module, parts):
        """Why fc1 -> act -> fc2 of the stock `module` is not remat.mlp (fc1 and fc2 Linear-like,
        peft's LoRA included; a GELU), or None."""
        return fusable(MLP, [module._modules[n] for n in (parts.fc1, parts.act, parts.fc2)],
                       labels=["fc1", "activation", "fc2"])

    def forward(self, hidden_states):
        projections = [self._modules[self.remat_parts.fc1], self._modules[self.remat_parts.fc2]]
        with zero3.gathered(self, projections):  # it reads their parameters without calling them
            return self._remat_forward(hidden_states, projections)

    def _remat_forward(self, hidden_states, projections):
        parts = self.remat_parts
        norm, norm_reason = _handed_over(self, hidden_states)
        activation = self._modules[parts.act]
        linears, reason, checked = decided_projections(
            self, projections, [parts.fc1, parts.fc2], [activation, norm],
            lambda: activation_reason(activation, parts.act, allow=zero3.is_hook) or _layer_norm_reason(norm),
            zero3.is_hook, _under(self, norm))
        if reason:
            self._remat_fallback(reason)
            if norm is not None:
                hidden_states = stock_norm(norm, hidden_states)
            return self.remat_stock.forward(self, hidden_states)
        self._remat_fallback(norm_reason)
        act = gelu(gelu_approximate(activation))
        fc1, fc2 = linears
        out = fused_mlp(hidden_states, fc1, act, fc2, norm_spec(norm) if norm is not None else None,
                        self.remat_recompute, _shared_statistics(self), checked)
        return self._modules[parts.dropout](out) if parts.dropout else out

    def remat_saved_bytes(self):
        """Bytes per token this module keeps less than stock: the GELU output, where fc2 trains."""
        fc2 = self._modules[self.remat_parts.fc2]
        return fused_saved_bytes(fc2=fc2) if self.remat_recompute else 0

    def extra_repr(self):
        return f"on remat.mlp, recompute={self.remat_recompute}"


def _gated_widths_reason(names, shapes):
    """Why gate/up (or gate_up) and down of `shapes` ((in, out) each) do not chain, or None."""
    *ups, (ffn, out) = shapes
    if len(ups) == 2 and ups[0] != ups[1]:
        return f"{names[0]} and {names[1]} have different shapes (in, out) {ups[0]} and {ups[1]}"
    gated = ups[0][1] if len(ups) == 2 else ups[0][1] / 2
    if gated != ffn or out != ups[0][0]:
        return f"widths do not chain: {ups[0][0]}->{ups[0][1]} then {ffn}->{out}"
    return None


class _RematGatedMLP(_RematModule):
    """A transformers gated MLP (LlamaMLP, GemmaMLP, Phi3MLP, ...) on remat's fused gated MLP:
    down(act(gate(x)) * up(x)), or with one gate_up projection (gate first, as Phi-3's) chunked in
    two; keeps x, gate and up outputs only (never act(gate) nor the product), with the norm before
    it fused in when it was handed over. Any call remat cannot compute runs the stock forward."""

    remat_parts: "MLPParts"
    remat_need_bias = False  # the norm in front may be an RMSNorm, or a LayerNorm without bias
    remat_dropped = "act(gate) and act(gate) * up are"

    @classmethod
    def remat_parts_reason(cls, module, parts):
        """Why the stock `module`'s projections and activation are not a gated MLP remat fuses, or None."""
        linears = [module._modules[n] for n in (*fc1_names(parts), parts.fc2)]
        names = (*fc1_names(parts), parts.fc2)
        reason = next(filter(None, (projection(m, n)[1] for m, n in zip(linears, names))), None)
        reason = reason or gated_activation_reason(module._modules[parts.act], parts.act)
        return reason or _gated_widths_reason(names, [widths(m) for m in linears]) or uniform_reason(*linears)

    def forward(self, hidden_states):
        parts = self.remat_parts
        names = (*fc1_names(parts), parts.fc2)
        norm, norm_reason = _handed_over(self, hidden_states)
        modules = [self._modules[n] for n in names]
        if tensor_parallel.is_sharded(modules[-1]):
            return self._remat_tensor_parallel(hidden_states, norm, norm_reason, modules, names)
        with zero3.gathered(self, modules):  # it reads its projections' parameters without calling them
            return self._remat_forward(hidden_states, norm, norm_reason, modules, names)

    def _remat_forward(self, hidden_states, norm, norm_reason, modules, names):
        parts = self.remat_parts
        activation = self._modules[parts.act]
        linears, reason, checked = decided_projections(
            self, modules, list(names), [activation, norm],
            lambda: gated_activation_reason(activation, parts.act, allow=zero3.is_hook) or _layer_norm_reason(norm),
            zero3.is_hook, _under(self, norm))
        reason = reason or self.remat_call_reason()
        if reason:
            return self._remat_stock_call(reason, hidden_states, norm)
        self._remat_fallback(norm_reason)
        *ups, down = linears
        return fused_mlp(hidden_states, tuple(ups) if len(ups) == 2 else ups[0], self._remat_activation(), down,
                         norm_spec(norm) if norm is not None else None, self.remat_recompute,
                         _shared_statistics(self), checked)

    def _remat_activation(self):
        return Activation(gated_activation_name(self._modules[self.remat_parts.act]), gated=True)

    def _remat_stock_call(self, reason, hidden_states, norm):
        self._remat_fallback(reason)
        if norm is not None:
            hidden_states = stock_norm(norm, hidden_states)
        return self.remat_stock.forward(self, hidden_states)

    def _remat_tensor_parallel(self, hidden_states, norm, norm_reason, modules, names):
        """The call where parallelize_module sharded the projections (_tensor_parallel.py): the fused MLP
        on this rank's shards, torch's layout hooks and reductions around it; else the stock forward."""
        activation = self._modules[self.remat_parts.act]
        *ups, down = modules
        reason = decided(self, [*modules, activation, norm], lambda: tensor_parallel.mlp_reason(ups, down, names) or
                         gated_activation_reason(activation, self.remat_parts.act) or _layer_norm_reason(norm))
        reason = reason or self.remat_call_reason()
        x, layout_reason = (None, None) if reason else tensor_parallel.column_input(ups, hidden_states, names)
        if reason or layout_reason:
            return self._remat_stock_call(reason or layout_reason, hidden_states, norm)
        self._remat_fallback(norm_reason)
        spec = None if norm is None else tensor_parallel.norm_of_replicated(norm_spec(norm), down.weight.device_mesh)
        linears = [tensor_parallel.local_linear(m) for m in ups]
        partial = fused_mlp(x, tuple(linears) if len(linears) == 2 else linears[0], self._remat_activation(),
                            tensor_parallel.local_linear(down), spec, self.remat_recompute, _shared_statistics(self))
        return tensor_parallel.row_output(down, partial)

    def remat_call_reason(self):
        """Why this module's stock forward computes something else than down(act(gate(x)) * up(x)) now
        (T5's dropout before wo, in training), or None."""
        name = self.remat_parts.dropout
        if name is None:
            return None
        dropout = self._modules.get(name)
        if type(dropout) is not nn.Dropout:
            return f"its {name} before {self.remat_parts.fc2} is no longer an nn.Dropout"
        if self.training and dropout.p > 0:
            return f"{name} (p={dropout.p}) before {self.remat_parts.fc2} in training"
        return None

    def remat_saved_bytes(self):
        """Bytes per token kept less than stock: act(gate) and the product (down's input, where it trains)."""
        down = self._modules[self.remat_parts.fc2]
        return fused_saved_bytes(fc2=down, gated=True) if self.remat_recompute else 0

    def extra_repr(self):
        return f"on remat's fused gated MLP, recompute={self.remat_recompute}"


class _RematPassThrough(_RematModule):
    """A module whose work the consumer of its handoff does inside its fused op (BertIntermediate;
    the fc1 and activation a layer holds itself): returns its input while the handoff holds."""

    def forward(self, hidden_states, *args, **kwargs):
        reason = self.remat_handoff.give(hidden_states)
        if reason is None:
            return hidden_states
        if self.remat_handoff.unheard(self):  # no consumer says it: said here
            self._remat_fallback(_not_fused(self.remat_handoff, reason))
        return self.remat_stock.forward(self, hidden_states, *args, **kwargs)


_RematIntermediate = _RematPassThrough  # BertIntermediate's place: the output computes the whole FFN


class _RematFused(_RematPassThrough):
    """The fc1 Linear and the activation module a layer holds itself (BART, Whisper), whose work
    the layer's fc2 does (_RematLayerMLP)."""

    remat_prefix = "RematFused"


def _own_reason(module, label, allow=None):
    """Why the weights of a swapped nn.Linear, FalconLinear or Conv1D cannot be read by a fused op, or None
    (hooks allow(hook) takes not counted)."""
    return plain_reason(module, (type(module),), label, allow)


class _RematNormedLinear(_RematModule):
    """A Linear-like module (nn.Linear, FalconLinear or Conv1D) inside a module that stays stock (BLOOM's
    ALiBi attention's query_key_value, OPT's fc1 before its ReLU, the q/k/v projections of an attention
    run through the interface) with the LayerNorm before it fused in: norm_linears keeps x and fp32
    mean/rstd, never LN(x)."""

    remat_prefix = "RematNormed"
    remat_lora = False  # a peft LoRA layer (_RematNormedLoraLinear): its adapters are checked at every call

    def _remat_reason(self, allow=None):
        """Why the fused op cannot compute this module, or None (hooks allow(hook) takes not counted: ZeRO-3's
        where the fused op runs in this module's own call, which gathers its parameters)."""
        return _own_reason(self, self.remat_path, allow)

    def _remat_linear(self):
        """The remat.specs.Linear the fused op computes for this module (call where _remat_reason() is None)."""
        return plain_linear(self)  # read at every call: weights replaced in place stay seen

    def forward(self, input):
        if tensor_parallel.is_sharded(self):
            return self._remat_tensor_parallel(input)
        outputs = self.remat_handoff.outputs
        out = outputs.take(self, input) if outputs is not None else None
        if out is not None:  # computed a moment ago by a sibling, which checked this module then
            self._remat_fallback(None)
            return out
        norm, reason = _handed_over(self, input)
        reason, siblings, checked = (reason, (), None) if norm is None else self._remat_decided(norm)
        if reason:
            self._remat_fallback(reason)
            if norm is not None:
                input = stock_norm(norm, input)
            return self.remat_stock.forward(self, input)
        self._remat_fallback(None)
        modules = [self, *siblings]
        # the statistics are shared with the consumers this op does not compute (none: with all its siblings)
        shared = _shared_statistics(self) if len(modules) < len(self.remat_handoff.consumers) else None
        outs = norm_linears(input, norm_spec(norm), [m._remat_linear() for m in modules], self.remat_recompute,
                            shared, checked)
        if siblings:
            self.remat_handoff.outputs.store(input, {id(m): o for m, o in zip(siblings, outs[1:])})
        return outs[0]

    def _remat_tensor_parallel(self, input):
        """The call where parallelize_module made this a column-parallel projection (_tensor_parallel.py):
        its layout hook handed over the norm's input, the whole of it on every rank; the norm and this
        rank's columns in one fused op (each projection its own: the siblings' inputs are other DTensors);
        else the stock forward on the norm's output, placed as the hook placed its input."""
        norm, reason = _handed_over(self, input)
        if norm is None:
            self._remat_fallback(reason)
            return self.remat_stock.forward(self, input)
        reason = decided(self, [self, norm], lambda: tensor_parallel.column_reason(self, self.remat_path) or
                         _layer_norm_reason(norm))
        x, layout_reason = (None, None) if reason else tensor_parallel.column_input([self], input, [self.remat_path])
        if reason or layout_reason:
            self._remat_fallback(reason or layout_reason)
            return self.remat_stock.forward(self, tensor_parallel.apply_local(stock_norm, norm, input))
        self._remat_fallback(None)
        spec = tensor_parallel.norm_of_replicated(norm_spec(norm), self.weight.device_mesh)
        out = norm_linears(x, spec, [tensor_parallel.local_linear(self)], self.remat_recompute,
                           _shared_statistics(self))[0]
        return tensor_parallel.column_output(out, self.weight.device_mesh)

    def _remat_decided(self, norm):
        """(why this Linear or its norm cannot be read by the fused op, or None; the other projections
        of this norm whose weights it can read too, to compute them in the same op; the fused op's
        Checked, or None), decided once while the fingerprint of them all holds (_guards.decided), at
        every call where one is a LoRA layer (no Checked then: its adapters are checked at every call).
        No siblings while torch.compile traces (each projection is its own op in the graph)."""
        handoff = self.remat_handoff
        kept = kept_under(self, handoff.verdict())
        if kept is not MISSING:
            return kept
        others = [] if handoff.outputs is None or torch.compiler.is_compiling() else \
            [m for m in handoff.consumer_modules() if m is not self and isinstance(m, _RematNormedLinear)
             and m.__dict__.get("remat_handoff") is handoff]

        lora = self.remat_lora or any(m.remat_lora for m in others)

        def check():  # its own call gathers its ZeRO-3 parameters; a sibling's does not (no siblings then)
            reason = self._remat_reason(zero3.is_hook) or _layer_norm_reason(norm)
            siblings = () if reason else tuple(m for m in others if m._remat_reason() is None)
            return reason, siblings, None if lora else Checked()

        return check() if lora else decided(self, [self, *others, norm], check, under=handoff.verdict())


class _RematNormedLoraLinear(_RematNormedLinear):
    """A peft LoRA layer around an nn.Linear, as _RematNormedLinear: its adapters computed inside the
    fused op too (each keeping its rank-r A(LN(x)) only), in peft's order and dtypes; any call the
    fused op cannot compute exactly (a LoRA variant, dropout in training, ...) runs peft's forward."""

    remat_prefix = "RematNormedLora"
    remat_lora = True

    def _remat_reason(self, allow=None):
        return projection(self, self.remat_path)[1]

    def _remat_linear(self):
        return projection(self, self.remat_path)[0]


class _RematLayerMLP(_RematModule):
    """The fc2 Linear of an MLP its layer holds itself (BART's, Whisper's fc1 -> activation_fn -> fc2,
    called one after the other by the layer's forward), computing the whole MLP on remat.mlp: fc1
    and the activation return their input (_RematFused), and so does the LayerNorm before fc1 when
    it was handed over too. Keeps x and the fc1 output only."""

    remat_prefix = "RematMLP"

    def forward(self, input):
        handoff = self.remat_handoff
        reason = handoff.received(input)
        if reason:  # each producer computed itself: input is the activation's output, as stock
            self._remat_fallback(_not_fused(handoff, reason))
            return self.remat_stock.forward(self, input)
        fc1, act, norm = handoff.source("fc1"), handoff.source("act"), handoff.source("norm")
        labels = handoff.producers
        reason = decided(self, [self, fc1, act, norm], lambda: (
            _own_reason(fc1, labels["fc1"]) or _own_reason(self, self.remat_path)
            or activation_reason(act, labels["act"], act.remat_stock) or _layer_norm_reason(norm)),
            under=handoff.verdict())
        if reason:  # the handoff holds, so input is what the first producer got: compute them here
            self._remat_fallback(reason)
            if norm is not None:
                input = stock_norm(norm, input)
            hidden = act.remat_stock.forward(act, fc1.remat_stock.forward(fc1, input))
            return self.remat_stock.forward(self, hidden)
        self._remat_fallback(None)
        return fused_mlp(input, plain_linear(fc1), gelu(gelu_approximate(act, act.remat_stock)), plain_linear(self),
                         norm_spec(norm) if norm is not None else None, self.remat_recompute)

    def remat_saved_bytes(self):
        """Bytes per token kept less than stock: the GELU output, where this fc2 trains."""
        trains = self.remat_recompute and self.weight.requires_grad
        return self.in_features * self.weight.element_size() if trains else 0


class _RematOutput(_RematModule):
    """BertOutput (and RobertaOutput) with the FFN fused in:
    LayerNorm(dropout(dense(gelu(intermediate.dense(x)))) + input_tensor) on remat.mlp."""

    def forward(self, hidden_states, input_tensor):
        intermediate, reason = _handed_over(self, hidden_states, "intermediate")
        if intermediate is None:  # the intermediate computed itself
            self._remat_fallback(reason)
            return self.remat_stock.forward(self, hidden_states, input_tensor)
        linears, reason = projections([intermediate.dense, self.dense], ["intermediate.dense", "dense"])
        act = intermediate.intermediate_act_fn
        reason = reason or activation_reason(act, "intermediate.intermediate_act_fn")
        if reason:
            self._remat_fallback(reason)
            hidden_states = intermediate.remat_stock.forward(intermediate, hidden_states)
            return self.remat_stock.forward(self, hidden_states, input_tensor)
        self._remat_fallback(None)
        fc1, fc2 = linears
        out = fused_mlp(hidden_states, fc1, gelu(gelu_approximate(act)), fc2, recompute=self.remat_recompute)
        return self.LayerNorm(self.dropout(out) + input_tensor)

    def remat_saved_bytes(self):
        return fused_saved_bytes(fc2=self.dense) if self.remat_recompute else 0


def stock_function(module, name):
    """The function `name` of the transformers file that defines `module`'s stock class (its own
    rotary embedding, BLOOM's dropout_add): what the stock forward calls, called the same way."""
    return getattr(sys.modules[module.remat_stock.__module__], name)

