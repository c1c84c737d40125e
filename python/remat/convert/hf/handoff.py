"""Handoffs: a module's work done, fused, by the module after it (a pre-LN LayerNorm's by the q/k/v
projection or the MLP after it; BERT's intermediate by its output; the fc1 and activation a layer holds
itself by its fc2). The swapped modules (modules.py) give and receive through them."""

import weakref

import torch

from ... import _tensor_parallel as tensor_parallel
from ... import _zero3 as zero3
from ..._guards import decided, hook_reason
from ..._tensor_memo import MISSING, TensorMemo
from ...ops.fused import SharedStatistics


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
        self._handed = TensorMemo()  # the tensor a producer handed over last: [its verdict, not yet received]
        self._members = ()  # the modules _watched found at the last reason(): source() reads them

    def reason(self):
        """None while the handoff holds, else why not: decided again only when the modules it watches
        (_watched), or their fingerprint, changed."""
        layer = self._layer()
        if layer is None:
            return "the layer holding it is gone"
        state = tuple(_attribute(layer, name) for name in (*self.dropout, *(path for path, _ in self.settings))) \
            if self.dropout or self.settings else ()
        self._members = self._watched(layer)
        # the layer itself matters only for its training flag, which a dropout between the members reads
        return decided(self, self._members if self.dropout else self._members[1:], lambda: self._reason(layer),
                       extra=state)

    def verdict(self):
        """The verdict reason() kept, as an object a consumer's own check is kept under (_guards.decided's
        under): it watched every module the consumers' fused ops read. Ask right after reason() (received)."""
        return self.__dict__.get("remat_decided")

    def _watched(self, layer):
        """The layer, every module along the paths, and each consumer's children (an MLP's projections
        and activation, which its fused op reads): what the handoff's verdict is kept for."""
        modules, (steps, consumers, _) = [layer], self._walk
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
            self._handed.put(x, [reason, True])
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
        return self._handed.get(x) is not MISSING or (x._base is not None and self._handed.get(x._base) is not MISSING)

    def take(self, x):
        """Whether a producer handed `x` over at this call with the handoff holding, its verdict not received
        yet: True receives it (a consumer then acts on it without deciding again). Not while torch.compile
        traces (no memo there)."""
        given = self._handed.get(x)
        if given is MISSING or given[0] is not None or not given[1] or torch.compiler.is_compiling():
            return False
        given[1] = False
        return True

    def received(self, x):
        """The verdict given for `x` (received: once), else reason()."""
        given = MISSING if torch.compiler.is_compiling() else self._handed.get(x)
        if given is MISSING or not given[1]:
            return self.reason()
        given[1] = False
        return given[0]

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
        the consumers' indices in that list, {role: index} of the producers'), worked out once."""
        walk = self.__dict__.get("_walk_steps")
        if walk is None:
            index = {"": 0, **{path: i + 1 for i, path in enumerate(self._along)}}
            steps = tuple((index[path.rpartition(".")[0]], path.rpartition(".")[2]) for path in self._along)
            walk = self._walk_steps = steps, tuple(index[path] for path in self.consumers), \
                {role: index[path] for role, path in self.producers.items()}
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
        """The producer of `role` (call only while reason() is None, at the same call: the module in its place
        when reason() last looked), or None when it has none."""
        index = self._walk[2].get(role)
        return self._members[index] if index is not None else None

    def __deepcopy__(self, memo):
        layer = self._layer()
        new = Handoff.__new__(Handoff)
        memo[id(self)] = new
        new._layer = weakref.ref(memo.get(id(layer), layer)) if layer is not None else self._layer
        new.producers, new.consumers, new.dropout = dict(self.producers), self.consumers, self.dropout
        new.settings = self.settings
        new.statistics = SharedStatistics() if self.statistics is not None else None
        new.outputs = SiblingOutputs() if self.outputs is not None else None
        new._handed, new._members = TensorMemo(), ()
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
