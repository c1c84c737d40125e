"""Hugging Face transformers support for remat.convert (tested with transformers 5.24).

remat.convert applies these rules, besides the generic ones (every nn.LayerNorm becomes
remat.nn.LayerNorm), when the model is a transformers PreTrainedModel. Module swaps only: no
forward function of a transformers class is patched.

    family          module swapped                          into
    GPT-2           GPT2MLP (c_fc Conv1D, act, c_proj         RematHFMLP: remat.mlp on the Conv1D weights
                    Conv1D, dropout)                          (transposed views), then the same nn.Dropout
    ViT             ViTMLP (fc1, activation_fn, fc2)          RematHFMLP
    GPT-NeoX/Pythia GPTNeoXMLP (dense_h_to_4h, act,           RematHFMLP
                    dense_4h_to_h)
    CLIP            CLIPMLP (fc1, activation_fn, fc2)         RematHFMLP, only with a GELU activation
                                                              (CLIP's default quick_gelu is not one)
    BERT, RoBERTa   the FFN spread over two siblings of       intermediate -> RematPassthroughIntermediate
                    BertLayer/RobertaLayer: intermediate       (holds dense and the activation, returns its
                    (dense, act) and output (dense,             input); output -> RematBertOutput:
                    dropout, LayerNorm(h + input))              LayerNorm(dropout(remat.mlp(x)) + input)

The fused MLPs keep the fc1 output only, never the GELU output (design.md §1): per layer and
token, ffn * dtype-size bytes less. The parameters stay where they were (same objects, same
state_dict keys). Dropout is applied after fc2 with torch's nn.Dropout exactly as the original,
so training with dropout > 0 stays equivalent (same random stream).

GELU variants accepted: GELUActivation (erf), nn.GELU, GELUTanh/PytorchGELUTanh,
NewGELUActivation and FastGELUActivation (the tanh approximation, FastGELU's constant rounded
at 1e-10). Not: QuickGELU, clipped or other activations.

Each family rule is also checked when it is applied: the original and the swapped module run on
one small random input (eval mode, a private generator, no autograd) and must agree; a
mismatch (a transformers version whose forward differs) leaves the module alone and says so in
the report. Models on the meta device are not probed.

Attention is not swapped in Hugging Face models: their attention goes through
config._attn_implementation (the default "sdpa" already keeps only q, k, v and the output on
GPU, as remat.attention does), and those classes change between transformers versions. The
report lists each attention module as skipped with this reason.
"""

import contextlib
import sys

import torch
from torch import nn

from .convert import gelu_approximate as _generic_gelu_approximate
from .convert import hook_reason, uniform_reason
from .ops.fused import mlp

TESTED_TRANSFORMERS = ">=5.24,<6"

# MLP modules: class name -> (fc1, activation, fc2, dropout or None, Conv1D weights (in, out))
MLP_RULES = {
    "GPT2MLP": ("c_fc", "act", "c_proj", "dropout", True),
    "ViTMLP": ("fc1", "activation_fn", "fc2", None, False),
    "GPTNeoXMLP": ("dense_h_to_4h", "act", "dense_4h_to_h", None, False),
    "CLIPMLP": ("fc1", "activation_fn", "fc2", None, False),
}

# FFNs split over two siblings: layer class -> (intermediate attr and class, output attr and class)
PAIR_RULES = {
    "BertLayer": ("intermediate", "BertIntermediate", "output", "BertOutput"),
    "RobertaLayer": ("intermediate", "RobertaIntermediate", "output", "RobertaOutput"),
}

ATTENTION_SUFFIXES = ("Attention",)

_TANH_ACTIVATIONS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")


def _from_transformers(module):
    return type(module).__module__.startswith("transformers.")


def is_hf_model(model):
    """True when `model` is a transformers PreTrainedModel (transformers not imported: False)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def activation_approximate(module):
    """"none" or "tanh" for transformers' GELU activation modules remat computes, else None."""
    if not _from_transformers(module):
        return None
    name = type(module).__name__
    if name == "GELUActivation":
        return "none"  # F.gelu or its erf formula in Python
    if name in _TANH_ACTIVATIONS:
        return "tanh"
    return None


def _gelu(module):
    return _generic_gelu_approximate(module) if isinstance(module, nn.Module) else None


def _is_conv1d(module):
    return type(module).__name__ == "Conv1D" and _from_transformers(module)


def _widths(fc, transposed):
    """(in_features, out_features) of an nn.Linear, or of a transformers Conv1D (weight (in, out))."""
    if transposed:
        return tuple(fc.weight.shape)
    return fc.in_features, fc.out_features


def _mlp_reason(fc1, act, fc2, dropout, transposed):
    """None when fc1 -> act -> fc2 [-> dropout] is remat.mlp [+ dropout], else why not."""
    for name, fc in (("fc1", fc1), ("fc2", fc2)):
        if transposed and not _is_conv1d(fc):
            return f"{name} is {type(fc).__name__}, not transformers Conv1D"
        if not transposed and type(fc) is not nn.Linear:
            return f"{name} is {type(fc).__name__}, not exactly nn.Linear"
    if _gelu(act) is None:
        return f"activation {type(act).__name__} is not a GELU remat computes (exact or tanh)"
    (h_in, f_out), (f_in, h_out) = _widths(fc1, transposed), _widths(fc2, transposed)
    if f_in != f_out or h_out != h_in:
        return f"widths do not chain: {h_in}->{f_out} then {f_in}->{h_out}"
    if (fc1.bias is None) != (fc2.bias is None):
        return "one projection has a bias and the other none"
    if dropout is not None and type(dropout) is not nn.Dropout:
        return f"dropout is {type(dropout).__name__}, not nn.Dropout"
    for m in (fc1, act, fc2, dropout):
        if m is not None and hook_reason(m):
            return f"{type(m).__name__} {hook_reason(m)}"
    return uniform_reason(fc1, fc2)


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
    with torch.no_grad(), _eval_mode(*modules):
        want, got = before(x), after(x)
    error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
    tolerance = 1e-4 if param.dtype in (torch.float32, torch.float64) else 3e-2
    if not error <= tolerance:
        return f"probe mismatch (relative error {error:.2g}): this transformers version's forward differs"
    return None


# ---------------------------------------------------------------------------------------------
# The swapped modules
# ---------------------------------------------------------------------------------------------


class RematHFMLP(nn.Module):
    """A transformers MLP module (GPT2MLP, ViTMLP, GPTNeoXMLP, CLIPMLP) on remat.mlp.

    Holds the original's submodules under their original names (same parameters, same
    state_dict keys), computes dropout(fc2(gelu(fc1(x)))) keeping x and the fc1 output only,
    and remat_revert() gives the original module back.
    """

    remat_fused = True

    def __init__(self, original, fc1, act, fc2, dropout, transposed, approximate, recompute):
        super().__init__()
        self.names = (fc1, act, fc2, dropout)
        for name in self.names:
            if name is not None:
                setattr(self, name, getattr(original, name))
        self.transposed, self.approximate, self.recompute = transposed, approximate, recompute
        self.__dict__["remat_original"] = original  # not a submodule: kept for remat_revert()

    def forward(self, hidden_states):
        fc1, _, fc2, dropout = (self._modules[n] if n is not None else None for n in self.names)
        w1, w2 = fc1.weight, fc2.weight
        if self.transposed:  # Conv1D: y = x @ weight + bias, weight (in, out)
            w1, w2 = w1.t(), w2.t()
        out = mlp(hidden_states, w1, fc1.bias, w2, fc2.bias, self.approximate, self.recompute)
        return dropout(out) if dropout is not None else out

    def extra_repr(self):
        return f"{type(self.remat_original).__name__} on remat.mlp, approximate={self.approximate!r}, " \
               f"recompute={self.recompute}"

    def remat_revert(self):
        original = self.remat_original
        for name in self.names:
            if name is not None:
                original._modules[name] = self._modules[name]
        original.train(self.training)
        return original


class RematPassthroughIntermediate(nn.Module):
    """BertIntermediate's place in a converted layer: holds dense and the activation (same
    parameters and keys) and returns its input; RematBertOutput computes the whole FFN."""

    remat_fused = True

    def __init__(self, original):
        super().__init__()
        self.dense = original.dense
        self.intermediate_act_fn = original.intermediate_act_fn
        self.__dict__["remat_original"] = original

    def forward(self, hidden_states):
        return hidden_states

    def remat_revert(self):
        original = self.remat_original
        original._modules["dense"] = self._modules["dense"]
        original.train(self.training)
        return original


class RematBertOutput(nn.Module):
    """BertOutput (and RobertaOutput) with the FFN fused in:
    LayerNorm(dropout(dense(gelu(intermediate.dense(x)))) + input_tensor) on remat.mlp.

    Holds dense, LayerNorm and dropout (same parameters and keys); the intermediate dense is
    the sibling's (not registered here, so the keys do not change).
    """

    def __init__(self, original, intermediate, approximate, recompute):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = original.dense, original.LayerNorm, original.dropout
        self.approximate, self.recompute = approximate, recompute
        self.__dict__["remat_fc1"] = intermediate.dense
        self.__dict__["remat_original"] = original

    def forward(self, hidden_states, input_tensor):
        fc1, fc2 = self.remat_fc1, self.dense
        out = mlp(hidden_states, fc1.weight, fc1.bias, fc2.weight, fc2.bias, self.approximate, self.recompute)
        return self.LayerNorm(self.dropout(out) + input_tensor)

    def remat_revert(self):
        original = self.remat_original
        for name in ("dense", "LayerNorm", "dropout"):
            original._modules[name] = self._modules[name]
        original.train(self.training)
        return original


# ---------------------------------------------------------------------------------------------
# The rules, called by remat.convert for each module of a PreTrainedModel
# ---------------------------------------------------------------------------------------------


def _join(path, name):
    return f"{path}.{name}" if path else name


def _mlp_rule(parent, name, module, recompute, path, report):
    fc1_name, act_name, fc2_name, dropout_name, transposed = MLP_RULES[type(module).__name__]
    fc1, act, fc2 = (getattr(module, n, None) for n in (fc1_name, act_name, fc2_name))
    dropout = getattr(module, dropout_name, None) if dropout_name else None
    if fc1 is None or fc2 is None or act is None:
        return f"{type(module).__name__} lacks the expected submodules {fc1_name}, {act_name}, {fc2_name}"
    reason = hook_reason(module) or _mlp_reason(fc1, act, fc2, dropout, transposed)
    if reason:
        return reason
    new = RematHFMLP(module, fc1_name, act_name, fc2_name, dropout_name, transposed, _gelu(act), recompute)
    new.train(module.training)
    reason = _probe(module, new, _widths(fc1, transposed)[0], fc1.weight, [module])
    if reason:
        return reason
    parent._modules[name] = new
    report.add(_join(path, name), module, "swapped to RematHFMLP",
               f"fused {fc1_name} -> {type(act).__name__} -> {fc2_name}"
               + (f" (+ {dropout_name})" if dropout_name else "") + ": the GELU output is not kept")
    return None


def _pair_rule(layer, recompute, path, report):
    inter_name, inter_class, out_name, out_class = PAIR_RULES[type(layer).__name__]
    inter, out = getattr(layer, inter_name, None), getattr(layer, out_name, None)
    if type(inter).__name__ != inter_class or type(out).__name__ != out_class:
        return None  # already converted, or not the expected structure
    row_path = _join(path, inter_name)
    fc1, act = getattr(inter, "dense", None), getattr(inter, "intermediate_act_fn", None)
    fc2, dropout, norm = (getattr(out, n, None) for n in ("dense", "dropout", "LayerNorm"))
    reason = hook_reason(inter) or hook_reason(out) or hook_reason(layer)
    if reason is None and not callable(getattr(layer, "feed_forward_chunk", None)):
        reason = f"{type(layer).__name__} has no feed_forward_chunk to check the FFN wiring against"
    if reason is None:
        reason = _mlp_reason(fc1, act, fc2, dropout, False) if isinstance(fc1, nn.Module) and \
            isinstance(fc2, nn.Module) else "dense layers missing"
    if reason is None and not isinstance(norm, nn.LayerNorm):
        reason = "output.LayerNorm is not an nn.LayerNorm"
    if reason is None:
        new_inter = RematPassthroughIntermediate(inter)
        new_out = RematBertOutput(out, inter, _gelu(act), recompute)
        new_inter.train(inter.training)
        new_out.train(out.training)
        before = layer.feed_forward_chunk

        def after(x):
            layer._modules[inter_name], layer._modules[out_name] = new_inter, new_out
            try:
                return layer.feed_forward_chunk(x)
            finally:
                layer._modules[inter_name], layer._modules[out_name] = inter, out

        reason = _probe(before, after, fc1.in_features, fc1.weight, [layer])
    if reason:
        report.add(row_path, inter, "skipped", f"{inter_name} + {out_name} FFN: {reason}")
        return set()
    layer._modules[inter_name], layer._modules[out_name] = new_inter, new_out
    report.add(row_path, inter, "swapped to RematPassthroughIntermediate",
               f"FFN fused into {out_name}; returns its input")
    report.add(_join(path, out_name), out, "swapped to RematBertOutput",
               f"LayerNorm(dropout(dense(gelu({inter_name}.dense(x)))) + input): the GELU output is not kept")
    return {inter_name}  # output is recursed into: its LayerNorm becomes remat.nn.LayerNorm


def convert_children(parent, layers, recompute, path, report):
    """Apply the family rules to `parent`'s children; returns the names convert must not touch."""
    handled = set()
    if type(parent).__name__ in PAIR_RULES and _from_transformers(parent) and "mlp" in layers:
        handled |= _pair_rule(parent, recompute, path, report) or set()
    for name, child in list(parent._modules.items()):
        if child is None or name in handled or not _from_transformers(child):
            continue
        kind = type(child).__name__
        if kind in MLP_RULES and "mlp" in layers:
            reason = _mlp_rule(parent, name, child, recompute, path, report)
            if reason:
                report.add(_join(path, name), child, "skipped", reason)
            handled.add(name)
        elif kind.endswith(ATTENTION_SUFFIXES) and "attention" in layers:
            report.add(_join(path, name), child, "skipped",
                       "Hugging Face attention is left to config._attn_implementation (sdpa keeps q, k, v, o)")
    return handled
