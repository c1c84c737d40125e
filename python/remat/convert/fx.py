"""torch.fx: the LayerNorm -> Linear and [LayerNorm ->] Linear -> GELU -> Linear fusions inside any
module's own forward (modules other than torch's, transformers', peft's and remat's own).

A module such as

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))

holds its layers as attributes, so module structure alone does not say which feeds which.
torch.fx records the forward as a graph of calls; where a LayerNorm's (or an fc1 -> GELU's)
output goes to the next Linear and nowhere else, the run becomes one call of remat's fused
function on the same submodules. The module keeps its class, submodules, parameters and
state_dict; only its forward becomes the rewritten graph, and only for calls like the traced
one (FxRewrite.arguments): any other call runs the original forward.
"""

import collections
import contextlib
import functools
import inspect
import types
import weakref

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from .. import _zero3 as zero3
from .. import nn as remat_nn
from .._guards import fallback
from .._linears import fused_saved_bytes, projection, projections
from ..ops.fused import fused_mlp, norm_linears
from ..specs import gelu, norm_of
from .patterns import LAYER_NORM_LINEAR, LAYER_NORM_MLP, MLP, activation_reason, fusable, gelu_approximate
from .swap import is_converted, join


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
    with zero3.gathered(self, [module for _, module in rewrite.fused]):  # ZeRO-3: what the fused ops read
        return rewrite.programs[self.training](self, *required)


def fx_layer_norm_linear(x, norm, linear, recompute, label):
    """linear(norm(x)) on remat.ops.fused, reading the modules' parameters at call time; by their
    own forwards where they are not plain any more (label: the run, for the warning)."""
    proj, reason = projection(linear, "the Linear", zero3.is_hook)
    reason = remat_nn.norm_reason(norm, "the LayerNorm") or reason
    if reason:
        fallback(norm, reason, where=label)
        return linear(norm(x))
    return norm_linears(x, norm_of(norm), [proj], recompute)[0]


def fx_mlp(x, norm, fc1, act, fc2, approximate, recompute, label):
    """fc2(gelu(fc1(norm(x)))) on remat.ops.fused; norm None for fc2(gelu(fc1(x))), act None for F.gelu."""
    linears, reason = projections([fc1, fc2], ["fc1", "fc2"], zero3.is_hook)
    reason = reason or (remat_nn.norm_reason(norm, "the LayerNorm") if norm is not None else None)
    if reason is None and act is not None:
        reason = activation_reason(act, "the activation", allow=zero3.is_hook) or (
            None if gelu_approximate(act) == approximate else f"the activation is now {type(act).__name__}")
    if reason:
        fallback(norm if norm is not None else fc1, reason, where=label)
        h = fc1(norm(x) if norm is not None else x)
        return fc2(act(h) if act is not None else F.gelu(h, approximate=approximate))
    first, second = linears
    return fused_mlp(x, first, gelu(approximate), second, norm_of(norm) if norm is not None else None, recompute)


def _fx_owned(module):
    """Modules the fx path may rewrite: not torch's own (leaves, containers, and composites whose
    fast-path checks do not trace), not transformers' (remat.hf's rules), not remat's, not peft's
    (its wrappers run their own forwards; the fused layers compute LoRA layers in place). remat.gpt's
    TorchGPTBlock is the exception among remat's: stock PyTorch layers, rewritten as a user's block."""
    from ..gpt import TorchGPTBlock

    origin = type(module).__module__
    return (type(module) is TorchGPTBlock or not origin.startswith(("torch.", "transformers.", "remat.", "peft."))) \
        and not is_converted(module)


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


def _runs(root, graph, options):
    """([Fusion], [(module name, module, why skipped)]) for the runs in `graph`, in node order."""
    fusions, skips, taken = [], [], set()
    for node in graph.nodes:
        if node in taken:
            continue
        fusion = None
        norm = _called(root, node, nn.LayerNorm)
        if norm is not None and options.wants("layernorm"):
            fusion = _norm_run(root, node, norm, options, skips)
        linear = _called(root, node, nn.Linear)
        if fusion is None and linear is not None and options.wants("mlp"):
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
        reason = fusable(MLP, [fc1, _act_module(root, act, approximate), root.get_submodule(fc2_node.target)])
        if reason is None:
            return Fusion("MLP", (node, act, fc2_node), (node.target, _target(act), fc2_node.target), approximate)
    if reason:
        skips.append((node.target, fc1, f"MLP: {reason}"))
    return None


def _norm_run(root, node, norm, options, skips):
    """The Fusion starting at the LayerNorm `node` (LayerNormMLP before LayerNormLinear), or None
    (with a skip row where a Linear uses its output)."""
    if not any(_called(root, user, nn.Linear) is not None for user in node.users):
        return None  # the LayerNorm feeds no Linear: nothing to fuse it with
    fc1_node, reason = _only_user(node, node.target)
    if fc1_node is None:
        skips.append((node.target, norm, f"LayerNormLinear: {reason}"))
        return None
    fc1 = root.get_submodule(fc1_node.target)
    tail = _mlp_tail(root, fc1_node)[0] if options.wants("mlp") else None
    if tail is not None:
        act, fc2_node, approximate = tail
        fc2 = root.get_submodule(fc2_node.target)
        reason = fusable(LAYER_NORM_MLP, [norm, fc1, _act_module(root, act, approximate), fc2])
        if reason is None:
            return Fusion("LayerNormMLP", (node, fc1_node, act, fc2_node),
                          (node.target, fc1_node.target, _target(act), fc2_node.target), approximate)
        skips.append((node.target, norm, f"LayerNormMLP: {reason}"))
    reason = (None if type(fc1) is nn.Linear else f"{fc1_node.target} is {type(fc1).__name__}, not exactly nn.Linear") \
        or fusable(LAYER_NORM_LINEAR, [norm, fc1])
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


def fx_convert(module, options, path, report):
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
        runs, skips = _runs(module, graph, options)
        for target, sub, reason in skips:
            report.add(join(path, target), sub, "skipped", reason + mode)
        for fusion in runs:
            _fuse(graph, fusion, options.recompute, path or "(root)")
            first = module.get_submodule(fusion.targets[0])
            report.add(join(path, fusion.targets[0]), first, f"fused to {fusion.kind} (torch.fx)",
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


def fx_revert(module):
    """The original forward again: the rewrite only added an instance attribute over the class's forward."""
    del module.__dict__["forward"], module.__dict__["remat_fx"]


