"""Fusions found by structure: one probe call of the whole model at convert time records, for every
module, which tensors its forward hands to which of its children and torch functions; its layers
are then fused where that dataflow says it is safe:

- a norm (an exact nn.LayerNorm, or an RMSNorm whose forward rounds as one of remat's styles,
  checked bitwise) whose output is read by Linear-like projections and by nothing else (not the
  residual, not a view, not a function) is fused into them: into a recognised MLP, or into each
  projection, x and its statistics kept once;
- an MLP module whose forward is fc1 -> act -> fc2 (a dropout after fc2 allowed), down(act(gate(x))
  * up(x)) (a dropout before down allowed, fused while it does nothing), or down(act(g) * u) with
  g, u = gate_up(x).chunk(2) becomes the fused MLP;
- a layer handing its intermediate's output to its output module only (BERT-like FFNs split in two)
  gets the pair rule.

Nothing here reads a class name or calls a private method: what the probe did not see, or saw
used otherwise, stays stock with the reason in the report; every fusion is then checked
numerically against the stock forward, replayed with the arguments the probe recorded.
"""

import collections
import contextlib
import copy
import inspect

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..._guards import from_transformers
from ..._linears import widths
from ...ops.rms_norm import rms_norm_output_ref, rms_norm_rstd_ref
from ...specs import RMS_NORM_STYLES
from .experts import METADATA as _METADATA
from .experts import RESHAPES, is_experts_module
from .modules import MLPParts, _RematGatedMLP
from .probe import training_mode

# A call recorded in a module's forward: a child module ("module", its name) or a torch function
# ("function", its name), with the ids of the tensors it read and returned, and the probability a
# dropout function was called with (else None).
Node = collections.namedtuple("Node", "kind name inputs outputs p", defaults=(None,))

# An MLP a layer holds itself, its forward calling fc2(dropout(act(fc1(x)))) (BART, Whisper): the
# child names, and the names of the layer attributes holding the probability of the dropout between
# the activation and fc2 (every attribute whose value it was: empty where there is none).
LayerMLP = collections.namedtuple("LayerMLP", "fc1 act fc2 dropout")


# The probe's batch: every hidden state it records is (PROBE_BATCH, tokens, width), the shape of a
# layer's input; token ids are (PROBE_BATCH, PROBE_TOKENS).
PROBE_BATCH, PROBE_TOKENS = 2, 3


def _metadata(node):
    """A function call that read metadata only (no tensor out): not a use of its input's values."""
    return node.kind == "function" and node.name in _METADATA and not node.outputs


def _tensors(value):
    """The tensors in `value` (nested tuples, lists, dicts, transformers' ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


class Frame:
    """The first call of one module: its arguments, the calls its own forward made (not those inside
    its children), and the ids of the tensors it returned."""

    def __init__(self, module, args, kwargs):
        self.module, self.args, self.kwargs = module, args, kwargs
        self.inputs = [id(t) for t in _tensors((args, kwargs))]
        self.nodes, self.outputs, self.open = [], (), True

    def uses(self, tensor_id):
        """The nodes reading the tensor (metadata reads aside), and whether the forward returned it."""
        nodes = [n for n in self.nodes if tensor_id in n.inputs and not _metadata(n)]
        return nodes, tensor_id in self.outputs

    def hidden_states(self):
        """The first positional tensor argument (the hidden states of a layer or MLP), or None."""
        first = self.args[0] if self.args else self.kwargs.get("hidden_states")
        return first if isinstance(first, torch.Tensor) else None

    def layer_input(self):
        """hidden_states() where they are (PROBE_BATCH, tokens, width), as a layer's are, else None."""
        x = self.hidden_states()
        return x if x is not None and x.dim() == 3 and x.shape[0] == PROBE_BATCH else None


class _Recorder(TorchFunctionMode):
    """Records a Frame per module (its first call) while the model runs once."""

    def __init__(self, model):
        super().__init__()
        self.frames, self.stack, self.keep, self.handles = {}, [], [], []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave, with_kwargs=True, always_call=True))

    def _frame(self):
        """The frame of the module whose own forward is running now, while it records."""
        frame = self.frames.get(self.stack[-1]) if self.stack else None
        return frame if frame is not None and frame.open else None

    def _enter(self, module, args, kwargs):
        parent = self._frame()
        if parent is not None:
            parent.nodes.append(Node("module", _child_name(parent.module, module),
                                     [id(t) for t in _tensors((args, kwargs))], []))
        if module not in self.frames:
            self.keep.append((args, kwargs))
            self.frames[module] = Frame(module, args, kwargs)
        self.stack.append(module)

    def _leave(self, module, args, kwargs, output):
        self.stack.pop()
        self.keep.append(output)  # ids stay unique while the probe runs
        outputs = [id(t) for t in _tensors(output)]
        frame = self.frames[module]
        if frame.open and module not in self.stack:
            frame.outputs, frame.open = outputs, False
        parent = self._frame()
        if parent is not None and parent.nodes:
            parent.nodes[-1].outputs.extend(outputs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = self._frame()
        if frame is not None:
            self.keep.append(out)
            name = getattr(func, "__name__", str(func))
            p = (kwargs or {}).get("p", args[1] if len(args) > 1 else None) if name == "dropout" else None
            frame.nodes.append(Node("function", name, [id(t) for t in _tensors((args, kwargs))],
                                    [id(t) for t in _tensors(out)], p))
        return out

    def close(self):
        for handle in self.handles:
            handle.remove()


def _child_name(parent, module):
    """The name of `module` among `parent`'s children; for a module the forward of `parent` calls that
    is none of its children (one held in a plain attribute, or a grandchild), a name no child has, which
    says so: the dataflow through it is then none this probe fuses."""
    name = next((n for n, c in parent._modules.items() if c is module), None)
    return name if name is not None else f"<{type(module).__name__}, not a child of {type(parent).__name__}>"


def _token_ids(config, batch, tokens):
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        return None
    return torch.randint(0, min(vocab, 100), (batch, tokens), generator=torch.Generator().manual_seed(4))


def _pixels(config, batch, tokens):
    """Images of the size the config says (its vision_config's, for a model of two towers), or None."""
    config = getattr(config, "vision_config", None) or config
    size = getattr(config, "image_size", None)
    height, width = (size, size) if isinstance(size, int) else tuple(size or (None, None))[:2]
    if not isinstance(height, int) or not isinstance(width, int):
        return None
    shape = (batch, getattr(config, "num_channels", 3), height, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(6))


def _mel_frames(config, batch, tokens):
    """Log-mel features of the one length a Whisper-like encoder takes: its two convolutions halve
    2 * max_source_positions frames to max_source_positions tokens, and it checks that length."""
    bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if not isinstance(bins, int) or not isinstance(positions, int):
        return None
    return torch.randn(batch, bins, 2 * positions, generator=torch.Generator().manual_seed(7))


def _waveform(config, batch, tokens):
    """Raw audio for a wav2vec2-like encoder: its convolutions' receptive field plus a stride per token."""
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not kernels or not strides or len(kernels) != len(strides):
        return None
    field, hop = 1, 1
    for kernel, stride in zip(kernels, strides, strict=True):
        field, hop = field + (kernel - 1) * hop, hop * stride
    return torch.randn(batch, field + hop * (tokens - 1), generator=torch.Generator().manual_seed(9))


# How each main input a model may name is made from its config, for `batch` sequences of `tokens`
# (images and log-mel features: the size their config says).
_MAKERS = {"input_ids": _token_ids, "pixel_values": _pixels, "input_features": _mel_frames,
           "input_values": _waveform}


def example_inputs(model, batch, tokens, device, dtype, images=False):
    """({name: tensor}, None): random inputs of the transformers `model` from its config (its main
    input: token ids, images or log-mel features; an encoder-decoder's decoder token ids; with
    images=True, images besides token ids, for a model of a text and a vision tower), on `device`,
    floats in `dtype`; or (None, why not)."""
    config, main = model.config, model.main_input_name
    make = _MAKERS.get(main)
    inputs = {main: make(config, batch, tokens)} if make is not None else {}
    if inputs.get(main) is None:
        return None, f"its input {main} is none made from its config ({', '.join(_MAKERS)})"
    decoder = "decoder_input_ids" in inspect.signature(model.forward).parameters  # not T5EncoderModel
    if getattr(config, "is_encoder_decoder", False) and decoder:
        inputs["decoder_input_ids"] = _token_ids(config, batch, tokens)
    if images and main != "pixel_values":
        inputs["pixel_values"] = _pixels(config, batch, tokens)
    if any(x is None for x in inputs.values()):
        return None, f"its config does not say how to make {', '.join(n for n, x in inputs.items() if x is None)}"
    return {name: x.to(device, dtype) if x.is_floating_point() else x.to(device) for name, x in inputs.items()}, None


class _MetaReads(TorchDispatchMode):
    """Answers the data-dependent reads of a probe call on meta tensors, which hold no values: a
    tensor read as a Python number (.item(), bool(), an `if` on a tensor) reads 1, True: the token
    ids' positions unpacked, the all-ones masks all visible. Only transformers' mask building reads
    values there; the dataflow between a layer's modules does not depend on them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


class Structure:
    """What the probe call recorded of a model: Frames, and why there are none (reason)."""

    def __init__(self, frames, reason=None):
        self.frames, self.reason = frames, reason

    def frame(self, module):
        return self.frames.get(module)


def probe(model):
    """Run `model` once on a small input (example_inputs; eval mode, no grad, on its parameters' device, meta
    included) and record every module's dataflow; Structure(frames) or Structure({}, why not)."""
    param = next(model.parameters(), None)
    if param is None:
        return Structure({}, "it has no parameters")
    dtype = param.dtype if param.is_floating_point() else torch.float32  # fp32 beside quantised weights
    inputs, reason = example_inputs(model, PROBE_BATCH, PROBE_TOKENS, param.device, dtype)
    if reason:
        return Structure({}, f"no probe input: {reason}")
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False  # the layers' calls recorded without a cache, as in training
    frames, error = _record(model, param, (), inputs)
    if error is not None and "pixel_values" in inspect.signature(model.forward).parameters:
        images, _ = example_inputs(model, PROBE_BATCH, PROBE_TOKENS, param.device, dtype, images=True)
        if images is not None:  # CLIP, SigLIP: the call needs both towers' inputs
            frames, error = _record(model, param, (), {**inputs, **images})
    if error is not None:
        return Structure({}, f"its probe call failed ({type(error).__name__}: {error})")
    return Structure(frames)


def _record(module, param, args, kwargs, training=False):
    """(the Frames of one call of `module` on `args` and `kwargs`, in training mode `training` (False: eval
    mode), without gradients, None), or (None, the exception it raised)."""
    recorder = _Recorder(module)
    meta_reads = _MetaReads() if param.is_meta else contextlib.nullcontext()
    try:
        with torch.no_grad(), training_mode(training, module), meta_reads, recorder:
            module(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a forward this probe cannot call: no structural fusion
        return None, error
    finally:
        recorder.close()
    return recorder.frames, None


# ---------------------------------------------------------------------------------------------
# Reading the dataflow
# ---------------------------------------------------------------------------------------------


def _reshape(node):
    return node.kind == "function" and node.name in RESHAPES and len(node.outputs) == 1


def linear_readers(structure, frame, tensor_id, prefix=""):
    """(paths below frame's module of the modules reading the tensor, None), following it through
    reshapes and into child modules that pass it on; or (None, why something else reads it). A
    reader is a Linear-like module, an experts module (transformers' experts interface) or a router
    (a module projecting the tensor with its own weight: routes)."""
    nodes, returned = frame.uses(tensor_id)
    owner = type(frame.module).__name__
    if returned:
        return None, f"{owner}'s forward returns it"
    readers = []
    for node in nodes:
        if _reshape(node):
            found, reason = linear_readers(structure, frame, node.outputs[0], prefix)
            if reason:
                return None, reason
            readers += [r for r in found if r not in readers]
            continue
        child = frame.module._modules.get(node.name) if node.kind == "module" else None
        if node.kind == "function":
            return None, f"{node.name}() in {owner}'s forward reads it"
        if child is None:
            return None, f"{node.name} in {owner}'s forward reads it"
        if widths(child) is not None or is_experts_module(child) or routes(structure, child, tensor_id):
            if prefix + node.name not in readers:
                readers.append(prefix + node.name)
            continue
        inner = structure.frame(child)
        if inner is None or tensor_id not in inner.inputs:
            return None, f"{prefix}{node.name} reads it without a recorded call"
        found, reason = linear_readers(structure, inner, tensor_id, f"{prefix}{node.name}.")
        if reason:
            return None, reason
        readers += found
    if not readers:
        return None, "no projection reads it"
    return readers, None


# Functions a router may apply to the tokens before its projection: casts (DeepSeek-V3's and Nemotron-H's
# routers project in fp32); and type_as(t, tokens), which reads the tokens' dtype only.
_CASTS = frozenset({"type", "to", "float"})


def routes(structure, module, tensor_id):
    """Whether `module` is a router of the tensor: its forward reads it only through reshapes and casts
    into one linear() with the module's own 2-D weight (or the weight cast), the router's logits,
    whatever it then does with them (softmax, top-k, grouped choices)."""
    weight = getattr(module, "weight", None)
    frame = structure.frame(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or frame is None or tensor_id not in frame.inputs:
        return False
    ids, weights, projections = {tensor_id}, {id(weight)}, 0
    for node in frame.nodes:
        read = ids.intersection(node.inputs)
        if node.kind == "function" and node.name in _CASTS and node.inputs[:1] == [id(weight)]:
            weights.update(node.outputs)
        if not read or _metadata(node) or (node.name == "type_as" and node.inputs[0] not in ids):
            continue
        if _reshape(node) or (node.kind == "function" and node.name in _CASTS and node.inputs[0] in ids):
            ids.update(node.outputs)
        elif node.kind == "function" and node.name == "linear" and len(read) == 1 and node.inputs[0] in ids \
                and len(node.inputs) > 1 and node.inputs[1] in weights:
            projections += 1
        else:
            return False
    return projections == 1 and not ids.intersection(frame.outputs)


def training_differs(structure, module):
    """Why `module`'s forward in training mode is not the one the probe recorded in eval mode (it calls
    other functions or children: a step only training takes, such as Mixtral's router jitter, which
    scales its input in place), or None. Runs it once more, in training mode, without gradients, on the
    arguments the probe gave it."""
    frame = structure.frame(module)
    param = next(module.parameters(), None)
    if frame is None or param is None:
        return None
    frames, error = _record(module, param, frame.args, frame.kwargs, training=True)
    if error is not None:  # a forward the probe cannot call in training: not fused
        return f"its forward in training mode failed on the probe's input ({type(error).__name__}: {error})"
    trained = frames.get(module)
    if trained is None or [n[:2] for n in trained.nodes] != [n[:2] for n in frame.nodes]:
        return (f"{type(module).__name__}'s forward in training mode calls other functions than in eval mode (a "
                "step only training takes, such as a router's jitter)")
    return None


def norm_node(frame, name):
    """The one call of the child `name` in frame, or None (not called, or called more than once)."""
    calls = [n for n in frame.nodes if n.kind == "module" and n.name == name]
    return calls[0] if len(calls) == 1 and len(calls[0].outputs) == 1 else None


def is_norm(module):
    """An exact nn.LayerNorm, or a transformers module with a 1-D weight and a float eps (an RMSNorm
    candidate; rms_style says whether it is one)."""
    if type(module) is nn.LayerNorm:
        return True
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    return from_transformers(type(module)) and isinstance(weight, nn.Parameter) and weight.dim() == 1 and \
        isinstance(eps, float) and widths(module) is None and not list(module.children())


def rms_mismatch(norm, style):
    """Why the RMSNorm candidate `norm`'s forward is not remat's `style`: it takes more than its input
    (a gated RMSNorm's gate), fails on a random input, or differs from `style` bitwise on it in its
    weight's dtype or in bf16; None when it equals it in both. A norm on meta is checked as a copy on
    the CPU with random weights (its forward's rounding is what is compared)."""
    extra = _inputs_besides_the_first(norm)
    if extra:
        return f"its forward takes {', '.join(extra)} besides its input"
    if norm.weight.is_meta:
        norm = _cpu_copy(norm)
    weight, eps = norm.weight, getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    x = torch.randn(6, weight.shape[0], generator=torch.Generator().manual_seed(3))
    for dtype in dict.fromkeys((weight.dtype, torch.bfloat16)):
        xi = x.to(weight.device, dtype)
        with torch.no_grad():
            try:
                want = norm(xi)
            except Exception as error:  # noqa: BLE001 - a forward this check cannot call: not remat's norm
                return f"its forward fails on a {tuple(xi.shape)} {dtype} input ({type(error).__name__}: {error})"
            got = rms_norm_output_ref(xi, weight, rms_norm_rstd_ref(xi, eps), style)
        if not isinstance(want, torch.Tensor) or want.dtype != got.dtype or not torch.equal(want, got):
            return f"its forward does not round as remat's {style!r} RMSNorm on {dtype} input"
    return None


def _inputs_besides_the_first(module):
    """The names of the parameters `module`'s forward needs besides its first (no default), e.g. a
    gated RMSNorm's gate: a forward called on its input alone would raise."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the call itself says (rms_mismatch)
        return []
    needed = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
              inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters[1:] if p.kind in needed and p.default is inspect.Parameter.empty]


def _cpu_copy(module):
    """A copy of the meta `module` on the CPU, its parameters and buffers drawn near 1 (seeded)."""
    return near_one(copy.deepcopy(module).to_empty(device="cpu"))


def near_one(twin):
    """`twin` (a CPU copy of a module, to run its forward on) with its floating parameters and buffers
    drawn near 1 (seeded)."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tensor in (*twin.parameters(), *twin.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
    return twin


def rms_style(norm):
    """(the style of remat's RMSNorm that `norm`'s forward computes bitwise, None), or (None, why none:
    rms_mismatch's reasons, one per style where they differ)."""
    reasons = {}
    for style in RMS_NORM_STYLES:
        reason = rms_mismatch(norm, style)
        if reason is None:
            return style, None
        reasons.setdefault(reason, style)
    if len(reasons) == 1:
        return None, next(iter(reasons))
    return None, f"its forward is none of remat's RMSNorm styles {RMS_NORM_STYLES} bitwise"


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------


def _child(frame, node):
    """The child module of frame's module a node called, or None (a function, or a module not its child)."""
    return frame.module._modules.get(node.name) if node.kind == "module" else None


def _linear(frame, node):
    child = _child(frame, node)
    return child is not None and widths(child) is not None


def _activation(frame, node):
    """Whether the node called a child module that is not Linear-like (an MLP's activation)."""
    return _child(frame, node) is not None and not _linear(frame, node)


def _reads(node, producer, index=0):
    return producer is not None and len(producer.outputs) > index and producer.outputs[index] in node.inputs


def mlp_parts(structure, module):
    """(MLPParts of `module`'s forward, None) when the probe saw fc1 -> act -> fc2 [-> dropout],
    down([dropout](act(gate(x)) * up(x))) or down(act(g) * u) with (g, u) = gate_up(x).chunk(2); else
    (None, why)."""
    frame = structure.frame(module)
    if frame is None or frame.hidden_states() is None:
        return None, "the probe did not call it with hidden states"
    nodes = [n for n in frame.nodes if not _metadata(n)]
    x = id(frame.hidden_states())
    calls = [(n.kind, n.name) for n in nodes]
    firsts = [n for n in nodes if x in n.inputs]
    if not firsts or not all(_linear(frame, n) for n in firsts):
        return None, f"its input goes to {', '.join(n.name for n in firsts) or 'nothing'}, not projections only"
    if len(firsts) == 1 and len(nodes) >= 3 and all(n.kind == "module" for n in nodes[:3]) and \
            _activation(frame, nodes[1]) and _linear(frame, nodes[2]) and len(nodes) <= 4:
        fc1, act, fc2, *rest = nodes  # plain: fc1 -> act -> fc2, a dropout module after
        dropout = rest[0] if rest else None
        last = dropout or fc2
        if _reads(act, fc1) and _reads(fc2, act) and (dropout is None or (dropout.kind == "module" and _reads(
                dropout, fc2) and isinstance(module._modules.get(dropout.name), nn.Dropout))) and \
                frame.outputs == last.outputs[:1]:
            return MLPParts(fc1.name, act.name, fc2.name, dropout.name if dropout else None), None
    by_kind = collections.Counter(kind for kind, _ in calls)
    if by_kind["module"] in (4, 5) and len(firsts) == 2 and by_kind["function"] == 1:
        act = next((n for n in nodes if _activation(frame, n)), None)
        mul, down = next((n for n in nodes if n.kind == "function"), None), nodes[-1]
        gate = next((n for n in firsts if _reads(act, n)), None) if act is not None else None
        up = next((n for n in firsts if n is not gate), None)
        dropout = _dropout_between(nodes, module, mul, down) if by_kind["module"] == 5 else None
        if gate is not None and mul.name in ("mul", "__mul__") and _reads(mul, act) and _reads(mul, up) and \
                _linear(frame, down) and _reads(down, dropout or mul) and frame.outputs == down.outputs[:1] and \
                (dropout is not None or by_kind["module"] == 4):
            return MLPParts((gate.name, up.name), act.name, down.name, dropout and dropout.name, _RematGatedMLP), None
    if by_kind["module"] == 3 and len(firsts) == 1 and by_kind["function"] == 2:
        gate_up, chunk, act, mul, down = nodes if len(nodes) == 5 else (None,) * 5
        if chunk is not None and chunk.name == "chunk" and _reads(chunk, gate_up) and _activation(frame, act) and \
                _reads(act, chunk, 0) and \
                mul.name in ("mul", "__mul__") and _reads(mul, act) and _reads(mul, chunk, 1) and \
                _linear(frame, down) and _reads(down, mul) and frame.outputs == down.outputs[:1]:
            return MLPParts(gate_up.name, act.name, down.name, None, _RematGatedMLP), None
    listed = ", ".join(name for _, name in calls)
    return None, f"its forward ({listed}) is none of fc1 -> act -> fc2, down(act(gate) * up), down(act(g) * u)"


def _dropout_between(nodes, module, producer, consumer):
    """The node of an nn.Dropout child of `module` reading `producer`'s output, called just before
    `consumer` (T5's gated FFN: down(dropout(act(gate(x)) * up(x)))), or None; nodes: the calls of
    `module`'s forward, metadata reads aside."""
    index = nodes.index(consumer)
    node = nodes[index - 1] if index > 0 else None
    if node is None or node.kind != "module" or not _reads(node, producer):
        return None
    return node if type(module._modules.get(node.name)) is nn.Dropout else None


def mlp_children(structure, layer):
    """({child name: MLPParts} of the children of `layer` the probe saw as MLPs, {child name: why not}
    of its other transformers children holding two Linear-likes or more)."""
    found, refused = {}, {}
    for name, child in layer._modules.items():
        if child is not None and from_transformers(type(child)) and sum(
                widths(c) is not None for c in child.children()) >= 2:
            parts, reason = mlp_parts(structure, child)
            if parts is not None:
                found[name] = parts
            else:
                refused[name] = reason
    return found, refused


def _next_call(frame, node):
    """(the one call reading `node`'s one output, a dropout function between them or None), each
    output read by nothing else and not returned; (None, None) otherwise. In the probe's eval mode
    a dropout returns its input: the call after it reads that same tensor."""
    if len(node.outputs) != 1:
        return None, None
    uses, returned = frame.uses(node.outputs[0])
    dropouts = [u for u in uses if u.kind == "function" and u.name == "dropout"]
    others = [u for u in uses if u not in dropouts]
    if returned or len(dropouts) > 1:
        return None, None
    dropout = dropouts[0] if dropouts else None
    if dropout is not None and dropout.outputs != node.outputs:  # a new tensor: read by the call after it
        if others:
            return None, None
        uses, returned = frame.uses(dropout.outputs[0]) if len(dropout.outputs) == 1 else ([], True)
        others = [] if returned else uses
    return (others[0], dropout) if len(others) == 1 else (None, None)


def layer_mlp(structure, layer):
    """(LayerMLP, None) when `layer`'s own forward calls fc2([dropout](act(fc1(x)))), each output read
    by the next call only, fc1 and fc2 Linear-like children and act a child module; (None, why not)
    when it calls such a chain with a dropout whose probability no attribute of the layer holds;
    (None, None) when it calls none."""
    frame = structure.frame(layer)
    for fc1 in [n for n in frame.nodes if _linear(frame, n)] if frame is not None else ():
        act, between = _next_call(frame, fc1)
        if act is None or between is not None or not _activation(frame, act):
            continue
        fc2, dropout = _next_call(frame, act)
        if fc2 is None or not _linear(frame, fc2):
            continue
        if dropout is None:
            return LayerMLP(fc1.name, act.name, fc2.name, ()), None
        attributes = tuple(name for name, value in vars(layer).items()
                           if not name.startswith("_") and type(value) is float and value == dropout.p)
        if not attributes:
            return None, (f"the dropout between {act.name} and {fc2.name} (p={dropout.p}) reads no attribute of "
                          f"{type(layer).__name__}: whether it drops in training is unknown")
        return LayerMLP(fc1.name, act.name, fc2.name, attributes), None
    return None, None
