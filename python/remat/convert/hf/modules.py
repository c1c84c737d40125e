"""The swapped transformers modules: each is the stock instance with a remat class mixed in
(same submodules, parameters and attributes), computing what the stock forward computes on
remat's fused ops, and the stock forward itself for any call those do not compute exactly.

A Handoff (handoff.py) links a module whose work the next module does (a pre-LN LayerNorm, BERT's
intermediate) to that module; bloom.py's attention, the one module swapped by its class, subclasses _RematModule.
"""

import collections
import sys

import torch
from torch import nn

from ... import _tensor_parallel as tensor_parallel
from ... import _zero3 as zero3
from ..._guards import decided, fallback, kept_under, plain_reason
from ..._linears import decided_projections, fused_saved_bytes, plain_linear, projection, widths
from ..._tensor_memo import MISSING
from ...ops.fused import Checked, fused_mlp, norm_linears, sharing
from ...specs import Activation, gelu, norm_eps, norm_of
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
from .handoff import _handed_over, _not_fused, _shared_statistics, _under

# A transformers MLP module: the names of its fc1, activation, fc2 and (or None) dropout, and the
# remat class it is swapped to (None: _RematMLP). A gated MLP (mixin
# _RematGatedMLP) names its (gate, up) projections as fc1, or its one gate_up projection. The dropout
# is after fc2 in a plain MLP (applied by the fused one too), before fc2 in a gated one (T5's: fused
# while it does nothing).
MLPParts = collections.namedtuple("MLPParts", "fc1 act fc2 dropout mixin", defaults=(None,))


def fc1_names(parts):
    """The names of the projections reading an MLP's input: (fc1,), or a gated MLP's (gate, up)."""
    return parts.fc1 if isinstance(parts.fc1, tuple) else (parts.fc1,)


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

    def _remat_stock_call(self, reason, hidden_states, norm):
        """The stock forward on `hidden_states`, for `reason` (recorded); with the norm handed over (or None)
        applied first, as the stock layer would have."""
        self._remat_fallback(reason)
        if norm is not None:
            hidden_states = stock_norm(norm, hidden_states)
        return self.remat_stock.forward(self, hidden_states)


class _RematPassThrough(_RematModule):
    """A module whose work the consumer of its handoff does inside its fused op (a pre-norm block's norm,
    _RematFusedNorm; BertIntermediate; the fc1 and activation a layer holds itself): returns its input while
    the handoff holds."""

    def forward(self, hidden_states, *args, **kwargs):
        reason = self.remat_handoff.give(hidden_states)
        if reason is None:
            return hidden_states
        if self.remat_handoff.unheard(self):  # no consumer says it: said here
            self._remat_fallback(_not_fused(self.remat_handoff, reason))
        return self.remat_stock.forward(self, hidden_states, *args, **kwargs)


class _RematFusedNorm(_RematPassThrough):
    """A pre-norm block's norm (an nn.LayerNorm, or a transformers RMSNorm class: LlamaRMSNorm,
    GemmaRMSNorm, ...) whose consumer (the attention's q/k/v projection or the MLP's first
    projection) applies it, fused: while their handoff holds, forward returns its input; otherwise
    the stock module's own forward runs. Still an instance of its stock class with its own weight
    and eps (same objects, same state_dict keys, found by isinstance checks such as weight-decay
    groups); remat_revert() gives the stock module back."""

    remat_prefix = "RematFused"
    remat_style = None  # None: a LayerNorm; else the RMSNorm rounding (remat.specs.RMS_NORM_STYLES)

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


def _kept_call(module, x, act=None):
    """(the fused op call `module` kept, its verdict: _kept_under_verdict) where a producer handed x over at
    this call with the handoff holding (its verdict received then: Handoff.take); else None, and the full path
    decides. Asked first at a call: the steady state of a converted layer, which reads nothing else."""
    handoff = module.__dict__.get("remat_handoff")
    if handoff is None or not handoff.take(x):
        return None
    return _kept_under_verdict(module, x, handoff.source("norm"), act)


def _kept_under_verdict(module, x, norm, act):
    """(the fused op call `module` kept (remat.ops.fused.Checked.kept_call) with the verdict it decided under its
    handoff's, that verdict) while the handoff's verdict taken at this call is that one: nothing the call reads
    changed but x and what the Checked compares (the norm's eps, the activation `act`, the recompute switch);
    else None. Only where the handoff holds at this call (its verdict taken at this call): that verdict then
    covers every module the call reads (a tensor-parallel or ZeRO-3 call keeps none). norm: the norm handed
    over, or None."""
    verdict = kept_under(module, module.remat_handoff.verdict())
    if type(verdict) is not tuple or verdict[0] is not None or verdict[-1] is None:  # (MISSING, or a reason)
        return None
    call = verdict[-1].kept_call(x, norm_eps(norm) if norm is not None else None, act, module.remat_recompute)
    if call is None:
        return None
    if "remat_trace" in module.__dict__:  # the conversion probe's trace (no fallback to record: its remat path)
        module._remat_fallback(None)
    return call, verdict


def _gelu_of(act, kind=None):
    """The remat.specs.Activation of the GELU module `act` computes now (judged as a `kind`: its stock class),
    its approximate read at every call; None for one remat does not compute (activation_reason says why)."""
    approximate = gelu_approximate(act, kind)
    return gelu(approximate) if approximate is not None else None


def _layer_norm_reason(norm):
    """Why a fused norm's parameters cannot be read by a fused op at this call, or None (also when there is none)."""
    return plain_reason(norm, (type(norm),), "the fused norm", zero3.is_hook) if norm is not None else None


# ---------------------------------------------------------------------------------------------
# The swapped MLP modules
# ---------------------------------------------------------------------------------------------


class _RematMLP(_RematModule):
    """A transformers MLP module (GPT2MLP, ViTMLP, PhiMLP, ...) on remat.mlp:
    dropout(fc2(gelu(fc1(x)))) keeping x and the fc1 output only, with the LayerNorm before it
    fused in when it was handed over. Any call remat cannot compute runs the stock forward.
    _RematGatedMLP is this with a gated activation."""

    remat_parts: "MLPParts"  # the stock module's submodule names, as the structure probe found them
    remat_need_bias = True  # remat.mlp takes LayerNorms with a bias only
    remat_dropped = "the GELU output is"  # what the report says it does not keep
    remat_gated = False
    _remat_activation_reason = staticmethod(activation_reason)  # why a module cannot be the activation, or None

    @classmethod
    def remat_parts_reason(cls, module, parts):
        """Why fc1 -> act -> fc2 of the stock `module` is not remat.mlp (fc1 and fc2 Linear-like,
        peft's LoRA included; a GELU), or None."""
        return fusable(MLP, [module._modules[n] for n in (parts.fc1, parts.act, parts.fc2)],
                       labels=["fc1", "activation", "fc2"])

    def forward(self, hidden_states):
        kept = _kept_call(self, hidden_states, self._remat_activation()) if self.remat_call_reason() is None else None
        if kept is not None:
            return self._remat_dropout(sharing(_shared_statistics(self), hidden_states, kept[0]))
        norm, norm_reason = _handed_over(self, hidden_states)
        names = (*fc1_names(self.remat_parts), self.remat_parts.fc2)
        modules = [self._modules[n] for n in names]
        if self.remat_gated and tensor_parallel.is_sharded(modules[-1]):
            return self._remat_tensor_parallel(hidden_states, norm, norm_reason, modules, names)
        with zero3.gathered(self, modules):  # it reads its projections' parameters without calling them
            return self._remat_forward(hidden_states, norm, norm_reason, modules, names)

    def _remat_activation(self):
        return _gelu_of(self._modules[self.remat_parts.act])

    def _remat_dropout(self, out):
        """The dropout after fc2."""
        dropout = self.remat_parts.dropout
        return self._modules[dropout](out) if dropout else out

    def remat_call_reason(self):
        """Why this module's stock forward computes something else than the fused MLP now, or None."""
        return None

    def _remat_forward(self, hidden_states, norm, norm_reason, modules, names):
        parts = self.remat_parts
        activation = self._modules[parts.act]
        linears, reason, checked = decided_projections(
            self, modules, list(names), [activation, norm],
            lambda: self._remat_activation_reason(activation, parts.act, allow=zero3.is_hook)
            or _layer_norm_reason(norm),
            zero3.is_hook, _under(self, norm))
        reason = reason or self.remat_call_reason()
        if reason:
            return self._remat_stock_call(reason, hidden_states, norm)
        self._remat_fallback(norm_reason)
        *ups, down = linears
        out = fused_mlp(hidden_states, tuple(ups) if len(ups) == 2 else ups[0], self._remat_activation(), down,
                        norm_spec(norm) if norm is not None else None, self.remat_recompute,
                        _shared_statistics(self), checked)
        return self._remat_dropout(out)

    def remat_saved_bytes(self):
        """Bytes per token this module keeps less than stock: the GELU output, where fc2 trains (a gated
        MLP's act(gate) and the product)."""
        fc2 = self._modules[self.remat_parts.fc2]
        return fused_saved_bytes(fc2=fc2, gated=self.remat_gated) if self.remat_recompute else 0

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


class _RematGatedMLP(_RematMLP):
    """A transformers gated MLP (LlamaMLP, GemmaMLP, Phi3MLP, ...) on remat's fused gated MLP:
    down(act(gate(x)) * up(x)), or with one gate_up projection (gate first, as Phi-3's) chunked in
    two; keeps x, gate and up outputs only (never act(gate) nor the product), with the norm before
    it fused in when it was handed over. Any call remat cannot compute runs the stock forward."""

    remat_need_bias = False  # the norm in front may be an RMSNorm, or a LayerNorm without bias
    remat_dropped = "act(gate) and act(gate) * up are"
    remat_gated = True
    _remat_activation_reason = staticmethod(gated_activation_reason)

    @classmethod
    def remat_parts_reason(cls, module, parts):
        """Why the stock `module`'s projections and activation are not a gated MLP remat fuses, or None."""
        linears = [module._modules[n] for n in (*fc1_names(parts), parts.fc2)]
        names = (*fc1_names(parts), parts.fc2)
        reason = next(filter(None, (projection(m, n)[1] for m, n in zip(linears, names))), None)
        reason = reason or gated_activation_reason(module._modules[parts.act], parts.act)
        return reason or _gated_widths_reason(names, [widths(m) for m in linears]) or uniform_reason(*linears)

    def _remat_activation(self):
        return Activation(gated_activation_name(self._modules[self.remat_parts.act]), gated=True)

    def _remat_dropout(self, out):
        """Nothing: a gated MLP's dropout is before its down projection (remat_call_reason)."""
        return out

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

    def extra_repr(self):
        return f"on remat's fused gated MLP, recompute={self.remat_recompute}"


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
        outputs = self.remat_handoff.outputs
        out = outputs.take(self, input) if outputs is not None else None
        if out is not None:  # computed a moment ago by a sibling, which checked this module then
            self._remat_fallback(None)
            return out
        kept = _kept_call(self, input)
        if kept is not None:  # the arguments of the last call, decided under this verdict
            call, (_, siblings, _) = kept
            return self._remat_outputs(input, siblings, lambda shared: sharing(shared, input, call))
        if tensor_parallel.is_sharded(self):
            return self._remat_tensor_parallel(input)
        norm, reason = _handed_over(self, input)
        reason, siblings, checked = (reason, (), None) if norm is None else self._remat_decided(norm)
        if reason:
            return self._remat_stock_call(reason, input, norm)
        kept = _kept_under_verdict(self, input, norm, None) if checked is not None else None
        if kept is not None:  # (x not the tensor handed over at this call, the handoff holding all the same)
            return self._remat_outputs(input, siblings, lambda shared: sharing(shared, input, kept[0]))
        self._remat_fallback(None)
        modules = [self, *siblings]
        return self._remat_outputs(input, siblings, lambda shared: norm_linears(
            input, norm_spec(norm), [m._remat_linear() for m in modules], self.remat_recompute, shared, checked))

    def _remat_outputs(self, input, siblings, compute):
        """This projection's output of compute(shared) (its output and its siblings', computed together; shared:
        the norm statistics shared with the consumers this op does not compute, None with all of them), the
        siblings' stored for their calls."""
        shared = _shared_statistics(self) if len(siblings) + 1 < len(self.remat_handoff.consumers) else None
        outs = compute(shared)
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
            return reason, siblings, None if lora else Checked(keeps_calls=not zero3.any_partitioned([self, norm]))

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
        kept = _kept_under_verdict(self, input, norm, _gelu_of(act, act.remat_stock))
        if kept is not None:
            return sharing(_shared_statistics(self), input, kept[0])
        labels = handoff.producers
        reason, checked = decided(self, [self, fc1, act, norm], lambda: (
            _own_reason(fc1, labels["fc1"]) or _own_reason(self, self.remat_path)
            or activation_reason(act, labels["act"], act.remat_stock) or _layer_norm_reason(norm),
            Checked(keeps_calls=not zero3.any_partitioned([self, fc1, act, norm]))), under=handoff.verdict())
        if reason:  # the handoff holds, so input is what the first producer got: compute them here
            self._remat_fallback(reason)
            if norm is not None:
                input = stock_norm(norm, input)
            hidden = act.remat_stock.forward(act, fc1.remat_stock.forward(fc1, input))
            return self.remat_stock.forward(self, hidden)
        self._remat_fallback(None)
        return fused_mlp(input, plain_linear(fc1), _gelu_of(act, act.remat_stock), plain_linear(self),
                         norm_spec(norm) if norm is not None else None, self.remat_recompute, checked=checked)

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
        # decided on their own fingerprint: the handoff's verdict does not watch the intermediate's children
        act = intermediate.intermediate_act_fn
        linears, reason, checked = decided_projections(
            self, [intermediate.dense, self.dense], ["intermediate.dense", "dense"], [act],
            lambda: activation_reason(act, "intermediate.intermediate_act_fn"))
        if reason:
            self._remat_fallback(reason)
            hidden_states = intermediate.remat_stock.forward(intermediate, hidden_states)
            return self.remat_stock.forward(self, hidden_states, input_tensor)
        self._remat_fallback(None)
        gelu_spec = _gelu_of(act)
        call = checked.kept_call(hidden_states, None, gelu_spec, self.remat_recompute) if checked is not None else None
        if call is not None:
            out = call(hidden_states, None)
        else:
            fc1, fc2 = linears
            out = fused_mlp(hidden_states, fc1, gelu_spec, fc2, recompute=self.remat_recompute, checked=checked)
        return self.LayerNorm(self.dropout(out) + input_tensor)

    def remat_saved_bytes(self):
        return fused_saved_bytes(fc2=self.dense) if self.remat_recompute else 0


def stock_function(module, name):
    """The function `name` of the transformers file that defines `module`'s stock class (its own
    rotary embedding, BLOOM's dropout_add): what the stock forward calls, called the same way."""
    return getattr(sys.modules[module.remat_stock.__module__], name)

