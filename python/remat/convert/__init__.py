"""Model surgery: swap stock layers for remat's, keeping weights and state_dict keys.

    model = remat.convert(model)                     # a converted copy; inplace=True converts model itself
    model, report = remat.convert(model, report=True)
    model = remat.revert(model)                      # stock modules again, same parameters

What is swapped, the rules that keep a swap the same computation, state_dict and the fx path:
docs/conversion.md. The package, one job a module: patterns (what is fused, and the one check that
a run is fusable), swap (the one swap / revert / converted-marker mechanism), report,
torch_modules (torch's own layers one by one), sequential and fx (the fusions inside nn.Sequential
and inside any other module's forward), hf (Hugging Face models, by structure); this module walks
the model.
"""

import contextlib
import copy
import functools
import warnings
import weakref

import torch
from torch import nn

from .._guards import _MODULE_HOOKS, EXCLUDED, hook_reason
from . import hf
from .fx import fx_candidate, fx_consumed, fx_convert, fx_revert
from .options import LAYERS, ConvertOptions
from .patterns import fused_module
from .report import ConversionReport, ReportRow
from .sequential import RematSequential, revert_sequential, sequential_runs
from .swap import is_converted, join
from .torch_modules import RematMultiheadAttention, leaf_swap

__all__ = ["ConversionReport", "ConvertOptions", "RematMultiheadAttention", "RematSequential", "RematWarning",
           "ReportRow", "convert", "fused_module", "revert"]


def _convert_children(parent, options, path, report, hf_rules, consumed):
    """Convert below `parent`. hf_rules: the Hugging Face rules' convert_children (None: not a
    transformers model); consumed: ids of modules that fx rewrites call no more (left alone)."""
    handled = set()
    if hf_rules is not None:
        handled |= hf_rules(parent, options, path, report)
    if fx_candidate(parent) and options.wants("mlp", "layernorm"):
        consumed |= fx_convert(parent, options, path, report)
    consumed |= fx_consumed(parent)
    if type(parent) is nn.Sequential and options.wants("mlp", "layernorm"):
        if hook_reason(parent) is not None:
            report.add(path, parent, "skipped", f"Sequential {hook_reason(parent)}: no fusion inside")
        elif any(id(child) in consumed for child in parent):
            report.add(path, parent, "skipped", "a forward rewritten by torch.fx calls its layers: no fusion inside")
        else:
            handled |= sequential_runs(parent, options, path, report)
    elif isinstance(parent, nn.Sequential) and not isinstance(parent, RematSequential):
        report.add(path, parent, "skipped", "nn.Sequential subclass: no fusion inside (forward may differ)")
    for name, child in list(parent._modules.items()):
        if child is None or name in handled or id(child) in consumed:
            continue
        child_path = join(path, name)
        if is_converted(child):
            continue
        if EXCLUDED in vars(child):
            report.add(child_path, child, "skipped", f"{EXCLUDED_BY_FILTER}: it and the modules below it stay stock")
            continue
        new = leaf_swap(child, options, child_path, report)
        if new is not None:
            parent._modules[name] = new
        else:
            _convert_children(child, options, child_path, report, hf_rules, consumed)


class RematWarning(UserWarning):
    """remat.convert found nothing to fuse: the converted model keeps as many activation bytes as before."""


def _peft_inner(model):
    """(the model a peft PeftModel and its tuner wrap, and its path in `model`), or (model, "").

    peft's wrappers are not transformers models and their forwards take *args: the Hugging Face rules
    apply to the model inside, whose modules keep their names under base_model.model.
    """
    path = ""
    while type(model).__module__.startswith("peft."):
        name = next((n for n in ("base_model", "model") if isinstance(model._modules.get(n), nn.Module)), None)
        if name is None:
            break
        model, path = model._modules[name], join(path, name)
    return model, path


def convert(model, inplace=False, layers=LAYERS, recompute=True, report=False, *, filter_fn=None, dry_run=False):
    """Swap `model`'s layers for remat's where that is provably the same computation.

    inplace: convert `model` itself (its parameters stay the same objects) instead of a deep
    copy. layers: which rules to apply, one of or a subset of {"layernorm", "gelu", "attention",
    "mlp", "loss", "experts"} ("layernorm" also fuses LayerNorm -> Linear; LayerNorm -> MLP needs
    "mlp" and "layernorm"; "loss": a causal LM's head and loss; "experts": a mixture of experts'
    experts on remat.experts, through transformers' experts interface). recompute: the fused layers'
    switch (False keeps what eager keeps, to compare; the experts then keep their pre-activation).
    report: also return a ConversionReport (print it for a table, with the bytes each swap saves).
    filter_fn(module, fqn) -> bool: asked of every module, top down, the model itself included (fqn
    "", names as model.named_modules() gives them); a module it rejects stays stock with every module
    below it, and no fusion reads it (a norm outside it is not fused into a projection inside it; its
    attention and experts calls run the model's previous implementation). dry_run: convert nothing;
    return the report the conversion would give (the same rows; `model` is left as it is: classes,
    attention and experts implementations, parameters).

    Returns the converted model, or (model, report); with dry_run, the report. state_dict keys are unchanged and the
    original checkpoint loads into the result. A model converted before is reverted first (the copy,
    or with inplace=True the model itself) and its stock modules converted afresh: converting twice
    gives what one conversion with the second call's options gives, report included. A model a
    remat plan changed (checkpointed or offloaded layers) is refused: remat.revert(model) first.
    Hugging Face models (transformers PreTrainedModel, also inside a peft PeftModel) also get the
    Hugging Face rules of convert.hf (by structure). Warns (RematWarning) when the conversion saves no activation memory
    at all.
    """
    options = ConvertOptions(layers, recompute, filter_fn)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dry_run and inplace:
        raise ValueError("dry_run=True leaves the model as it is; inplace=True asks to convert it: pass one")
    _refuse_a_planned_model(model)
    _refuse_a_wrapped_model(model)
    converted = _converted_before(model)
    # the filter sees the caller's own modules (a filter on identities works), a converted model's once reverted
    excluded = None if converted else _excluded_paths(model, filter_fn)
    if dry_run:
        model = _shadow(model)
    elif not inplace:
        model = copy.deepcopy(model)
    if converted:  # remat's modules are not converted again: their stock ones are
        model = revert(model)
        excluded = _excluded_paths(model, filter_fn)
    with _excluding(model, excluded):
        model, rows = _convert(model, options, excluded)
    rows.model = weakref.ref(model)
    if dry_run:
        return rows
    _warn_broken_rules(rows)
    if rows.saved_bytes_per_token() == 0:
        warnings.warn(f"remat.convert saves no activation memory on this {type(_peft_inner(model)[0]).__name__}: "
                      f"{_why_nothing_saved(rows, excluded)}", RematWarning, stacklevel=2)
    return (model, rows) if report else model


def _convert(model, options, excluded):
    """(the model, its report): `model` converted in place, its modules at the paths `excluded` left
    stock (a new module where `model` itself is one remat swaps, a LayerNorm)."""
    rows = ConversionReport()
    if "" in excluded:
        rows.add("", model, "skipped", f"{EXCLUDED_BY_FILTER}: nothing is converted")
        return model, rows
    inner, inner_path = _peft_inner(model)
    hf_rules, attention_modules = None, []
    if hf.is_hf_model(inner):  # one probe call, before any module changes
        structure = hf.probe_structure(inner) if options.wants("layernorm", "mlp") else None
        hf_rules = functools.partial(hf.convert_children, structure=structure, attention_modules=attention_modules)
    order = {path or "(root)": i for i, (path, _) in enumerate(model.named_modules())}
    if hf.is_hf_model(inner) and options.wants("experts"):  # first: a norm before the experts is fused into them
        hf.convert_experts(inner, inner_path, rows, keep_hidden=not options.recompute)
    root = leaf_swap(model, options, "", rows) if inner is model else None
    if root is not None:
        model = root
    else:
        _convert_children(inner, options, inner_path, rows, hf_rules, set())
    if hf.is_hf_model(inner) and options.wants("attention"):
        hf.swap_bloom_attention(inner, inner_path, rows, options, attention_modules)
        hf.convert_attention(inner, inner_path, rows, attention_modules)
    if hf.is_hf_model(inner) and options.wants("loss"):
        hf.convert_loss(inner, inner_path, rows)
    rows.sort(key=lambda row: order.get(row.path, len(order)))  # rows in the model's module order
    return model, rows


def _why_nothing_saved(rows, excluded):
    if "" in excluded:
        return "filter_fn rejects the model itself (fqn ''), and a module it rejects stays stock with all below it"
    if not rows:  # not one module was a candidate: the report would be an empty table
        return ("it found none of the modules remat fuses (an nn.LayerNorm feeding an nn.Linear, an nn.Linear -> "
                "GELU -> nn.Linear MLP, in an nn.Sequential or a module's own forward; nn.MultiheadAttention; the "
                "norms, MLPs, attention and loss of the Hugging Face families of docs/huggingface.md); "
                "convolutions, ReLU MLPs and other layers stay as they are")
    return ("no fusion applies" if not rows.swapped else
            f"{len(rows.swapped)} modules swapped, none of them keeping less than stock") + \
        " (convert(model, report=True) says why for each module)"


# ---------------------------------------------------------------------------------------------
# filter_fn and dry_run
# ---------------------------------------------------------------------------------------------

EXCLUDED_BY_FILTER = "excluded by convert's filter_fn"
# What a module filter_fn rejects may gain: the model-wide attention and experts implementations reach
# every module, and these say it runs the previous one (hf/interface.py, hf/experts.py).
_STOCK_MARKS = frozenset({"remat_attention_previous", "remat_attention_path", "remat_attention_stock",
                          "remat_experts_previous", "remat_experts_path", "remat_experts_stock"})


def _excluded_paths(model, filter_fn):
    """The fqns of the modules of `model` filter_fn rejects, or that lie below one it rejects."""
    if filter_fn is None:
        return frozenset()
    excluded = set()
    for fqn, module in model.named_modules():  # parents before their children
        parent = fqn.rpartition(".")[0] if fqn else None
        if (parent is not None and parent in excluded) or not filter_fn(module, fqn):
            excluded.add(fqn)
    return frozenset(excluded)


@contextlib.contextmanager
def _excluding(model, paths):
    """While converting: the modules of `model` at `paths` marked for every rule's hook_reason to refuse
    (_guards.EXCLUDED); afterwards each is checked to be as it was, and the marks are gone."""
    if not paths:
        yield
        return
    modules = dict(model.named_modules())
    kept = {fqn: (modules[fqn], _stock_state(modules[fqn])) for fqn in paths}
    for fqn in paths:
        modules[fqn].__dict__[EXCLUDED] = EXCLUDED_BY_FILTER
    try:
        yield
    finally:
        for fqn in paths:
            modules[fqn].__dict__.pop(EXCLUDED, None)
    for fqn in sorted(paths):
        reason = _touched_reason(model, fqn, kept[fqn])
        if reason:
            raise RuntimeError(f"remat.convert changed {fqn}, which filter_fn excludes: {reason}. This is a bug of "
                               "remat's; convert with a filter that accepts it, or with layers= excluding the rule")


def _stock_state(module):
    """What remat may not change of a module filter_fn rejects: its class, its children that are remat's
    (a model may replace its own children in its forward: BigBird's attention), its remat_ entries but
    the stock marks, its hooks."""
    return (type(module), {name: child for name, child in module._modules.items() if is_converted(child)},
            {key for key in vars(module) if key.startswith("remat_")} - _STOCK_MARKS,
            [len(getattr(module, name)) for name in _MODULE_HOOKS])


def _touched_reason(model, fqn, kept):
    """Why the module excluded at `fqn` no longer computes as stock after conversion, or None: remat
    replaced or changed it, or a module of remat's above it computes in its place (swapped, a forward
    rewritten). A model may replace its own modules in its forward, which the probe calls (BigBird
    swaps its block-sparse attention for full attention on short inputs): stock modules in their place
    are the model's doing."""
    module = kept[0]
    placed = _at(model, fqn)
    if placed is not module:
        return "remat replaced it" if placed is None or is_converted(placed) else None
    if _stock_state(module) != kept[1]:
        return "its class, children, attributes or hooks changed"
    parts = fqn.split(".")
    for above_path in (".".join(parts[:i]) for i in range(len(parts))):
        above = _at(model, above_path)
        if "remat_head" in vars(above):  # the fused LM head and loss computes its head's work only
            if vars(above)["remat_head"] is module:
                return "the fused LM head and loss reads it"
        elif is_converted(above) or "remat_fx" in vars(above):
            return f"{above_path or 'the model'} above it computes in its place"
    return None


def _at(model, fqn):
    try:
        return model.get_submodule(fqn) if fqn else model
    except AttributeError:
        return None


def _shadow(model):
    """A copy of `model`'s modules holding its very parameters and buffers (no tensor is copied): what a
    dry run converts, leaving `model` as it is."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _converted_before(model):
    """Whether remat.convert changed some module of `model`: a remat class (the fused LM head and loss
    included), a forward rewritten by torch.fx, attention switched to remat's."""
    return any(is_converted(m) or "remat_fx" in vars(m) or "remat_attention_implementation" in vars(m)
               or "remat_experts_implementation" in vars(m) for m in model.modules())


def _refuse_a_planned_model(model):
    """A plan's checkpointed or offloaded layers are no conversion of convert's to redo: reverting them
    would drop the plan, and converting over them would change what the plan chose."""
    if any("remat_checkpoint" in vars(m) for m in model.modules()):
        raise ValueError("model carries a remat plan (checkpointed or offloaded layers): remat.revert(model) "
                         "first, then convert it, or apply the plan to the stock model")


def _refuse_a_wrapped_model(model):
    """A model a distributed engine already wraps or shards is refused before anything runs: convert's
    probe calls the model outside the engine (a collective only one rank enters hangs, a partitioned
    weight reads as size 0, a sharded root is left unsharded for an optimizer), and a deep copy of the
    wrapper fails. Converted first, the model is handed to the engine as any model is."""
    reason = _wrapped_reason(model)
    if reason:
        raise ValueError(f"model {reason}: remat.convert the model before handing it to the engine (convert, then "
                         "DistributedDataParallel, fully_shard, parallelize_module or deepspeed.initialize, or the "
                         "Trainer that calls them), which then wraps the converted modules")


def _wrapped_reason(model):
    """What wraps or shards `model` (DDP, FSDP, FSDP2, tensor parallel's DTensors, DeepSpeed), or None."""
    if type(model).__module__.startswith("deepspeed."):
        return f"is a DeepSpeed {type(model).__name__}"
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        where = f" ({name})" if name else ""
        if isinstance(module, nn.parallel.DistributedDataParallel):
            return f"is wrapped in DistributedDataParallel{where}"
        if isinstance(module, FullyShardedDataParallel):
            return f"is wrapped in FullyShardedDataParallel{where}"
        if isinstance(module, FSDPModule):
            return f"is sharded by FSDP2's fully_shard{where}"
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return (f"has DTensor parameters ({name}: tensor parallel or another DTensor sharding; a transformers "
                    "model loaded with from_pretrained(..., tp_plan=...) is sharded as it loads: load it without "
                    "tp_plan, convert it, then parallelize_module it)")
        if hasattr(param, "ds_id"):  # what deepspeed.zero.Init and ZeRO-3 set on the parameters they partition
            return (f"has DeepSpeed ZeRO-3 partitioned parameters ({name}; with transformers, a model loaded while "
                    "TrainingArguments(deepspeed=<a ZeRO-3 config>) exist is partitioned as it loads: load and "
                    "convert it first)")
    return None


def _warn_broken_rules(rows):
    """A fusion whose probe failed stays stock: say so, as that is a transformers release
    changing a forward the rule was written for, not a module remat never meant to convert."""
    broken = [row for row in rows.skipped if row.reason.startswith(hf.PROBE_BROKEN)]
    if broken:
        listed = "; ".join(f"{row.path}: {row.reason}" for row in broken[:3])
        more = f" (and {len(broken) - 3} more)" if len(broken) > 3 else ""
        warnings.warn(f"remat.convert: {len(broken)} modules that a rule of remat's is written for failed its "
                      f"probe and stay stock: {listed}{more}", RematWarning, stacklevel=3)




# ---------------------------------------------------------------------------------------------
# Revert
# ---------------------------------------------------------------------------------------------


def _revert_module(module):
    # left on stock modules by fallbacks and LoRA checks, and by a plan's offloaded units
    for name in ("remat_fallbacks", "remat_verified", "remat_offload"):
        module.__dict__.pop(name, None)
    if module.__dict__.pop("remat_checkpoint", None) is not None:  # checkpointed or offloaded in place by a plan
        del module.__dict__["forward"]
    if "remat_fx" in vars(module):
        fx_revert(module)
    revert_fn = getattr(module, "remat_revert", None)
    if revert_fn is not None:
        module = revert_fn()
    if isinstance(module, RematSequential):
        revert_sequential(module, _revert_module)
    for name, child in list(module._modules.items()):
        if child is not None:
            module._modules[name] = _revert_module(child)
    return module


def revert(model):
    """Undo remat.convert in place: stock modules again, holding the same parameters, and the attention
    implementation the model had. Returns the model."""
    for module in model.modules():
        hf.revert_attention(module)
        hf.revert_loss(module)
        hf.revert_experts(module)
    return _revert_module(model)
