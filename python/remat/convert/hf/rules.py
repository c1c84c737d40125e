"""The rules remat.convert applies to each module of a Hugging Face model: what the structure probe
(structure.py) found fused (norms handed over to the projections after them, MLPs, a split FFN), each
fusion checked by a probe call when it is made. BLOOM's attention, the one module swapped by its class,
is bloom.py's plan of its own."""

import collections
import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn

from ..._guards import EXCLUDED, excluded_below, from_transformers, hook_reason
from ..._linears import (
    base_layer,
    fused_saved_bytes,
    is_conv1d,
    is_falcon_linear,
    is_lora_linear,
    needs_input,
    projection,
    widths,
)
from ..patterns import MLP, fusable, layer_norm_fusable
from ..swap import is_converted, join, with_class
from . import experts as hf_experts
from . import head_norm
from . import structure as structure_probe
from .experts import _RematNormedRouter, router_reason
from .handoff import _between_reason, link, submodule
from .modules import (
    RematFusedLayerNorm,
    _RematFused,
    _RematFusedNorm,
    _RematIntermediate,
    _RematLayerMLP,
    _RematMLP,
    _RematNormedLinear,
    _RematNormedLoraLinear,
    _RematOutput,
    fc1_names,
    remat_class,
)
from .probe import first_output, install, self_probe, swap_probe
from .structure import norm_node

ATTENTION_SUFFIXES = ("Attention",)


def _mlp_reason(fc1, act, fc2):
    """None when fc1 -> act -> fc2 is remat.mlp (fc1 and fc2 Linear-like, peft's LoRA included), else why not."""
    return fusable(MLP, [fc1, act, fc2], labels=["fc1", "activation", "fc2"])


def _instance_reason(module):
    """Why a stock module must keep its class: hooks, a forward replaced on the instance, or a module
    below it that convert's filter_fn keeps stock (a swapped module computes its children's work)."""
    if "forward" in vars(module):
        return "its forward is replaced on the instance"
    return hook_reason(module) or excluded_below(module)


def _swapped(module, mixin, options, path, **attributes):
    new = with_class(module, remat_class(mixin, type(module), **attributes))
    new.__dict__["remat_recompute"], new.__dict__["remat_path"] = options.recompute, path
    return new


def _fused_norm(norm, path, style=None):
    """The fused norm for the stock LayerNorm or RMSNorm `norm` (RematFusedLayerNorm, RematFused<RMSNorm class>)
    rounded as `style` (None: a LayerNorm)."""
    cls = RematFusedLayerNorm if style is None else remat_class(_RematFusedNorm, type(norm), remat_style=style)
    new = with_class(norm, cls)
    new.__dict__["remat_path"] = path
    return new


# ---------------------------------------------------------------------------------------------
# MLP modules
# ---------------------------------------------------------------------------------------------


def _mlp_candidate(module, options, path, parts):
    """(the swapped MLP for `module` made of `parts` (structure.MLPParts), None) or (None, why not)."""
    names = (*fc1_names(parts), parts.act, parts.fc2)
    if not all(isinstance(getattr(module, n, None), nn.Module) for n in names):
        return None, f"{type(module).__name__} lacks the expected submodules {', '.join(names)}"
    mixin = parts.mixin or _RematMLP
    reason = _instance_reason(module) or mixin.remat_parts_reason(module, parts)
    if reason:
        return None, reason
    return _swapped(module, mixin, options, path, remat_parts=parts), None


def _mlp_row(path, name, module, new, norm_name=None):
    parts = new.remat_parts
    chain = f"{' / '.join(fc1_names(parts))} -> {type(getattr(module, parts.act)).__name__} -> {parts.fc2}"
    if parts.dropout:
        chain += f" (+ {parts.dropout})"
    if norm_name:
        chain = f"{norm_name} -> {chain}"
    kept = f"{new.remat_dropped} not kept" + (f", nor {norm_name}'s output" if norm_name else "")
    return join(path, name), module, f"swapped to {type(new).__name__}", f"fused {chain}: {kept}", \
        new.remat_saved_bytes


def _mlp_rule(parent, name, module, options, path, report, parts):
    new, reason = _mlp_candidate(module, options, join(path, name), parts)
    if reason:
        return reason
    fc1 = getattr(module, fc1_names(new.remat_parts)[0])
    # the MLP module called with no mask where its forward takes one
    takes_mask = not fc1.weight.is_meta and "attention_mask" in inspect.signature(module.forward).parameters
    reason = self_probe(module, new, widths(fc1)[0], fc1.weight, {"attention_mask": None} if takes_mask else {})
    if reason:
        return reason
    parent._modules[name] = new
    report.add(*_mlp_row(path, name, module, new))
    return None


# ---------------------------------------------------------------------------------------------
# Layers: LayerNorms handed over to the modules after them, MLPs the layer holds itself
# ---------------------------------------------------------------------------------------------

# A LayerNorm feeding several consumers (a parallel layer) is applied inside each one's fused op;
# they keep x (one storage) and, through the handoff's SharedStatistics, one set of fp32 statistics.
# Under torch.compile each keeps its own: fp32 mean and rstd, 4 + 4 bytes per token (an RMSNorm:
# rstd, 4) more per further consumer.


@dataclasses.dataclass
class _Consumer:
    """A module that can take over a LayerNorm's work in a layer: its kind ("mlp", "layer_mlp",
    "linear", "router", "experts": what _consumer_rows reports), the new modules that make it
    ({dotted path below the layer: module}), the one among them applying the LayerNorm (path),
    its own producers ({role: path}: the fc1 and activation of an MLP the layer holds), the
    Linear-likes reading the LayerNorm's output (readers, paths: they decide what is saved)."""

    kind: str
    path: str
    swaps: dict
    readers: tuple
    into: str  # what the report says the LayerNorm is fused into
    width: int
    param: torch.Tensor
    producers: dict = dataclasses.field(default_factory=dict)
    need_bias: bool = False  # remat.mlp takes LayerNorms with a bias only
    dropout: tuple = ()  # the layer's attributes holding the dropout between its producers and it (LayerMLP)
    settings: tuple = ()  # Handoff.settings: what the forward of the child holding an MLP read (LayerMLP)
    trains: Callable = None  # a consumer with no Linear-like reader (experts, router): whether stock keeps norm(x)


def _mlp_consumer(layer, name, options, path, parts):
    module = submodule(layer, name)
    new, reason = _mlp_candidate(module, options, join(path, name), parts)
    if reason:
        return None, reason
    readers = tuple(f"{name}.{n}" for n in fc1_names(new.remat_parts))
    fc1 = submodule(layer, readers[0])
    return _Consumer("mlp", name, {name: new}, readers, " and ".join(readers), widths(fc1)[0], base_layer(fc1).weight,
                     need_bias=new.remat_need_bias), None


def _plain_linear_reason(module, label):
    """Why `module` cannot be swapped to a remat Linear class (fc1 / fc2 held by a layer, a Linear
    inside a stock module), or None."""
    if type(module) is not nn.Linear and not is_falcon_linear(module) and not is_conv1d(module):
        return f"{label} is {type(module).__name__}, not exactly nn.Linear, FalconLinear or Conv1D"
    return _instance_reason(module)


def _layer_mlp_reason(layer, parts):
    """Why the MLP `layer` holds itself (structure.LayerMLP parts) cannot be fused, or None."""
    fc1, act, fc2 = (submodule(layer, n) for n in (parts.fc1, parts.act, parts.fc2))
    if fc1 is None or act is None or fc2 is None:
        return f"{type(layer).__name__} lacks the expected children {parts.fc1}, {parts.act}, {parts.fc2}"
    return _plain_linear_reason(fc1, parts.fc1) or _plain_linear_reason(fc2, parts.fc2) or \
        _instance_reason(act) or _mlp_reason(fc1, act, fc2)


def _layer_mlp_consumer(layer, parts, options, path):
    """The MLP `layer` holds itself (structure.LayerMLP parts) as one consumer: fc1 and the activation
    return their input, fc2 computes the whole MLP; or (None, why not)."""
    reason = _layer_mlp_reason(layer, parts)
    if reason:
        return None, reason
    fc1, act, fc2 = (submodule(layer, n) for n in (parts.fc1, parts.act, parts.fc2))
    swaps = {parts.fc1: _swapped(fc1, _RematFused, options, join(path, parts.fc1)),
             parts.act: _swapped(act, _RematFused, options, join(path, parts.act)),
             parts.fc2: _swapped(fc2, _RematLayerMLP, options, join(path, parts.fc2))}
    return _Consumer("layer_mlp", parts.fc2, swaps, (parts.fc1,), parts.fc1, widths(fc1)[0], fc1.weight,
                     producers={"fc1": parts.fc1, "act": parts.act}, need_bias=True, dropout=parts.dropout,
                     settings=_holder_settings(layer, parts.fc2)), None


def _holder_settings(layer, fc2_path):
    """Handoff.settings of an MLP a child of `layer` holds (fc2 at a dotted path): the child's plain
    attributes (numbers, flags, strings), which its forward may branch on (BloomMLP's slow_but_exact);
    none for an MLP the layer holds itself (its dropout attributes are followed instead)."""
    holder_path = fc2_path.rpartition(".")[0]
    if not holder_path:
        return ()
    holder = submodule(layer, holder_path)
    return tuple((f"{holder_path}.{name}", value) for name, value in vars(holder).items()
                 if not name.startswith("_") and name != "training" and type(value) in (bool, int, float, str))


def _linear_consumer(layer, linear_path, options, path):
    """The Linear at `linear_path` (inside a module that stays stock, or a layer's fc1 before an
    activation remat does not fuse) with the LayerNorm fused in; or (None, why not)."""
    module = submodule(layer, linear_path)
    lora = is_lora_linear(module)  # a peft LoRA layer: its adapters are checked at each call (projection)
    if lora:
        reason = _instance_reason(module) or _plain_linear_reason(module.base_layer, f"{linear_path}.base_layer")
    else:
        reason = _plain_linear_reason(module, linear_path)
    if reason:
        return None, reason
    new = _swapped(module, _RematNormedLoraLinear if lora else _RematNormedLinear, options, join(path, linear_path))
    return _Consumer("linear", linear_path, {linear_path: new}, (linear_path,), linear_path, widths(module)[0],
                     base_layer(module).weight), None


def _experts_consumer(layer, consumer_path, options):
    """The experts module at `consumer_path` applying the norm inside remat.experts (the module stays,
    running "remat": experts.py reads the handoff); or (None, why not)."""
    module = submodule(layer, consumer_path)
    if not options.wants("experts"):  # a reason of its own (not "layers excludes ..."): the norm's row says it
        return None, f"{consumer_path} runs transformers' experts, not remat's (layers excludes experts)"
    if not hf_experts.runs_remat_experts(module):
        spec = module.__dict__.get("remat_experts_spec")
        return None, f"{consumer_path} does not run remat.experts" + (f" ({spec})" if isinstance(spec, str) else "")
    spec = module.__dict__["remat_experts_spec"]
    weight = getattr(module, spec.gate_up)
    width = weight.shape[1 if spec.transposed else 2]
    return _Consumer("experts", consumer_path, {consumer_path: module}, (), consumer_path, width, weight,
                     trains=lambda: any(p.requires_grad for p in module.parameters())), None


def _router_consumer(layer, consumer_path, options, path):
    """The router at `consumer_path` (structure.routes) with the norm fused into its projection."""
    module = submodule(layer, consumer_path)
    reason = router_reason(module, consumer_path)
    if reason:
        return None, reason
    new = _swapped(module, _RematNormedRouter, options, join(path, consumer_path))
    return _Consumer("router", consumer_path, {consumer_path: new}, (), consumer_path, module.weight.shape[1],
                     module.weight, trains=lambda: module.weight.requires_grad), None


def _consumer_rows(report, layer, path, consumer, norm_name):
    """Report the swaps of `consumer`, before they are installed in `layer` (at `path`); norm_name: the
    norm handed over to it, or None."""
    stock = {p: submodule(layer, p) for p in consumer.swaps}
    new = consumer.swaps[consumer.path]
    if consumer.kind == "mlp":
        report.add(*_mlp_row(path, consumer.path, stock[consumer.path], new, norm_name))
    elif consumer.kind == "layer_mlp":
        fc1, act = consumer.producers["fc1"], consumer.producers["act"]
        chain = f"{fc1} -> {type(stock[act]).__name__} -> {consumer.path}"
        kept = "the GELU output is not kept" + (f", nor {norm_name}'s output" if norm_name else "")
        for name in (fc1, act):
            report.add(join(path, name), stock[name], f"swapped to {type(consumer.swaps[name]).__name__}",
                       f"applied inside {consumer.path}, fused; returns its input", lambda: 0)
        report.add(join(path, consumer.path), stock[consumer.path], f"swapped to {type(new).__name__}",
                   f"fused {f'{norm_name} -> ' if norm_name else ''}{chain}, the MLP its layer holds: {kept}",
                   new.remat_saved_bytes)
    elif consumer.kind in _FUSED_INTO:
        report.add(join(path, consumer.path), stock[consumer.path], f"swapped to {type(new).__name__}",
                   _FUSED_INTO[consumer.kind].format(norm=norm_name), lambda: 0)


# What the report says of a Linear or a router with the norm fused into it (an experts module stays: no row).
_FUSED_INTO = {
    "linear": "{norm} applied inside it, fused (x and its fp32 statistics kept, never {norm}'s output)",
    "router": "{norm} applied inside its projection, fused (x and its fp32 statistics kept, never {norm}'s "
              "output; a projection of the tokens cast first keeps the cast, as stock); its choices made once, "
              "in the forward",
}


def _consumer(layer, consumer_path, options, path, found):
    """(_Consumer, None) for the module at `consumer_path` of `layer` taking over a LayerNorm's work,
    or (None, why not). found: what the structure probe found of the layer (its MLPs)."""
    module = submodule(layer, consumer_path)
    held = found.held
    if consumer_path in found.mlps:
        if not options.wants("mlp"):
            return None, "layers excludes mlp"
        return _mlp_consumer(layer, consumer_path, options, path, found.mlps[consumer_path])
    if held is not None and consumer_path == held.fc1 and options.wants("mlp"):
        consumer, reason = _layer_mlp_consumer(layer, held, options, path)
        if consumer is not None:
            return consumer, None  # else the LayerNorm fuses into fc1 alone (OPT's ReLU MLP)
    if hf_experts.is_experts_module(module):
        return _experts_consumer(layer, consumer_path, options)
    if widths(module) is None and isinstance(getattr(module, "weight", None), nn.Parameter):  # found routing
        return _router_consumer(layer, consumer_path, options, path)
    return _linear_consumer(layer, consumer_path, options, path)


def _fusable_norm(layer, norm_name, options, style=None):
    """(the norm, None) when `norm_name` is a norm the rules fuse (an exact nn.LayerNorm, or an RMSNorm
    the structure probe found rounding as `style`), else (it or None, why not)."""
    norm = layer._modules.get(norm_name)
    if not options.wants("layernorm"):
        return None, "layers excludes layernorm"
    if type(norm) is not nn.LayerNorm and not (style and from_transformers(type(norm))):
        return None, f"{norm_name} is {type(norm).__name__}, not exactly nn.LayerNorm nor an RMSNorm remat matches"
    # the layer's hooks but transformers' output recorders (which its first forward with output_router_logits,
    # output_attentions or output_hidden_states installs, the convert probe's included): they read the layer's
    # input and outputs, which fusions inside it leave as they are
    return norm, _instance_reason(norm) or _between_reason(layer)


def _rms_norm_reason(norm, width, style=None):
    """None when the stock RMSNorm `norm` is the norm of `style` over `width` features, rounded as that
    style rounds (checked on a random input in the weight's dtype and in bf16), else why not."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return f"{type(norm).__name__} has no 1-D weight and float eps (or variance_epsilon)"
    if weight.shape[0] != width:
        return f"{type(norm).__name__} width {weight.shape[0]} != the Linear's in_features {width}"
    reason = structure_probe.rms_mismatch(norm, style) if not weight.is_meta else None
    return f"{type(norm).__name__}: {reason}" if reason else None


def _norm_reason(layer, norm_name, consumers, options, style=None):
    """(the LayerNorm, None) when it can be handed over to all of `consumers`, else (it or None, why not)."""
    norm, reason = _fusable_norm(layer, norm_name, options, style)
    for consumer in consumers if reason is None else ():
        reason = (layer_norm_fusable(norm, consumer.width, need_bias=consumer.need_bias)
                  if type(norm) is nn.LayerNorm else _rms_norm_reason(norm, consumer.width, style)) or \
            next(filter(None, (projection(submodule(layer, r), r)[1] for r in consumer.readers)), None)
        if reason:
            break
    if reason is None and len(consumers) > 1 and not options.recompute:
        reason = (f"recompute=False: {norm_name} feeds {len(consumers)} modules, each of which would compute "
                  "and keep its output (stock computes it once)")
    return norm, reason


def _norm_row(report, path, layer, norm_name, norm, new_norm, consumers):
    into = " and ".join(c.into for c in consumers)
    readers = [r for c in consumers for r in c.readers]
    applied = " and ".join(c.path for c in consumers)

    def saves():
        if not new_norm.__dict__.get("remat_recompute", True):
            return 0
        linears = [submodule(layer, r) for r in readers]
        if any(c.trains() for c in consumers if c.trains) and not any(map(needs_input, linears)):
            return new_norm.weight.shape[0] * new_norm.weight.element_size()  # norm(x), as the experts read it
        return fused_saved_bytes(new_norm, linears)

    note = "; its x and fp32 statistics are kept once" if len(consumers) > 1 else ""
    report.add(join(path, norm_name), norm, f"swapped to {type(new_norm).__name__}",
               f"applied inside {applied}, fused into {into}; returns its input{note}", saves)


# What the structure probe found of a layer (structure.py): the RMSNorm style of each norm child,
# {path: MLPParts} of its MLP children, call(layer, x), the layer called as the probe called it, and
# the LayerMLP of the MLP it holds itself (or None).
Found = collections.namedtuple("Found", "styles mlps call held")


def _hand_over(layer, norm_name, consumer_paths, options, path, report, found):
    """Hand the LayerNorm `norm_name` over to the modules at `consumer_paths`, all of them or none;
    returns the paths of the consumers installed. found: what the structure probe found of the layer."""
    style = found.styles.get(norm_name)
    built = [_consumer(layer, p, options, path, found) for p in consumer_paths]
    consumers = [c for c, _ in built if c is not None]
    reason = next((r for c, r in built if c is None), None)
    norm, norm_reason = _fusable_norm(layer, norm_name, options, style) if reason else \
        _norm_reason(layer, norm_name, consumers, options, style)
    reason = reason or norm_reason
    if reason is None:
        fused_norm = _fused_norm(norm, join(path, norm_name), style)
        fused_norm.__dict__["remat_recompute"] = options.recompute
        members = {norm_name: fused_norm}
        producers = {"norm": norm_name}
        for consumer in consumers:
            members.update(consumer.swaps)
            producers.update(consumer.producers)
        dropout = next((c.dropout for c in consumers if c.dropout), ())
        settings = next((c.settings for c in consumers if c.settings), ())
        link(layer, members, producers, [c.path for c in consumers], dropout, settings)
        first = consumers[0]
        reason = swap_probe(layer, members, first.width, first.param, [members[c.path] for c in consumers],
                             found.call)
    if reason is None:
        for consumer in consumers:
            _consumer_rows(report, layer, path, consumer, norm_name)
        install(layer, members)
        _norm_row(report, path, layer, norm_name, norm, fused_norm, consumers)
        return set(consumer_paths)
    for consumer in consumers:  # a consumer that stays in place (an experts module) forgets the handoff
        for module in consumer.swaps.values():
            if not is_converted(module):
                module.__dict__.pop("remat_handoff", None)
    if norm is not None and not reason.startswith("layers excludes"):
        report.add(join(path, norm_name), norm, "skipped", f"fusion into {' and '.join(consumer_paths)}: {reason}")
    return set()


def _held_mlp(layer, held, reason, fused, options, path, report, call):
    """Convert the MLP `layer` holds itself (held: its structure.LayerMLP, or None) where no norm took it
    in (fused: the consumer paths the norms went to); reason: why it cannot be fused (asked before the
    norms were), or None. The names handled."""
    if held is None:
        if reason:  # a chain the probe saw, whose dropout it cannot follow
            report.add(path, layer, "skipped", f"the MLP the layer holds stays stock: {reason}")
        return set()
    if reason and held.fc1 in fused:  # OPT's ReLU MLP: the norm went into fc1 alone
        _layer_mlp_skipped(layer, held, path, report, reason)
        return set()
    if held.fc1 in fused:  # the MLP took the norm
        return {held.act, held.fc2}
    return {held.fc1, held.act, held.fc2} if _layer_mlp_alone(layer, held, options, path, report, call) else set()


def _layer_mlp_alone(layer, parts, options, path, report, call):
    """Swap the MLP `layer` holds itself, without a LayerNorm in front; True when it was swapped."""
    consumer, reason = _layer_mlp_consumer(layer, parts, options, path)
    if consumer is not None:
        link(layer, consumer.swaps, consumer.producers, [consumer.path], consumer.dropout, consumer.settings)
        reason = swap_probe(layer, consumer.swaps, consumer.width, consumer.param, [consumer.swaps[consumer.path]],
                             call)
    if reason:
        _layer_mlp_skipped(layer, parts, path, report, reason)
        return False
    _consumer_rows(report, layer, path, consumer, None)
    install(layer, consumer.swaps)
    return True


def _layer_mlp_skipped(layer, parts, path, report, reason):
    report.add(join(path, parts.fc2), submodule(layer, parts.fc2), "skipped",
               f"the MLP {parts.fc1} -> {parts.act} -> {parts.fc2} the layer holds stays stock: {reason}")


def _pair_rule(layer, options, path, report, pair):
    """BERT's FFN split over two children (pair: (intermediate name, output name), as the structure
    probe found them just before: _split_ffn, which also checked that the intermediate holds dense and
    intermediate_act_fn modules, the output dense, dropout and LayerNorm modules) fused into the output
    module."""
    inter_name, out_name = pair
    inter, out = layer._modules[inter_name], layer._modules[out_name]
    row_path = join(path, inter_name)
    fc1, act, fc2, norm = inter.dense, inter.intermediate_act_fn, out.dense, out.LayerNorm
    reason = _instance_reason(inter) or _instance_reason(out) or _between_reason(layer)  # as _fusable_norm's
    if reason is None and not callable(getattr(layer, "feed_forward_chunk", None)):
        reason = f"{type(layer).__name__} has no feed_forward_chunk to check the FFN wiring against"
    if reason is None:
        reason = _mlp_reason(fc1, act, fc2)
    if reason is None and not isinstance(norm, nn.LayerNorm):
        reason = "output.LayerNorm is not an nn.LayerNorm"
    if reason is None:
        new_inter = _swapped(inter, _RematIntermediate, options, row_path)
        new_out = _swapped(out, _RematOutput, options, join(path, out_name))
        swaps = {inter_name: new_inter, out_name: new_out}
        link(layer, swaps, {"intermediate": inter_name}, [out_name])
        reason = swap_probe(layer, swaps, widths(fc1)[0], fc1.weight, [new_out],
                             call=lambda owner, x: owner.feed_forward_chunk(x))
    if reason:
        report.add(row_path, inter, "skipped", f"{inter_name} + {out_name} FFN: {reason}")
        return set()
    layer._modules[inter_name], layer._modules[out_name] = new_inter, new_out
    report.add(row_path, inter, f"swapped to {type(new_inter).__name__}",
               f"FFN fused into {out_name}; returns its input", lambda: 0)
    report.add(join(path, out_name), out, f"swapped to {type(new_out).__name__}",
               f"LayerNorm(dropout(dense(gelu({inter_name}.dense(x)))) + input): the GELU output is not kept",
               new_out.remat_saved_bytes)
    return {inter_name}  # output is recursed into: its LayerNorm becomes remat.nn.LayerNorm


def _holds_attention(module):
    """Whether a transformers attention module lies below `module` (BertAttention holds
    BertSelfAttention: the row is the inner one's)."""
    return any(_is_attention(m) and from_transformers(type(m)) for m in module.modules() if m is not module)


# ---------------------------------------------------------------------------------------------
# Fusions the structure probe found
# ---------------------------------------------------------------------------------------------


def _replay(frame):
    """call(module, x): `module` called as the probe called it, x in place of its hidden states."""
    rest = {k: v for k, v in frame.kwargs.items() if k != "hidden_states"}
    if frame.args:
        return lambda module, x: first_output(module(x, *frame.args[1:], **rest))
    return lambda module, x: first_output(module(hidden_states=x, **rest))


def _norm_consumers(readers, mlps):
    """The consumer paths of a norm read by the Linear-likes `readers`: an MLP child whose first
    projections are exactly the readers below it, else each reader."""
    consumers = list(readers)
    for name, parts in mlps.items():
        firsts = [f"{name}.{n}" for n in fc1_names(parts)]
        below = [r for r in readers if r.startswith(f"{name}.")]
        if sorted(below) == sorted(firsts):
            consumers = [c for c in consumers if c not in below] + [name]
    return consumers


def _split_ffn(structure, layer):
    """The pair-rule names of BERT-like children (an intermediate with dense and intermediate_act_fn whose
    output only the output child reads, that child with dense, dropout and LayerNorm), or None."""
    frame = structure.frame(layer)
    for inter_name, inter in layer._modules.items():
        node = norm_node(frame, inter_name) if frame is not None else None
        if node is None or not all(isinstance(getattr(inter, n, None), nn.Module) for n in ("dense",
                                                                                         "intermediate_act_fn")):
            continue
        uses, returned = frame.uses(node.outputs[0])
        out = layer._modules.get(uses[0].name) if len(uses) == 1 and uses[0].kind == "module" else None
        if not returned and out is not None and all(isinstance(getattr(out, n, None), nn.Module)
                                                    for n in ("dense", "dropout", "LayerNorm")):
            return inter_name, uses[0].name
    return None


@dataclasses.dataclass
class _LayerPlan:
    """What the structure shows can be fused in one layer, decided before anything is built: the split
    FFN (structure._split_ffn's pair, or None); the norms to hand over, [(name, consumer paths)], and
    those that stay, [(name, why, whether no other rule is to take it)]; the MLP children ({name:
    MLPParts}) and the other children with projections ({name: why no MLP}); what the probe found
    (Found: the norms' styles, the MLPs a norm may feed, the replayed call, the held MLP) and why the
    held MLP cannot be fused (or None)."""

    split_ffn: tuple | None
    norms: list
    unfused: list
    mlps: dict
    not_mlps: dict
    found: Found
    held_reason: str | None


def _layer_plan(layer, structure, frame, options, done):
    """The _LayerPlan of `layer` (a transformers module the probe called on hidden states); `done`: the
    children another rule took (q/k norms). Builds and changes nothing."""
    pair = _split_ffn(structure, layer) if options.wants("mlp") else None
    split = set(pair) if pair is not None else set()  # BERT's intermediate and output, the pair rule's
    mlps, not_mlps = structure_probe.mlp_children(structure, layer) if options.wants("mlp") else ({}, {})
    mlps = {n: parts for n, parts in mlps.items() if n not in split}
    not_mlps = {n: reason for n, reason in not_mlps.items() if n not in split}
    held, held_reason = _held(structure, layer, not_mlps) if options.wants("mlp") else (None, None)
    if held is not None:
        held_reason = _layer_mlp_reason(layer, held)
    norms = {n: c for n, c in layer._modules.items()
             if c is not None and n not in done and n not in split and structure_probe.is_norm(c)}
    rms = {n: structure_probe.rms_style(c) for n, c in norms.items() if type(c) is not nn.LayerNorm}
    styles = {n: style for n, (style, _) in rms.items()}
    found = Found(styles, {**mlps, **_nested_mlps(structure, layer, norms)}, _replay(frame), held)
    fusions, unfused = [], []
    for norm_name, norm in norms.items():
        node = structure_probe.norm_node(frame, norm_name)
        readers, reason = structure_probe.linear_readers(structure, frame, node.outputs[0]) if node else \
            (None, "not called once by the forward")
        reason = reason or _input_dtype_reason(structure, norm) or _routing_reason(structure, layer, readers)
        if reason is None and type(norm) is not nn.LayerNorm and styles[norm_name] is None:
            reason = f"{type(norm).__name__}: {rms[norm_name][1]}"
        if reason is None and options.wants("layernorm"):
            fusions.append((norm_name, _norm_consumers(readers, found.mlps)))
        elif reason is not None and (type(norm) is not nn.LayerNorm or _is_block(layer)):
            # a LayerNorm goes on to remat.nn.LayerNorm (a row of its own): not handled here
            unfused.append((norm_name, reason, type(norm) is not nn.LayerNorm))
    return _LayerPlan(pair, fusions, unfused, mlps, not_mlps, found, held_reason)


def _structural_rule(layer, structure, options, path, report, done=()):
    """Fuse what the structure probe shows safe in a transformers module: its norm children into the
    projections reading them, its MLP children and the MLP it holds, a split FFN (planned first, by
    _layer_plan, then each built, checked by a probe call and installed); the names of the children
    handled (`done`: those another rule handled, q/k norms, left alone)."""
    frame = structure.frame(layer)
    if frame is None or frame.layer_input() is None:
        return set()  # not called by the probe as a layer on the hidden states: its children go on their own
    plan = _layer_plan(layer, structure, frame, options, done)
    handled = set()
    if plan.split_ffn is not None:
        handled |= _pair_rule(layer, options, path, report, plan.split_ffn)
    fused = set()
    for norm_name, consumers in plan.norms:
        rows = len(report)
        taken = _hand_over(layer, norm_name, consumers, options, path, report, plan.found)
        fused |= taken
        if not taken and len(report) > rows and type(layer._modules[norm_name]) is not nn.LayerNorm:
            handled.add(norm_name)  # its row says why the fusion failed: no generic RMSNorm row as well
    for norm_name, reason, own_row in plan.unfused:
        report.add(join(path, norm_name), layer._modules[norm_name], "skipped",
                   f"not fused into a projection: {reason}")
        if own_row:
            handled.add(norm_name)
    held = plan.found.held
    handled |= fused | _held_mlp(layer, held, plan.held_reason, fused, options, path, report, plan.found.call)
    for name, parts in plan.mlps.items():
        if name not in handled and not is_converted(layer._modules[name]):
            reason = _mlp_rule(layer, name, layer._modules[name], options, path, report, parts)
            if reason:
                report.add(join(path, name), layer._modules[name], "skipped", reason)
            handled.add(name)
    holder = held.fc2.split(".")[0] if held is not None and "." in held.fc2 else None  # its rows say what it runs
    for name, reason in plan.not_mlps.items():  # an attention holds projections too: the rows above say what it runs
        child = layer._modules[name]
        if name not in handled and name != holder and not is_converted(child) and not _is_attention(child):
            report.add(join(path, name), child, "skipped", f"not fused as an MLP: {reason}")
    return {h for h in handled if "." not in h}


def _held(structure, layer, not_mlps):
    """(structure.LayerMLP, paths below `layer`) of the MLP `layer`'s own forward calls (BART's), or else one
    a child of it calls that is no MLP module of its own (BLOOM's BloomMLP, whose forward adds the
    residual after fc2); (None, why not) for a chain whose dropout cannot be followed; (None, None) for
    none, or one already converted."""
    held, reason = structure_probe.layer_mlp(structure, layer)
    for name in () if held is not None or reason else not_mlps:
        if not _is_attention(layer._modules[name]):
            below, reason = structure_probe.layer_mlp(structure, layer._modules[name])
            if below is not None or reason:
                held = below and structure_probe.LayerMLP(*(f"{name}.{n}" for n in below[:3]),
                                                          tuple(f"{name}.{a}" for a in below.dropout))
                break
    if held is not None and any(is_converted(submodule(layer, p)) for p in held[:3]):
        return None, None
    return held, reason


def _nested_mlps(structure, layer, norms):
    """{dotted path: MLPParts} of the MLP modules below the children of `layer` (a mixture of experts'
    shared expert, inside its block), where a norm's readers may lie."""
    found = {}
    for name, child in layer._modules.items():
        if child is not None and name not in norms and not is_converted(child) and list(child.children()):
            below, _ = structure_probe.mlp_children(structure, child)
            found.update({f"{name}.{n}": parts for n, parts in below.items()})
    return found


def _routing_reason(structure, layer, readers):
    """Why a norm cannot be handed to a mixture of experts' block whose experts or router read it: the
    block's forward in training mode differs from what the probe saw (Mixtral's router jitter scales
    the block's input in place, which would be the norm's input, the residual stream), or None."""
    blocks = {r.split(".")[0] for r in readers or () if "." in r and not widths(submodule(layer, r))}
    for name in sorted(blocks):
        reason = structure_probe.training_differs(structure, layer._modules[name])
        if reason:
            return f"{name}: {reason}"
    return None


def _input_dtype_reason(structure, norm):
    """Why a fused op cannot take the input the probe gave `norm`: another dtype than its weight (T5's
    norms after a wo kept in fp32, which the residual stream then carries), or None."""
    frame, weight = structure.frame(norm), getattr(norm, "weight", None)
    x = frame.hidden_states() if frame is not None else None
    if x is not None and weight is not None and x.dtype != weight.dtype:  # a LayerNorm may have no weight
        return f"its input is {x.dtype}, its weight {weight.dtype} (remat's fused ops take one dtype)"
    return None


def convert_children(parent, options, path, report, structure=None, attention_modules=None):
    """Fuse in a transformers module `parent` what the structure probe (structure.probe of the model)
    found; returns the names convert must not touch.
    attention_modules: a list collecting (path, module) of the attention modules that stay as they are,
    their attention function the model's implementation (interface.convert_attention reports them)."""
    handled = set()
    if structure is not None and from_transformers(type(parent)) and not is_converted(parent):
        verdicts = structure.__dict__.setdefault("qk_norm_verdicts", {})  # one replay per kind of attention
        handled |= head_norm.fuse_qk_norms(parent, structure, options, path, report, verdicts)
        handled |= _structural_rule(parent, structure, options, path, report, handled)
    for name, child in list(parent._modules.items()):
        if child is None or name in handled or not from_transformers(type(child)) or EXCLUDED in vars(child):
            continue  # (a module convert's filter_fn rejects has the row convert gives it)
        kind = type(child).__name__
        if _is_attention(child) and options.wants("attention") and not _holds_attention(child):
            if attention_modules is not None:  # T5LayerSelfAttention: its SelfAttention has the row
                attention_modules.append((join(path, name), child))
        elif _is_block(child) and _holds_norm(child) and (structure is None or structure.reason):
            why = f" and no probe of its structure: {structure.reason}" if structure is not None else ""
            report.add(join(path, name), child, "skipped",
                       f"no remat rule for {kind}{why}: its norms are not fused into the projections after "
                       "them, and its MLP is not fused")
    return handled


def _is_attention(module):
    return type(module).__name__.endswith(ATTENTION_SUFFIXES)


def _is_block(module):
    """A transformer block by its class name (…Layer, …Block): where a norm not fused is worth a row (a
    model's final norm or an embedding's is fused into nothing by design)."""
    return type(module).__name__.endswith(("Layer", "Block"))


def _holds_norm(module):
    return any(isinstance(m, nn.LayerNorm) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
               for m in module.children())
