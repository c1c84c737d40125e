"""The rules remat.convert applies to each module of a Hugging Face model: which modules are
swapped to the remat classes (modules.py), which LayerNorms are handed over to the projection after
them, each checked by a probe when it is made."""

import contextlib
import inspect

import torch
from torch import nn

from ..._guards import hook_reason
from ..._linears import fused_saved_bytes, projection, widths
from ..._numerics import rel_error
from ...ops.attention import HEAD_DIMS
from ..patterns import MLP, fusable, layer_norm_fusable
from ..swap import join, with_class
from .modules import RematFusedLayerNorm, _link, _RematIntermediate, _RematMLP, _RematOutput, remat_class
from .registry import attention_mixin, family_of, layer_rule, mlp_parts, pair_rule

ATTENTION_SUFFIXES = ("Attention",)


def _from_transformers(module):
    return type(module).__module__.startswith("transformers.")


def _mlp_reason(fc1, act, fc2):
    """None when fc1 -> act -> fc2 is remat.mlp (fc1 and fc2 Linear-like, peft's LoRA included), else why not."""
    return fusable(MLP, [fc1, act, fc2], labels=["fc1", "activation", "fc2"])


@contextlib.contextmanager
def _eval_mode(*modules):
    """Every submodule of `modules` in eval mode (no dropout) for the duration, then as it was."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    for m, _ in flags:
        m.training = False
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


def _probe(before, after, width, param, modules):
    """None when before(x) == after(x) on a small random x (or when it cannot run), else why not."""
    if param.is_meta:
        return None
    generator = torch.Generator().manual_seed(0)  # private: the caller's RNG stream is untouched
    x = torch.randn(2, 3, width, generator=generator).to(param.device, param.dtype)
    try:
        with torch.no_grad(), _eval_mode(*modules):
            want, got = before(x), after(x)
    except Exception as error:  # noqa: BLE001 - a forward this rule does not know how to call: leave it alone
        return f"probe failed ({type(error).__name__}: {error})"
    error = rel_error(got, want)
    tolerance = 1e-4 if param.dtype in (torch.float32, torch.float64) else 3e-2
    if not error <= tolerance:
        return f"probe mismatch (relative error {error:.2g}): this transformers version's forward differs"
    return None


def _instance_reason(module):
    """Why a stock module must keep its class: hooks, or a forward replaced on the instance."""
    if "forward" in vars(module):
        return "its forward is replaced on the instance"
    return hook_reason(module)


def _swapped(module, mixin, recompute, path, **attributes):
    new = with_class(module, remat_class(mixin, type(module), **attributes))
    new.__dict__["remat_recompute"], new.__dict__["remat_path"] = recompute, path
    return new


def _attention_reason(module):
    """None when `module` can take the remat path, else why it is left alone."""
    mixin = attention_mixin(type(module).__name__)
    reason = _instance_reason(module)
    if reason:
        return reason
    if getattr(module, "is_cross_attention", False):
        return "cross-attention (keys and values from the encoder)"
    expected = (mixin.remat_head_dim_attr, "scaling", "config", "is_causal", *mixin.remat_projections,
                *filter(None, [mixin.remat_output_projection]))
    missing = [n for n in expected if not hasattr(module, n)]
    if missing:
        return f"lacks the expected attributes {', '.join(missing)}"
    if any(widths(getattr(module, n)) is None for n in mixin.remat_projections):
        return "its q/k/v projections are not Linear-like (nn.Linear, Conv1D or peft's LoRA around one)"
    head_dim = getattr(module, mixin.remat_head_dim_attr)
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} is not one of remat's kernel head dims {HEAD_DIMS}"
    parameters = inspect.signature(type(module).forward).parameters
    needed = ["attention_mask", *filter(None, [mixin.remat_cache_arg]), *mixin.remat_extra_args]
    if any(n not in parameters for n in needed):
        return f"the forward's arguments are not {', '.join(needed)}: this transformers version differs"
    return None


def _fused_layer_norm(norm, path):
    new = with_class(norm, RematFusedLayerNorm)
    new.__dict__["remat_path"] = path
    return new


def _probe_kwargs(module, param):
    """Arguments a probe call of `module` (a layer or an attention) needs besides the input: no
    mask, and what its family says (GPT-NeoX's rotary cos and sin)."""
    kwargs = {"attention_mask": None} if "attention_mask" in inspect.signature(module.forward).parameters else {}
    family = family_of(module)
    if family is not None and family.probe_kwargs is not None:
        kwargs.update(family.probe_kwargs(module, param))
    return kwargs


def _first_output(output):
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def _tracing(module):
    """Inside: `module` records, per call, why it ran stock (None: its remat path ran)."""
    trace = []
    module.__dict__["remat_trace"] = trace
    try:
        yield trace
    finally:
        del module.__dict__["remat_trace"]


def _traced_probe(before, after, traced, width, param, modules):
    """_probe, and then why not when the calls of `traced` inside after(x) were not one remat path."""
    if param.is_meta:
        return None  # nothing to run on: not probed, as _probe
    trace = []

    def traced_after(x):
        with _tracing(traced) as calls:
            try:
                return after(x)
            finally:
                trace.extend(calls)

    reason = _probe(before, traced_after, width, param, modules)
    if reason is None and trace != [None]:
        reason = f"the probe call did not take the remat path ({trace[0] if trace else 'not called'})"
    return reason


def _swap_probe(owner, swaps, width, param, traced, call=None):
    """None when owner(x) (or call(owner, x)) is unchanged with `swaps` ({child name: new module})
    in place, and the remat path of `traced` (one of the swapped modules) is what ran; else why not."""
    originals = {name: owner._modules[name] for name in swaps}
    extra = _probe_kwargs(owner, param) if not param.is_meta else {}
    call = call or (lambda module, x: _first_output(module(x, **extra)))

    def after(x):
        owner._modules.update(swaps)
        try:
            return call(owner, x)
        finally:
            owner._modules.update(originals)

    return _traced_probe(lambda x: call(owner, x), after, traced, width, param, [owner, *swaps.values()])


def _self_probe(module, new, width, param):
    """Probe of a swapped module on its own: its remat path against the stock forward."""
    extra = _probe_kwargs(module, param) if not param.is_meta else {}
    return _traced_probe(lambda x: _first_output(module(x, **extra)), lambda x: _first_output(new(x, **extra)),
                         new, width, param, [module])


def _attention_width(module):
    first = getattr(module, attention_mixin(type(module).__name__).remat_projections[0])
    return widths(first)[0], first.weight


def _attention_row(path, name, module, new, norm_name=None):
    fused = f"; {norm_name} fused into its q/k/v projection" if norm_name else ""
    return (join(path, name), module, f"swapped to {type(new).__name__}",
            "remat.attention" + fused + "; the stock forward for padding masks, KV caches with past keys, "
            "output_attentions, dropout in training and other implementations than sdpa/eager",
            new.remat_saved_bytes)


def _attention_rule(parent, name, module, recompute, path, report):
    """Swap a stock attention module (no LayerNorm fused); returns the reason when it is not swapped."""
    reason = _attention_reason(module)
    if reason is None:
        new = _swapped(module, attention_mixin(type(module).__name__), recompute, join(path, name))
        width, param = _attention_width(module)
        reason = _self_probe(module, new, width, param)
    if reason:
        return reason
    parent._modules[name] = new
    report.add(*_attention_row(path, name, module, new))
    return None


def _fusable_norm(layer, norm_name, width, layers):
    norm = layer._modules.get(norm_name)
    if "layernorm" not in layers:
        return None, "layers excludes layernorm"
    if type(norm) is not nn.LayerNorm:
        return None, f"{norm_name} is {type(norm).__name__}, not exactly nn.LayerNorm"
    return norm, layer_norm_fusable(norm, width) or _instance_reason(norm) or hook_reason(layer)


def _add_norm_row(report, path, norm_name, norm, new_norm, consumer_name, consumer, into):
    report.add(join(path, norm_name), norm, "swapped to RematFusedLayerNorm",
               f"applied inside {consumer_name}, fused into {into}; returns its input",
               lambda: 0 if not consumer.remat_recompute else
               fused_saved_bytes(new_norm, [consumer._modules[n] for n in consumer.remat_norm_consumers]))


def _layer_attention(layer, norm_name, attn_name, layers, recompute, path, report):
    """Swap the attention of a pre-LN layer, with its LayerNorm fused in; the names handled."""
    module = layer._modules.get(attn_name)
    if not attention_mixin(type(module).__name__) or not _from_transformers(module):
        return set()
    if "attention" not in layers:
        return set()
    reason = _attention_reason(module)
    if reason:
        report.add(join(path, attn_name), module, "skipped", reason)
        return {attn_name}
    mixin = attention_mixin(type(module).__name__)
    width, param = _attention_width(module)
    norm, norm_reason = _fusable_norm(layer, norm_name, width, layers)
    if norm_reason is None:
        norm_reason = next(filter(None, (projection(getattr(module, n), n)[1] for n in mixin.remat_projections)),
                           None)
    if norm_reason is None:
        fused_norm = _fused_layer_norm(norm, join(path, norm_name))
        new = _swapped(module, mixin, recompute, join(path, attn_name))
        _link(layer, norm_name, fused_norm, attn_name, new)
        norm_reason = _swap_probe(layer, {norm_name: fused_norm, attn_name: new}, width, param, new)
        if norm_reason is None:
            layer._modules[norm_name], layer._modules[attn_name] = fused_norm, new
            new.__dict__["remat_norm_consumers"] = mixin.remat_projections
            report.add(*_attention_row(path, attn_name, module, new, norm_name))
            _add_norm_row(report, path, norm_name, norm, fused_norm, attn_name, new, "its q/k/v projection")
            return {norm_name, attn_name}
    if norm is not None and norm_reason != "layers excludes layernorm":
        report.add(join(path, norm_name), norm, "skipped", f"fusion into {attn_name}: {norm_reason}")
    reason = _attention_rule(layer, attn_name, module, recompute, path, report)
    if reason:
        report.add(join(path, attn_name), module, "skipped", reason)
    return {attn_name}


def _mlp_candidate(module, recompute, path):
    """(the swapped MLP for `module`, None) or (None, why not)."""
    parts = mlp_parts(type(module).__name__)
    fc1, act, fc2 = (getattr(module, n, None) for n in (parts.fc1, parts.act, parts.fc2))
    if fc1 is None or fc2 is None or act is None:
        return None, f"{type(module).__name__} lacks the expected submodules {parts.fc1}, {parts.act}, {parts.fc2}"
    reason = _instance_reason(module) or _mlp_reason(fc1, act, fc2)
    if reason:
        return None, reason
    return _swapped(module, _RematMLP, recompute, path, remat_parts=parts), None


def _mlp_row(path, name, module, new, norm_name=None):
    parts = mlp_parts(type(module).__name__)
    chain = f"{parts.fc1} -> {type(getattr(module, parts.act)).__name__} -> {parts.fc2}"
    if parts.dropout:
        chain += f" (+ {parts.dropout})"
    if norm_name:
        chain = f"{norm_name} -> {chain}"
    kept = "the GELU output is not kept" + (f", nor {norm_name}'s output" if norm_name else "")
    return join(path, name), module, f"swapped to {type(new).__name__}", f"fused {chain}: {kept}", \
        new.remat_saved_bytes


def _layer_mlp(layer, norm_name, mlp_name, layers, recompute, path, report):
    """Swap the MLP of a pre-LN layer with its LayerNorm fused in; the names handled (none when the
    plain MLP rule should run instead)."""
    module = layer._modules.get(mlp_name)
    if not mlp_parts(type(module).__name__) or not _from_transformers(module) or "mlp" not in layers:
        return set()
    parts = mlp_parts(type(module).__name__)
    fc1 = getattr(module, parts.fc1, None)
    if fc1 is None or widths(fc1) is None:
        return set()
    width = widths(fc1)[0]
    norm, reason = _fusable_norm(layer, norm_name, width, layers)
    if reason is None:
        reason = layer_norm_fusable(norm, width, need_bias=True)
    if reason is None:
        new, reason = _mlp_candidate(module, recompute, join(path, mlp_name))
        if reason is None:
            fused_norm = _fused_layer_norm(norm, join(path, norm_name))
            _link(layer, norm_name, fused_norm, mlp_name, new)
            reason = _swap_probe(layer, {norm_name: fused_norm, mlp_name: new}, width, fc1.weight, new)
        if reason is None:
            layer._modules[norm_name], layer._modules[mlp_name] = fused_norm, new
            new.__dict__["remat_norm_consumers"] = (parts.fc1,)
            report.add(*_mlp_row(path, mlp_name, module, new, norm_name))
            _add_norm_row(report, path, norm_name, norm, fused_norm, mlp_name, new, parts.fc1)
            return {norm_name, mlp_name}
    if norm is not None and reason != "layers excludes layernorm":
        report.add(join(path, norm_name), norm, "skipped", f"fusion into {mlp_name}: {reason}")
    return set()  # the MLP on its own, by the plain rule


def _mlp_rule(parent, name, module, recompute, path, report):
    new, reason = _mlp_candidate(module, recompute, join(path, name))
    if reason:
        return reason
    fc1 = getattr(module, mlp_parts(type(module).__name__).fc1)
    reason = _self_probe(module, new, widths(fc1)[0], fc1.weight)
    if reason:
        return reason
    parent._modules[name] = new
    report.add(*_mlp_row(path, name, module, new))
    return None


def _layer_rule(layer, layers, recompute, path, report):
    (norm1, attn), (norm2, mlp_name) = layer_rule(type(layer).__name__)
    if hook_reason(layer):
        report.add(path, layer, "skipped", f"{hook_reason(layer)}: no fusion across its children")
        return set()
    handled = _layer_attention(layer, norm1, attn, layers, recompute, path, report)
    return handled | _layer_mlp(layer, norm2, mlp_name, layers, recompute, path, report)


def _pair_rule(layer, recompute, path, report):
    inter_name, inter_class, out_name, out_class = pair_rule(type(layer).__name__)
    inter, out = getattr(layer, inter_name, None), getattr(layer, out_name, None)
    if type(inter).__name__ != inter_class or type(out).__name__ != out_class:
        return None  # already converted, or not the expected structure
    row_path = join(path, inter_name)
    fc1, act = getattr(inter, "dense", None), getattr(inter, "intermediate_act_fn", None)
    fc2, dropout, norm = (getattr(out, n, None) for n in ("dense", "dropout", "LayerNorm"))
    reason = _instance_reason(inter) or _instance_reason(out) or hook_reason(layer)
    if reason is None and not callable(getattr(layer, "feed_forward_chunk", None)):
        reason = f"{type(layer).__name__} has no feed_forward_chunk to check the FFN wiring against"
    if reason is None:
        reason = _mlp_reason(fc1, act, fc2) if isinstance(fc1, nn.Module) and \
            isinstance(fc2, nn.Module) else "dense layers missing"
    if reason is None and not isinstance(dropout, nn.Module):
        reason = "output.dropout is not a module"
    if reason is None and not isinstance(norm, nn.LayerNorm):
        reason = "output.LayerNorm is not an nn.LayerNorm"
    if reason is None:
        new_inter = _swapped(inter, _RematIntermediate, recompute, row_path)
        new_out = _swapped(out, _RematOutput, recompute, join(path, out_name))
        _link(layer, inter_name, new_inter, out_name, new_out)
        reason = _swap_probe(layer, {inter_name: new_inter, out_name: new_out}, widths(fc1)[0], fc1.weight,
                             new_out, call=lambda owner, x: owner.feed_forward_chunk(x))
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


def _holds_ruled_attention(module):
    return any(attention_mixin(type(m).__name__) and _from_transformers(m) for m in module.modules())


def convert_children(parent, layers, recompute, path, report):
    """Apply the family rules to `parent`'s children; returns the names convert must not touch."""
    handled = set()
    kind = type(parent).__name__
    if pair_rule(kind) and _from_transformers(parent) and "mlp" in layers:
        handled |= _pair_rule(parent, recompute, path, report) or set()
    if layer_rule(kind) and _from_transformers(parent):
        handled |= _layer_rule(parent, layers, recompute, path, report)
    for name, child in list(parent._modules.items()):
        if child is None or name in handled or not _from_transformers(child):
            continue
        kind = type(child).__name__
        if mlp_parts(kind) and "mlp" in layers:
            reason = _mlp_rule(parent, name, child, recompute, path, report)
            if reason:
                report.add(join(path, name), child, "skipped", reason)
            handled.add(name)
        elif attention_mixin(kind) and "attention" in layers:
            reason = _attention_rule(parent, name, child, recompute, path, report)
            if reason:
                report.add(join(path, name), child, "skipped", reason)
            handled.add(name)
        elif kind.endswith(ATTENTION_SUFFIXES) and "attention" in layers and not _holds_ruled_attention(child):
            report.add(join(path, name), child, "skipped", f"no remat rule for {kind}: it runs as it is")
        elif _unruled_layer(child):
            report.add(join(path, name), child, "skipped",
                       f"no remat rule for {kind}: its norms are not fused into the projections after "
                       "them, and its MLP is not fused")
    return handled


def _unruled_layer(module):
    """True for a transformers block (…Layer, …Block) holding a norm, that no family rule covers."""
    kind = type(module).__name__
    if layer_rule(kind) or pair_rule(kind) or not kind.endswith(("Layer", "Block")):
        return False
    return any(isinstance(m, nn.LayerNorm) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
               for m in module.children())
