"""q/k norms fused into remat's attention: the attention keeps the projections' outputs, not q and k.

Qwen3, OLMo2/3, Gemma3 and others normalise q and k (per head, or over all heads: OLMo2) between
their projections and the rotary embedding:

    q = rope(q_norm(q_proj(x)) as (batch, heads, seq, head_dim), cos, sin); k likewise; attention(q, k, v)

Stock, transformers' RMSNorm keeps an fp32 copy of its input and its normalised x, and the
attention keeps the post-rope q and k besides: about three times q's bytes more than a layer
without these norms. Swapping the norm for a cheaper one alone does not help, as the attention
keeps q and k anyway. So here the attention keeps the projection outputs (x_q, x_k: what the norms
read) and the norms' fp32 rstd (4 bytes a row), and rebuilds norm + rope in its backward.

Convert time (fuse_qk_norms, for a transformers module the structure probe saw):
- two children are RMSNorms rounding as one of remat's styles (checked bitwise), each reading a
  Linear-like child's output through views only, their outputs read by functions only (the
  transpose, the rotary embedding) and not returned;
- a replay of each such module (on its own weights and the probe's arguments, in their dtype; on
  meta, once per kind of module, on a CPU copy with random weights) checks bitwise that
  rope(norm(x)) rebuilt here, with the position_embeddings the module was handed, is the query and
  the key its forward hands the attention interface; that replay also tells which norm is q's,
  which k's, and how each norm's output becomes (batch, heads, seq, head_dim). A layer whose forward
  takes another path (AFMoE's global layers: no rope) fails it and keeps its norms stock, with why;
  the norms fuse in the replay's dtype only (another runs them stock, with why);
- the norms become _RematHeadNorm (their forward: the stock sequence of operations, bitwise, as an
  autograd Function keeping x and rstd only), and the module gets a forward pre-hook (capturing its
  position_embeddings and whether a cache holds past keys) and a forward hook (closing the call).

Call time: each norm records (x, its version, rstd) in the module's open call; remat's attention
function (interface.attention_forward) asks fused_attention, which checks the call cheaply (both
norms ran in this call, unchanged since, shapes and dtypes as the rebuild makes them, no past keys,
grad enabled, no autocast) and runs NormRopeAttention (ops/qk_norm_attention.py): its forward runs
remat's attention kernel (remat.attention's, or remat.attention_varlen's on the tokens of a padded
or packed batch) on the q
and k the model made (bitwise what the backward rebuilds), keeps x_q, x_k, v, o, lse and the rstds;
its backward rebuilds q and k (the norm and rope as PyTorch ops in the backward, not inside the
kernel's loads), runs the attention backward, then the rope's transpose and the RMSNorm backward
(dx, dweight). Any other call (a cache with past keys, a padded batch attending both ways,
autocast, a norm that ran stock) uses the q and k it is handed, whose graph (the norms' own
Function, the stock rope) gives the gradients, with the reason recorded (remat.fallback_counts).
Under torch.compile the norms run their stock forward and nothing is fused.
"""

import collections
import copy
import inspect

import torch
from torch import nn

from ... import _zero3 as zero3
from ..._guards import decided, fallback, from_transformers, hook_reason, tensor_reason
from ..._linears import widths
from ..._validate import autocast_dtype_for
from ...ops.attention import checked_call
from ...ops.qk_norm_attention import (
    LAYOUTS,
    DenseCore,
    HeadNormFunction,
    NormRopeAttention,
    NormSpec,
    VarlenCore,
    heads_shape,
    own_views,
    rebuild,
)
from ...saved import saved_bytes
from ...specs import norm_eps
from ..swap import is_converted, join, with_class
from . import structure as structure_probe
from .handoff import _between_reason
from .modules import _RematModule, remat_class
from .probe import training_mode

# Functions that pass a projection's output on to a norm unchanged in value (views of it).
_VIEWS = frozenset({"view", "reshape", "transpose", "unflatten", "contiguous", "__getitem__"})

_PROBE_NAME = "remat_qk_probe"  # the attention implementation of the convert-time replay


# ---------------------------------------------------------------------------------------------
# The head norm: the stock operations as a Function that keeps x and rstd
# ---------------------------------------------------------------------------------------------


class _RematHeadNorm(_RematModule):
    """A q or k norm (a transformers RMSNorm class, still an instance of it: same weight, eps and
    state_dict keys) whose attention keeps its input instead of q or k: its forward computes the
    stock module's operations bitwise (remat_style) as a Function keeping x and rstd, and records
    them in the attention module's open call for remat's attention function (fused_attention)."""

    remat_prefix = "RematHead"
    remat_style: str

    def forward(self, hidden_states):
        if torch.compiler.is_compiling():
            return self.remat_stock.forward(self, hidden_states)
        reason = decided(self, [self], lambda: hook_reason(self, allow=zero3.is_hook) or
                         tensor_reason("weight", self.weight))
        checked = self.__dict__.get("remat_qk_dtype")
        if reason is None and hidden_states.dtype != checked:
            reason = f"its input is {hidden_states.dtype}, not the {checked} its convert-time check ran in"
        if reason is not None:
            self._remat_fallback(reason)
            return self.remat_stock.forward(self, hidden_states)
        y, rstd = HeadNormFunction.apply(hidden_states, self.weight, norm_eps(self), self.remat_style)
        call = self.__dict__.get("remat_qk_call")
        if call is not None:
            call.record(self.__dict__["remat_qk_role"], hidden_states, rstd)
        return y

    def extra_repr(self):
        return f"{super().extra_repr()}, fused into its attention (style {self.remat_style!r})"


# ---------------------------------------------------------------------------------------------
# The attention module's call: opened by its pre-hook, filled by the norms, read by the attention
# ---------------------------------------------------------------------------------------------


class _Call:
    """What one forward of an attention module with fused q/k norms recorded for its attention call."""

    __slots__ = ("rotary", "reason", "records", "used")

    def __init__(self, rotary, reason):
        self.rotary, self.reason, self.records, self.used = rotary, reason, {}, False

    def record(self, role, x, rstd):
        if role in self.records:
            self.reason = f"its {role} norm ran twice in one call"
        self.records[role] = (x, x._version, rstd)


def _open_call(module, args, kwargs):
    """Forward pre-hook of an attention module with fused q/k norms: opens the call record."""
    if torch.compiler.is_compiling():
        return None
    rotary = kwargs.get("position_embeddings")
    index = module.__dict__.get("remat_qk_rotary_index")
    if rotary is None and index is not None and index < len(args):
        rotary = args[index]
    call = _Call(rotary, _cache_reason(module, args, kwargs))
    module.__dict__["remat_qk_call"] = call
    norms = [module._modules.get(name) for name in module.__dict__.get("remat_qk_norms", ())]
    for norm in filter(None, norms):
        norm.__dict__["remat_qk_call"] = call
    # ZeRO-3: the attention's backward rebuilds q and k with the norms' weights; lent to it before its own
    # pre-forward hook (registered later than this one) gathers its parameters, then in its backward
    zero3.lend(list(filter(None, norms)), [module])
    return None


def _close_call(module, args, output):
    """Forward hook (always called): the call record is dropped, and with it its tensors."""
    module.__dict__.pop("remat_qk_call", None)
    for name in module.__dict__.get("remat_qk_norms", ()):
        norm = module._modules.get(name)
        if norm is not None:
            norm.__dict__.pop("remat_qk_call", None)
    return None


# Neither hook reads nor changes the module's hidden states: a norm fused into the module's
# projections (handoff.Handoff) stays fused across them.
_open_call.remat_reads_no_hidden_states = _close_call.remat_reads_no_hidden_states = True


def _cache_reason(module, args, kwargs):
    """Why the keys this call hands the attention may not be this call's own: a cache holding past
    keys for this layer (an empty one, as transformers makes in training, gives them unchanged)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            continue
        length = getattr(value, "get_seq_length", None)
        if callable(length) and length(getattr(module, "layer_idx", 0) or 0) > 0:
            return "a cache holds past keys"
    return None


def fused_attention(module, query, key, value, causal, scaling, features, varlen=None):
    """o of this attention call with its q/k norms fused (NormRopeAttention): (batch, heads, seq,
    head_dim), or with `varlen` (packed sequences or padding: VarlenTokens) the (tokens, heads,
    head_dim) of remat.attention_varlen, `value` given as its tokens. None where the caller runs
    remat's attention on the query and key it was handed (no fused norms, no grad, or a reason,
    recorded). features: (window_left, window_right, softcap, dropout_p)."""
    call = module.__dict__.get("remat_qk_call")
    if call is None or call.used or not torch.is_grad_enabled():
        return None
    call.used = True
    reason = call.reason or _call_reason(module, call, query, key, value)
    if reason is not None:
        fallback(module, f"q/k norms not fused: {reason}", where=_where(module),
                 runs="remat's attention on the q and k of its stock rope")
        return None
    (x_q, _, rstd_q), (x_k, _, rstd_k) = call.records["q"], call.records["k"]
    x_q, x_k, value = own_views(x_q, x_k, value)  # each keeps its own part of a fused projection's output
    q_norm, k_norm = (module._modules[name] for name in module.__dict__["remat_qk_norms"])
    cos, sin = call.rotary
    window_left, window_right, softcap, dropout_p = features
    scale, op_features = checked_call(query, causal, False, scaling, window_left, window_right, softcap, None,
                                      dropout_p)
    core = DenseCore(causal, scale, op_features) if varlen is None else VarlenCore(varlen, causal, scale,
                                                                                      op_features)
    specs = (_spec(q_norm), _spec(k_norm))
    return NormRopeAttention.apply(query.detach(), key.detach(), x_q, x_k, value, q_norm.weight, k_norm.weight,
                                    rstd_q, rstd_k, cos, sin, specs, core)


def _spec(norm):
    return NormSpec(norm.remat_style, norm_eps(norm), norm.__dict__["remat_qk_layout"])


def _where(module):
    path = module.__dict__.get("remat_attention_path")
    return f"{path} ({type(module).__name__})" if path else None


def not_fused(module, reason):
    """Record, for a call with fused q/k norms that no fused path computes, why (grad enabled)."""
    call = module.__dict__.get("remat_qk_call")
    if call is not None and not call.used and torch.is_grad_enabled():
        call.used = True
        fallback(module, f"q/k norms not fused: {reason}", where=_where(module),
                 runs="remat's attention on the q and k of its stock rope")


def _call_reason(module, call, query, key, value):
    """Why this call's query and key may not be the rope(norm(x)) its norms recorded, or None."""
    if set(call.records) != {"q", "k"}:
        missing = " and ".join(r for r in ("q", "k") if r not in call.records)
        return f"its {missing} norm did not run remat's forward in this call"
    rotary = call.rotary
    if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2 and all(isinstance(t, torch.Tensor)
                                                                         for t in rotary)):
        return "no (cos, sin) position_embeddings handed to the module"
    if any(t.requires_grad for t in rotary):
        return "its rotary tables require grad"
    if autocast_dtype_for(query) is not None:
        return "autocast is on"
    if not (query.dtype == key.dtype == value.dtype):
        return "q, k and v differ in dtype"
    for role, handed in (("q", query), ("k", key)):
        x, version, _ = call.records[role]
        norm = module._modules[module.__dict__["remat_qk_norms"][role == "k"]]
        if x._version != version:
            return f"the {role} norm's input was modified in place"
        if heads_shape(x, norm.__dict__["remat_qk_layout"], handed.shape[1]) != tuple(handed.shape):
            return f"{role} is not the {role} norm's output in the layout checked at convert time"
    return None


# ---------------------------------------------------------------------------------------------
# Convert time: found by structure, checked by a replay
# ---------------------------------------------------------------------------------------------


def fuse_qk_norms(attention, structure, options, path, report, verdicts):
    """Fuse the q/k norms of the transformers module `attention` (any module the probe saw whose
    forward feeds two RMSNorms from its projections and hands their outputs on through functions
    only) into its attention calls; the names of the norms handled (fused, or reported as not).
    Each module is replayed on its own weights (a layer's forward may take another path than the
    next one's: AFMoE's global layers apply no rotary embedding); on meta, where nothing can be
    computed, on a CPU copy once per kind of module (verdicts: {kind: verdict}, one conversion's)."""
    # transformers' output recorders (output_router_logits, output_attentions) read what the attention
    # module returns, which the fusion leaves as it is
    if not options.wants("attention") or not from_transformers(type(attention)) or _between_reason(attention):
        return set()
    frame = structure.frame(attention)
    if frame is None or frame.hidden_states() is None:
        return set()
    candidates = _candidates(frame, attention)
    if len(candidates) != 2:
        return set()
    reason = None
    if "forward" in vars(attention):
        reason = "its forward is replaced on the instance"
    hooked = {name: hook_reason(attention._modules[name]) for name in candidates}
    reason = reason or next((f"{name} {why}" for name, why in hooked.items() if why), None)
    styles = {name: structure_probe.rms_style(attention._modules[name]) for name in candidates}
    reason = reason or next((f"{name}: {why}" for name, (style, why) in styles.items() if style is None), None)
    styles = {n: s for n, (s, _) in styles.items()}
    if reason is None:
        if frame.hidden_states().is_meta:
            kind = _kind(attention, candidates, frame)
            if kind not in verdicts:
                verdicts[kind] = _replay_verdict(attention, frame, styles)
            roles, reason = verdicts[kind]
        else:
            roles, reason = _replay_verdict(attention, frame, styles)
    if reason is not None:
        for name in candidates:
            report.add(join(path, name), attention._modules[name], "skipped", f"q/k norm not fused: {reason}")
        return set(candidates)
    _install(attention, roles, styles, frame.hidden_states().dtype, path, report)
    return set(candidates)


def _candidates(frame, attention):
    """The names of the norm children whose input is a Linear-like child's output (through views)
    and whose output only functions read, and the forward does not return."""
    names = []
    for name, child in attention._modules.items():
        if child is None or is_converted(child) or not structure_probe.is_norm(child) or type(child) is nn.LayerNorm:
            continue
        node = structure_probe.norm_node(frame, name)
        if node is None or not _from_projection(frame, attention, node.inputs):
            continue
        uses, returned = frame.uses(node.outputs[0])
        if not returned and uses and all(u.kind == "function" for u in uses):
            names.append(name)
    return names


def _from_projection(frame, module, inputs):
    """Whether the one tensor in `inputs` is a Linear-like child's output, or a view of one."""
    if len(inputs) != 1:
        return False
    tensor_id = inputs[0]
    for node in reversed(frame.nodes):
        if tensor_id not in node.outputs:
            continue
        if node.kind == "module":
            child = module._modules.get(node.name)
            return child is not None and widths(_stock(child)) is not None
        if node.name in _VIEWS and node.inputs:
            tensor_id = node.inputs[0]
            continue
        return False
    return False


def _stock(module):
    """A converted module's stock self (a projection with the layer's norm fused in is a Linear)."""
    return module.remat_revert() if is_converted(module) else module


def _kind(attention, candidates, frame):
    """What a replay's verdict on meta depends on: the classes, the norms' widths, the shapes and
    dtypes of the arguments the probe called the module with, and the module's plain attributes
    (AFMoE's is_local_attention, a sliding window) but its layer index (which picks its cache)."""
    norms = tuple((n, type(attention._modules[n]), tuple(attention._modules[n].weight.shape)) for n in candidates)
    args = tuple((tuple(t.shape), t.dtype) for t in structure_probe._tensors((frame.args, frame.kwargs)))
    plain = tuple(sorted((name, value) for name, value in vars(attention).items()
                         if not name.startswith(("_", "remat_")) and name != "layer_idx"
                         and isinstance(value, (bool, int, float, str, type(None)))))
    return type(attention), norms, args, plain


def _replay_verdict(attention, frame, styles):
    """(roles {"q": (name, layout), "k": (name, layout)}, None) when a replay of `attention` with its
    norms fused hands the attention interface exactly rebuild()'s q and k (bitwise, in the dtype of
    the probe's hidden states: the norms fuse in that dtype only); else (None, why not)."""
    try:
        return _replay(attention, frame, styles)
    except Exception as error:  # noqa: BLE001 - a forward this replay cannot call: not fused
        return None, f"its convert-time replay failed ({type(error).__name__}: {error})"


def _replay(attention, frame, styles):
    """One replay (see _replay_verdict): on the module's own weights and the probe's arguments, or on
    meta on a CPU copy with random weights and arguments."""
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE_NAME, _capture)
    dtype = frame.hidden_states().dtype
    on_meta = frame.hidden_states().is_meta
    twin = _cpu_twin(attention, dtype) if on_meta else _shallow_twin(attention)
    twin.config = copy.deepcopy(attention.config)
    twin.config._attn_implementation = _PROBE_NAME
    _swap_norms(twin, {name: (name, styles[name], "bhsd", dtype) for name in styles})  # (the layout: found below)
    _hook(twin, tuple(styles), _rotary_index(attention))
    args, kwargs = _materialised((frame.args, frame.kwargs), dtype) if on_meta else (frame.args, frame.kwargs)
    with torch.no_grad(), training_mode(False, twin):
        twin(*args, **kwargs)
    captured = twin.__dict__.pop("remat_qk_captured", None)
    if captured is None:
        return None, "its forward did not call the attention interface"
    query, key, call = captured
    if call is None or set(call.records) != set(styles) or call.rotary is None:
        return None, "its norms or position_embeddings were not seen in the call of the attention interface"
    roles = {}
    for role, handed in (("q", query), ("k", key)):
        taken = {name for name, _ in roles.values()}
        match = next(((name, layout) for name in styles for layout in LAYOUTS
                      if name not in taken and _rebuilds(call, twin._modules[name], layout, handed)), None)
        if match is None:
            return None, (f"the {role} the attention is handed is not rope(norm(x)) as remat rebuilds it (no rotary "
                          f"embedding, one other than rotate_half's over the whole head, or another rounding)")
        roles[role] = match
    return roles, None


def _shallow_twin(module):
    """`module` with its own children dict and hooks (the same children, parameters and buffers; a
    converted child as its stock module), for a replay that changes neither."""
    twin = copy.copy(module)
    twin._modules = {name: _stock(child) if child is not None else None for name, child in module._modules.items()}
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
        setattr(twin, name, collections.OrderedDict())
    return twin


def _rebuilds(call, norm, layout, handed):
    """Whether rebuild() of the (replay's) `norm`'s recorded input, laid out as `layout`, is `handed`
    bitwise."""
    x, _, rstd = call.records[norm.__dict__["remat_qk_role"]]
    if heads_shape(x, layout, handed.shape[1]) != tuple(handed.shape):
        return False
    cos, sin = call.rotary
    rebuilt = rebuild(x, norm.weight, rstd, NormSpec(norm.remat_style, norm_eps(norm), layout), handed.shape[1], cos,
                      sin, handed.dtype)
    return rebuilt.dtype == handed.dtype and torch.equal(rebuilt, handed)


def _capture(module, query, key, value, attention_mask, **kwargs):
    """The replay's attention function: keeps the query, key and the call record; returns zeros."""
    module.__dict__["remat_qk_captured"] = (query, key, module.__dict__.get("remat_qk_call"))
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def _cpu_twin(module, dtype):
    """A copy of `module` on the CPU in `dtype`, its parameters and buffers random near 1 (seeded),
    made without copying its (perhaps large, perhaps meta) tensors."""
    memo = {}
    for tensor in (*module.parameters(), *module.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else empty
    memo[id(getattr(module, "config", None))] = None  # set by the caller
    twin = _stock_children(copy.deepcopy(module, memo)).to_empty(device="cpu")
    return structure_probe.near_one(twin).to(dtype)


def _stock_children(module):
    """`module` with every remat module below it back to its stock class (the replay checks the
    module's own forward: a projection a norm is fused into computes the stock Linear there)."""
    for name, child in list(module._modules.items()):
        if child is not None:
            module._modules[name] = _stock_children(_stock(child))
    return module


def _materialised(value, dtype):
    """`value` (nested tuples, lists, dicts) with each tensor a CPU one: floating ones random in
    `dtype` (seeded), others as they are, or ones on meta."""
    generator = torch.Generator().manual_seed(8)

    def convert(item):
        if isinstance(item, torch.Tensor):
            if item.is_floating_point():
                return torch.randn(item.shape, generator=generator).to(dtype)
            return torch.ones(item.shape, dtype=item.dtype) if item.is_meta else item.cpu()
        if isinstance(item, tuple):
            return tuple(convert(i) for i in item)
        if isinstance(item, list):
            return [convert(i) for i in item]
        if isinstance(item, dict):
            return {k: convert(i) for k, i in item.items()}
        return item

    return convert(value)


def _rotary_index(attention):
    """The position of position_embeddings among the forward's positional arguments, or None."""
    try:
        names = list(inspect.signature(attention.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("position_embeddings") if "position_embeddings" in names else None


def _swap_norms(attention, fused):
    """Swap the norms `fused` ({name: (role, style, layout, the input dtype checked)}) of `attention`
    to _RematHeadNorm."""
    for name, (role, style, layout, dtype) in fused.items():
        norm = attention._modules[name]
        new = with_class(norm, remat_class(_RematHeadNorm, type(norm), remat_style=style))
        new.__dict__.update(remat_qk_role=role, remat_qk_layout=layout, remat_qk_dtype=dtype)
        attention._modules[name] = new


def _hook(attention, names, rotary_index):
    """The attention's call record: its norms' names by role order (q's, k's) and the hooks."""
    attention.__dict__["remat_qk_norms"] = names
    attention.__dict__["remat_qk_rotary_index"] = rotary_index
    attention.register_forward_pre_hook(_open_call, with_kwargs=True)
    attention.register_forward_hook(_close_call, always_call=True)


def _install(attention, roles, styles, dtype, path, report):
    (q_name, q_layout), (k_name, k_layout) = roles["q"], roles["k"]
    _swap_norms(attention, {q_name: ("q", styles[q_name], q_layout, dtype),
                            k_name: ("k", styles[k_name], k_layout, dtype)})
    for name in (q_name, k_name):
        attention._modules[name].__dict__["remat_path"] = join(path, name)
    _hook(attention, (q_name, k_name), _rotary_index(attention))
    for role, name in (("q", q_name), ("k", k_name)):
        norm = attention._modules[name]
        report.add(join(path, name), norm, f"swapped to {type(norm).__name__}",
                   f"{role} norm fused into remat's attention: it keeps {name}'s input and a fp32 rstd a row, "
                   f"not {role} after the rope nor an fp32 copy; norm and rope rebuilt in the backward",
                   _saving(attention, norm))


def _saving(attention, norm):
    """saves() of a fused norm's row: bytes per token the stock norm keeps beyond its input and its
    rstd (its fp32 copy of x, its normalised x), where the attention's parameters train."""
    width = norm.weight.shape[0]
    per_token = {}

    def saves():
        if not any(p.requires_grad for p in attention.parameters()):
            return 0
        dtype = norm.weight.dtype
        if dtype not in per_token:
            per_token[dtype] = _stock_norm_bytes(norm, width, dtype)
        return per_token[dtype] * _rows_per_token(attention, norm, width)

    return saves


def _rows_per_token(attention, norm, width):
    """How many norm rows a token has: one per head for a per-head norm (its width a head's), else one."""
    role = norm.__dict__["remat_qk_role"]
    heads = _heads_of(attention, role)
    return heads if heads and width * heads == _projection_width(attention, role) else 1


def _heads_of(attention, role):
    config = getattr(attention, "config", None)
    name = "num_attention_heads" if role == "q" else "num_key_value_heads"
    value = getattr(config, name, None)
    return value if isinstance(value, int) else None


def _projection_width(attention, role):
    config = getattr(attention, "config", None)
    head_dim = getattr(attention, "head_dim", None) or getattr(config, "head_dim", None)
    heads = _heads_of(attention, role)
    return head_dim * heads if isinstance(head_dim, int) and heads else None


def _stock_norm_bytes(norm, width, dtype):
    """Bytes per row the stock module's forward saves but one fp32 rstd, counted (saved-tensor hooks)
    on a CPU copy: its input where it keeps that itself (fp32), an fp32 copy of it (else), its
    normalised x. The fused attention keeps the input in place of the post-rope q or k, as many bytes."""
    twin = _cpu_twin(norm, dtype)
    twin.__class__ = norm.remat_stock

    def kept(rows):
        x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
        return saved_bytes(lambda: twin(x), exclude=list(twin.parameters()))

    return (kept(8) - kept(4)) // 4 - 4  # per row (a per-call constant, Gemma's 1 + w, drops out)


# ---------------------------------------------------------------------------------------------
# Revert
# ---------------------------------------------------------------------------------------------


def unhook(module):
    """Remove the hooks and call record fuse_qk_norms gave the attention `module` (remat.revert; its
    norms go back to their stock classes by their own remat_revert)."""
    if module.__dict__.pop("remat_qk_norms", None) is None:
        return
    module.__dict__.pop("remat_qk_rotary_index", None)
    module.__dict__.pop("remat_qk_call", None)
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, hook in hooks.items() if hook in (_open_call, _close_call)]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):
                getattr(module, extra, {}).pop(key, None)


def unfuse(model, report, why):
    """Give every attention of `model` whose q/k norms fuse_qk_norms fused its stock norms back, their
    report rows "skipped" with `why` (remat's attention function, which the fusion needs, is not the
    model's)."""
    from ..report import ReportRow

    paths = {}
    for module in model.modules():
        names = module.__dict__.get("remat_qk_norms")
        if names is None:
            continue
        unhook(module)
        for name in names:
            norm = module._modules[name]
            paths[norm.__dict__.get("remat_path")] = type(norm).__name__, norm.remat_stock.__name__
            module._modules[name] = norm.remat_revert()
    for i, row in enumerate(report):
        fused, stock = paths.get(row.path, (None, None))
        if row.type == fused:
            report[i] = ReportRow(row.path, stock, "skipped", f"q/k norm not fused: {why}")
