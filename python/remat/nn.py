"""Drop-in modules. They hold parameters and call remat.ops; no math lives here.

The fused layers keep their parameters in stock submodules (`norm`, `linear`, `fc1`, `fc2`),
so their state_dict is that of the unfused stack with those names, and `from_modules` builds
one from existing modules, copying the weights. Under DeepSpeed ZeRO-3, whose hooks gather a
module's own parameters around its call, a fused layer has the submodules' parameters it reads
gathered with its own (_fused_call); ZeRO-3's hooks on them are no reason to run unfused.
"""

import copy

import torch
import torch.nn.functional as F

from . import _zero3 as zero3
from ._guards import fallback, plain_reason
from ._linears import decided_projections, fused_saved_bytes, projection, widths
from ._validate import check_float_tensor, check_self_attention_input
from .ops.attention import multihead_self_attention
from .ops.fused import check_input_width, fused_mlp, norm_linears
from .ops.gated import ACTIVATIONS as GATED_ACTIVATIONS
from .ops.gelu import gelu
from .ops.layer_norm import layer_norm
from .ops.linear_cross_entropy import linear_cross_entropy, loss_options
from .ops.rms_norm import rms_norm
from .specs import GELU_APPROXIMATE, Activation, norm_eps, norm_of

ACTIVATIONS = GELU_APPROXIMATE  # the activation names remat.nn.MLP takes


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm on remat's kernels: same constructor, parameters and state_dict keys.

    Autograd keeps the input and fp32 mean/rstd per row; the backward recomputes the normalised
    input from them.
    """

    def forward(self, x):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    @classmethod
    def from_torch(cls, module):
        """A remat LayerNorm sharing `module`'s parameters (no copy)."""
        new = cls(
            module.normalized_shape,
            eps=module.eps,
            elementwise_affine=module.elementwise_affine,
            bias=module.bias is not None,
            device="meta",
        )
        new.weight, new.bias = module.weight, module.bias
        return new

    def remat_revert(self):
        """torch.nn.LayerNorm holding the same parameters (remat.revert)."""
        stock = copy.copy(self)
        stock.__class__ = torch.nn.LayerNorm
        return stock


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm on remat's kernels: same constructor (elementwise_affine=False included),
    parameters, state_dict keys and rounding. Autograd keeps the input and one fp32 rstd per row."""

    def forward(self, x):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    @classmethod
    def from_torch(cls, module):
        """A remat RMSNorm sharing `module`'s parameters (no copy)."""
        new = cls(module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine,
                  device="meta")
        new.weight = module.weight
        return new

    def remat_revert(self):
        """torch.nn.RMSNorm holding the same parameters (remat.revert)."""
        stock = copy.copy(self)
        stock.__class__ = torch.nn.RMSNorm
        return stock


class GELU(torch.nn.GELU):
    """torch.nn.GELU on remat's kernel (exact or tanh). Autograd keeps the input only."""

    def forward(self, x):
        return gelu(x, self.approximate)

    def remat_revert(self):
        """torch.nn.GELU with the same approximation (remat.revert)."""
        return torch.nn.GELU(self.approximate)


def _copy_parameters(target, source):
    with torch.no_grad():
        for name, param in source.named_parameters():
            target.get_parameter(name).copy_(param)


def _activation_name(module):
    if not isinstance(module, torch.nn.GELU):
        raise TypeError(f"activation must be a torch.nn.GELU, got {type(module).__name__}")
    return "gelu_tanh" if module.approximate == "tanh" else "gelu"


def _stock_gelu(h, approximate):
    """The stock computation of a GELU remat computes: torch's, or QuickGELU's formula (transformers')."""
    return h * torch.sigmoid(1.702 * h) if approximate == "quick" else F.gelu(h, approximate=approximate)


def _check_recompute(recompute):
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be True or False, got {recompute!r}")
    return recompute


def norm_reason(norm, label="norm"):
    """None when `norm` is a LayerNorm or RMSNorm over the last dimension that the fused ops compute
    (plain: no hooks but ZeRO-3's, which gather what the fused op reads (_fused_call); no
    parametrizations, plain parameters), else why not."""
    kinds = (torch.nn.RMSNorm, RMSNorm) if isinstance(norm, torch.nn.RMSNorm) else (torch.nn.LayerNorm, LayerNorm)
    reason = plain_reason(norm, kinds, label, zero3.is_hook)
    if reason is None and len(norm.normalized_shape) != 1:
        reason = f"{label} normalises over more than the last dimension"
    return reason


def _fused_call(module, parts):
    """The context of a fused module's call: DeepSpeed ZeRO-3 gathers `parts` (its submodules whose parameters
    the fused op reads without calling them) with `module`'s own parameters (_zero3.gathered); nothing else."""
    return zero3.gathered(module, [part for part in parts if part is not None])


def _kept_call(module, checked, x, norm, act):
    """The fused op call kept with this verdict's Checked for an x like this one, the norm's eps, the
    Activation `act` and the recompute switch now (remat.ops.fused.Checked.kept_call), or None: the full
    path then checks x and builds the call."""
    if checked is None:
        return None
    return checked.kept_call(x, norm_eps(norm) if norm is not None else None, act, module.recompute)


def _input_checked(x, width, module):
    check_float_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., in_features)")
    check_input_width(x, width, f"the in_features of {type(module).__name__}")
    return x


class LayerNormLinear(torch.nn.Module):
    """Linear(LayerNorm(x)) that keeps x and fp32 row statistics instead of LayerNorm(x).

    state_dict: norm.weight, norm.bias, linear.weight, linear.bias. recompute=False keeps
    LayerNorm(x) like the unfused pair does. `linear` may be wrapped by peft's LoRA (the adapters
    run inside the fused op); any other change to norm or linear after construction (hooks,
    parametrizations, another module) makes each call run norm then linear, with a
    RematFallbackWarning once.
    """

    remat_fused = True  # remat.convert leaves it as it is

    def __init__(self, in_features, out_features, bias=True, eps=1e-5, norm_bias=True,
                 recompute=True, device=None, dtype=None):
        super().__init__()
        self.norm = torch.nn.LayerNorm(in_features, eps=eps, bias=norm_bias, device=device, dtype=dtype)
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recompute = _check_recompute(recompute)

    def forward(self, x):
        with _fused_call(self, [self.norm, self.linear]):
            return self._forward(x)

    def _forward(self, x):
        linear, reason = projection(self.linear, "linear", zero3.is_hook)
        reason = norm_reason(self.norm) or reason
        if reason:
            fallback(self, reason)
            return self.linear(self.norm(x))
        _input_checked(x, self.norm.normalized_shape[0], self)
        return norm_linears(x, norm_of(self.norm), [linear], self.recompute)[0]

    def saved_bytes_per_token(self):
        """Activation bytes per token this layer keeps less than LayerNorm then Linear (LN(x), where the
        Linear's weight or a LoRA adapter trains), for an input that requires grad."""
        return fused_saved_bytes(self.norm, [self.linear]) if self.recompute else 0

    @classmethod
    def from_modules(cls, norm, linear, recompute=True):
        """Built from an nn.LayerNorm over the last dim followed by an nn.Linear; weights copied."""
        if not isinstance(norm, torch.nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise TypeError("norm must be a torch.nn.LayerNorm over the last dimension")
        if not isinstance(linear, torch.nn.Linear) or linear.in_features != norm.normalized_shape[0]:
            raise TypeError("linear must be a torch.nn.Linear taking the LayerNorm's width")
        if not norm.elementwise_affine:
            raise ValueError("norm must have elementwise_affine=True")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  eps=norm.eps, norm_bias=norm.bias is not None, recompute=recompute,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        _copy_parameters(new.norm, norm)
        _copy_parameters(new.linear, linear)
        return new


class RMSNormLinear(LayerNormLinear):
    """Linear(RMSNorm(x)) (torch.nn.RMSNorm's rounding) that keeps x and one fp32 rstd per row instead
    of RMSNorm(x), rebuilding it for the Linear's weight gradient.

    state_dict: norm.weight, linear.weight, linear.bias. As LayerNormLinear otherwise (recompute,
    peft's LoRA on `linear`, the fallback on any other change).
    """

    def __init__(self, in_features, out_features, bias=True, eps=None, elementwise_affine=True,
                 recompute=True, device=None, dtype=None):
        torch.nn.Module.__init__(self)
        self.norm = torch.nn.RMSNorm(in_features, eps=eps, elementwise_affine=elementwise_affine, device=device,
                                     dtype=dtype)
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recompute = _check_recompute(recompute)

    @classmethod
    def from_modules(cls, norm, linear, recompute=True):
        """Built from an nn.RMSNorm over the last dim followed by an nn.Linear; weights copied."""
        if not isinstance(norm, torch.nn.RMSNorm) or len(norm.normalized_shape) != 1:
            raise TypeError("norm must be a torch.nn.RMSNorm over the last dimension")
        if not isinstance(linear, torch.nn.Linear) or linear.in_features != norm.normalized_shape[0]:
            raise TypeError("linear must be a torch.nn.Linear taking the RMSNorm's width")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, eps=norm.eps,
                  elementwise_affine=norm.elementwise_affine, recompute=recompute,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        _copy_parameters(new.norm, norm)
        _copy_parameters(new.linear, linear)
        return new


class MLP(torch.nn.Module):
    """fc2(gelu(fc1(x))) that keeps x and the fc1 output only, never the GELU output.

    activation: "gelu" (exact) or "gelu_tanh". state_dict: fc1.*, fc2.*. recompute=False
    keeps the GELU output like the unfused stack does. fc1 and fc2 may be wrapped by peft's LoRA
    (the adapters run inside the fused op); any other change to them makes each call run the
    layers one after the other, with a RematFallbackWarning once.
    """

    remat_fused = True  # remat.convert leaves it as it is

    def __init__(self, hidden, ffn_hidden, activation="gelu", bias=True, recompute=True,
                 device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.fc1 = torch.nn.Linear(hidden, ffn_hidden, bias=bias, device=device, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn_hidden, hidden, bias=bias, device=device, dtype=dtype)
        self.recompute = _check_recompute(recompute)

    def forward(self, x):
        return self._forward(x, None)

    def _forward(self, x, norm):
        """The fused MLP, with `norm` (a LayerNorm) in front when given; unfused where it must be."""
        with _fused_call(self, [norm, self.fc1, self.fc2]):
            return self._fused_forward(x, norm)

    def _fused_forward(self, x, norm):
        linears, reason, checked = decided_projections(self, [self.fc1, self.fc2], ["fc1", "fc2"], [norm],
                                              lambda: norm_reason(norm) if norm is not None else None, zero3.is_hook)
        approximate = ACTIVATIONS[self.activation]
        if reason:
            fallback(self, reason)
            h = self.fc1(norm(x) if norm is not None else x)
            act = self.__dict__.get("remat_activation")  # the GELU module convert fused, if any
            return self.fc2(act(h) if act is not None else _stock_gelu(h, approximate))
        act = Activation(self.activation)
        kept = _kept_call(self, checked, x, norm, act)
        if kept is not None:
            return kept(x, None)
        fc1, fc2 = linears
        _input_checked(x, widths(self.fc1)[0], self)
        return fused_mlp(x, fc1, act, fc2, norm_of(norm) if norm is not None else None, self.recompute,
                         checked=checked)

    def saved_bytes_per_token(self):
        """Activation bytes per token kept less than the unfused stack (the GELU output where fc2
        trains, LN(x) where fc1 trains), for an input that requires grad."""
        if not self.recompute:
            return 0
        norm = getattr(self, "norm", None)
        return fused_saved_bytes(norm, [self.fc1] if norm is not None else [], self.fc2)

    @classmethod
    def from_modules(cls, fc1, activation, fc2, recompute=True):
        """Built from (nn.Linear, nn.GELU, nn.Linear); weights copied."""
        _check_mlp_linears(fc1, fc2)
        new = cls(fc1.in_features, fc1.out_features, _activation_name(activation),
                  bias=fc1.bias is not None, recompute=recompute,
                  device=fc1.weight.device, dtype=fc1.weight.dtype)
        _copy_parameters(new.fc1, fc1)
        _copy_parameters(new.fc2, fc2)
        return new


def _check_mlp_linears(fc1, fc2):
    if not isinstance(fc1, torch.nn.Linear) or not isinstance(fc2, torch.nn.Linear):
        raise TypeError("fc1 and fc2 must be torch.nn.Linear")
    if fc2.in_features != fc1.out_features or fc2.out_features != fc1.in_features:
        raise ValueError(f"fc2 must map {fc1.out_features} back to {fc1.in_features} features, "
                         f"got {fc2.in_features} -> {fc2.out_features}")
    if (fc1.bias is None) != (fc2.bias is None):
        raise ValueError("fc1 and fc2 must both have a bias or both have none")


class LayerNormMLP(MLP):
    """fc2(gelu(fc1(LayerNorm(x)))) keeping x, fp32 row statistics and the fc1 output only.

    state_dict: norm.*, fc1.*, fc2.*.
    """

    def __init__(self, hidden, ffn_hidden, activation="gelu", bias=True, eps=1e-5,
                 recompute=True, device=None, dtype=None):
        super().__init__(hidden, ffn_hidden, activation, bias, recompute, device, dtype)
        self.norm = torch.nn.LayerNorm(hidden, eps=eps, device=device, dtype=dtype)

    def forward(self, x):
        return self._forward(x, self.norm)

    @classmethod
    def from_modules(cls, norm, fc1, activation, fc2, recompute=True):
        """Built from (nn.LayerNorm, nn.Linear, nn.GELU, nn.Linear); weights copied."""
        _check_mlp_linears(fc1, fc2)
        if not isinstance(norm, torch.nn.LayerNorm) or tuple(norm.normalized_shape) != (fc1.in_features,):
            raise TypeError("norm must be a torch.nn.LayerNorm over fc1's input width")
        if not norm.elementwise_affine or norm.bias is None:
            raise ValueError("norm must have a weight and a bias")
        new = cls(fc1.in_features, fc1.out_features, _activation_name(activation),
                  bias=fc1.bias is not None, eps=norm.eps, recompute=recompute,
                  device=fc1.weight.device, dtype=fc1.weight.dtype)
        _copy_parameters(new.norm, norm)
        _copy_parameters(new.fc1, fc1)
        _copy_parameters(new.fc2, fc2)
        return new


_GATED_STOCK = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}


def _gated_activation_name(activation):
    """The gated kernels' name for `activation`: a name, or nn.SiLU / nn.GELU."""
    if isinstance(activation, str):
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
        return activation
    if type(activation) is torch.nn.SiLU:
        return "silu"
    if type(activation) is torch.nn.GELU and activation.approximate in ("none", "tanh"):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    raise TypeError(f"activation must be one of {GATED_ACTIVATIONS}, torch.nn.SiLU or torch.nn.GELU, "
                    f"got {type(activation).__name__}")


class GatedMLP(torch.nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), the MLP of Llama, Mistral, Qwen and Gemma (SwiGLU with
    "silu", GeGLU with "gelu" or "gelu_tanh"), optionally with an RMSNorm or LayerNorm in front.

    Autograd keeps x (and the norm's fp32 statistics), the gate and up projections' outputs only,
    never act(gate) nor the product: both are rebuilt in the backward's one pass over gate and up.
    fused_projection=True holds one gate_up_proj (gate's rows first, as Phi-3's) instead of gate_proj
    and up_proj. act(gate) is rounded to the input dtype before the multiply, as the stock
    computation rounds it. state_dict: [norm.*,] gate_proj.*, up_proj.* (or gate_up_proj.*),
    down_proj.*. The Linears may be wrapped by peft's LoRA; any other change makes each call run the
    stock computation, with a RematFallbackWarning once.
    """

    remat_fused = True  # remat.convert leaves it as it is

    def __init__(self, hidden, ffn_hidden, activation="silu", bias=False, norm=None, eps=None,
                 fused_projection=False, recompute=True, device=None, dtype=None):
        super().__init__()
        self.activation = _gated_activation_name(activation)
        factory = {"device": device, "dtype": dtype}
        if norm == "rms_norm":
            self.norm = torch.nn.RMSNorm(hidden, eps=eps, **factory)
        elif norm == "layer_norm":
            self.norm = torch.nn.LayerNorm(hidden, eps=1e-5 if eps is None else eps, **factory)
        elif norm is not None:
            raise ValueError(f"norm must be None, 'rms_norm' or 'layer_norm', got {norm!r}")
        if fused_projection:
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * ffn_hidden, bias=bias, **factory)
        else:
            self.gate_proj = torch.nn.Linear(hidden, ffn_hidden, bias=bias, **factory)
            self.up_proj = torch.nn.Linear(hidden, ffn_hidden, bias=bias, **factory)
        self.down_proj = torch.nn.Linear(ffn_hidden, hidden, bias=bias, **factory)
        self.recompute = _check_recompute(recompute)

    def _up_names(self):
        return ["gate_up_proj"] if "gate_up_proj" in self._modules else ["gate_proj", "up_proj"]

    def forward(self, x):
        names = self._up_names()
        norm = self._modules.get("norm")
        projections = [self._modules[n] for n in names] + [self.down_proj]
        with _fused_call(self, [norm, *projections]):
            return self._forward(x, names, norm, projections)

    def _forward(self, x, names, norm, projections):
        linears, reason, checked = decided_projections(self, projections, names + ["down_proj"], [norm],
                                              lambda: norm_reason(norm) if norm is not None else None, zero3.is_hook)
        if reason:
            fallback(self, reason)
            return self._stock(norm(x) if norm is not None else x)
        act = Activation(self.activation, gated=True)
        kept = _kept_call(self, checked, x, norm, act)
        if kept is not None:
            return kept(x, None)
        *ups, down = linears
        _input_checked(x, widths(projections[0])[0], self)
        return fused_mlp(x, ups[0] if len(ups) == 1 else tuple(ups), act, down,
                         norm_of(norm) if norm is not None else None, self.recompute, checked=checked)

    def _stock(self, x):
        if "gate_up_proj" in self._modules:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_GATED_STOCK[self.activation](gate) * up)

    def saved_bytes_per_token(self):
        """Activation bytes per token kept less than the stock computation (act(gate); the product,
        where down_proj trains; the norm's output, where an up projection trains), for an input that
        requires grad."""
        if not self.recompute:
            return 0
        ups = [self._modules[n] for n in self._up_names()]
        return fused_saved_bytes(self._modules.get("norm"), ups, self.down_proj, gated=True)

    @classmethod
    def from_modules(cls, gate, up, down, activation, norm=None, recompute=True):
        """Sharing the very modules (and so the parameters) of the stock layers: gate and up Linears
        (or gate=a fused gate_up Linear and up=None), the down Linear, the activation (a name, nn.SiLU
        or nn.GELU) and optionally the nn.RMSNorm or nn.LayerNorm in front."""
        name = _gated_activation_name(activation)
        fused = up is None
        ups = [gate] if fused else [gate, up]
        if not all(type(m) is torch.nn.Linear for m in [*ups, down]):
            raise TypeError("gate, up and down must be torch.nn.Linear (up None for a fused gate_up Linear)")
        width = gate.out_features // 2 if fused else gate.out_features
        if (fused and gate.out_features % 2) or (not fused and (up.in_features, up.out_features) !=
                                                  (gate.in_features, gate.out_features)):
            raise ValueError("gate and up must have the same shape (a fused gate_up Linear an even out_features)")
        if (down.in_features, down.out_features) != (width, gate.in_features):
            raise ValueError(f"down must map {width} features back to {gate.in_features}, "
                             f"got {down.in_features} -> {down.out_features}")
        if norm is not None and (not isinstance(norm, (torch.nn.RMSNorm, torch.nn.LayerNorm))
                                 or tuple(norm.normalized_shape) != (gate.in_features,)):
            raise TypeError("norm must be a torch.nn.RMSNorm or torch.nn.LayerNorm over gate's input width")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.activation, new.recompute = name, _check_recompute(recompute)
        if norm is not None:
            new.norm = norm
        if fused:
            new.gate_up_proj = gate
        else:
            new.gate_proj, new.up_proj = gate, up
        new.down_proj = down
        return new


class MultiheadSelfAttention(torch.nn.Module):
    """Self-attention on remat.attention: in-projection, attention, out-projection.

    Parameters and state_dict keys are those of torch.nn.MultiheadAttention (in_proj_weight,
    in_proj_bias, out_proj.weight, out_proj.bias); with num_kv_heads < num_heads (GQA/MQA) the
    in-projection has (num_heads + 2 * num_kv_heads) * head_dim rows: q's, then k's, then v's.
    Autograd keeps q, k, v, the attention output and an fp32 log-sum-exp per row, never the
    seq x seq probabilities (dropout, in training, is remat.attention's dropout_p: its mask is
    regenerated in the backward, never stored). Input (batch, seq, embed_dim), or (seq, batch, embed_dim) when
    batch_first=False.

    forward(x) returns the output tensor. Modules built by from_torch keep MultiheadAttention's
    call convention instead, forward(query, key=None, value=None, need_weights=False,
    attn_mask=None) -> (output, None), so they can replace it in place; key and value must be
    None or query itself (self-attention), need_weights must be False and attn_mask None.
    """

    def __init__(self, embed_dim, num_heads, bias=True, causal=False, num_kv_heads=None, dropout=0.0,
                 batch_first=True, device=None, dtype=None):
        super().__init__()
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or embed_dim % num_heads != 0:
            raise ValueError(f"num_heads must be >= 1 and divide embed_dim {embed_dim}, got {num_heads}")
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_kv_heads must be >= 1 and divide num_heads {num_heads}, got {num_kv_heads}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.batch_first, self.dropout = causal, batch_first, float(dropout)
        self.mha_call_convention = False
        factory = {"device": device, "dtype": dtype}
        rows = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.in_proj_weight = torch.nn.Parameter(torch.empty(rows, embed_dim, **factory))
        self.in_proj_bias = torch.nn.Parameter(torch.empty(rows, **factory)) if bias else None
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self):
        # As torch.nn.MultiheadAttention: xavier-uniform in-projection, zero biases.
        torch.nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            torch.nn.init.zeros_(self.in_proj_bias)
            torch.nn.init.zeros_(self.out_proj.bias)

    def forward(self, x, key=None, value=None, need_weights=False, attn_mask=None):
        if (key is not None and key is not x) or (value is not None and value is not x):
            raise ValueError("MultiheadSelfAttention is self-attention: key and value must be None or the query")
        if need_weights:
            raise ValueError("need_weights must be False: remat attention never forms the attention weights")
        if attn_mask is not None:
            raise ValueError("attn_mask must be None: use causal=True for a causal mask")
        layout = "(batch, seq, embed_dim)" if self.batch_first else "(seq, batch, embed_dim)"
        check_self_attention_input(x, self.in_proj_weight, layout)
        if not self.batch_first:
            x = x.transpose(0, 1)
        out = multihead_self_attention(
            x, self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias,
            self.num_heads, self.num_kv_heads, self.causal, self.dropout if self.training else 0.0,
        )
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, None) if self.mha_call_convention else out

    @classmethod
    def from_torch(cls, mha, causal=False):
        """A copy of `mha` (torch.nn.MultiheadAttention) on remat's kernels, with the same input
        layout (mha.batch_first) and MultiheadAttention's call convention (returns (output, None))."""
        if not isinstance(mha, torch.nn.MultiheadAttention):
            raise TypeError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("mha must use one packed in-projection, without add_bias_kv or add_zero_attn")
        weight = mha.in_proj_weight
        new = cls(mha.embed_dim, mha.num_heads, bias=mha.in_proj_bias is not None, causal=causal,
                  dropout=mha.dropout, batch_first=mha.batch_first, device=weight.device, dtype=weight.dtype)
        new.train(mha.training)
        with torch.no_grad():
            new.in_proj_weight.copy_(weight)
            if mha.in_proj_bias is not None:
                new.in_proj_bias.copy_(mha.in_proj_bias)
            new.out_proj.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                new.out_proj.bias.copy_(mha.out_proj.bias)
        new.mha_call_convention = True
        return new


class LinearCrossEntropy(torch.nn.Module):
    """An LM head followed by its loss, F.cross_entropy(linear(x), target), on remat.linear_cross_entropy:
    the (tokens x vocabulary) logits are never formed, neither in the forward nor kept for the backward.

    Holds weight (num_classes, in_features) and an optional bias (num_classes,), initialised and named
    as torch.nn.Linear's (a Linear's state_dict loads into it); `from_linear(linear, **loss_options)`
    shares a Linear's very Parameters instead (a head tied to the embedding stays tied). The loss
    options (ignore_index, reduction, label_smoothing, z_loss, softcap) are fixed at construction;
    forward(x, target, num_items_in_batch=None) returns the loss (see remat.linear_cross_entropy).
    """

    def __init__(self, in_features, num_classes, bias=False, *, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, z_loss=0.0, softcap=None, device=None, dtype=None):
        super().__init__()
        linear = torch.nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.num_classes = in_features, num_classes
        self._set_loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap)

    def _set_loss_options(self, ignore_index, reduction, label_smoothing, z_loss, softcap):
        # Checked now, not at the first forward: a wrong option fails where it was given.
        (self.ignore_index, self.reduction, self.label_smoothing, self.z_loss,
         self.softcap) = loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap)

    def forward(self, x, target, num_items_in_batch=None):
        return linear_cross_entropy(x, self.weight, target, self.bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                    softcap=self.softcap, num_items_in_batch=num_items_in_batch)

    @classmethod
    def from_linear(cls, linear, **loss_options):
        """The head `linear` (a torch.nn.Linear) with a loss, sharing its weight and bias Parameters."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.weight, new.bias = linear.weight, linear.bias
        new.in_features, new.num_classes = linear.in_features, linear.out_features
        options = dict(ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None)
        unknown = set(loss_options) - set(options)
        if unknown:
            raise TypeError(f"from_linear got unknown loss options {sorted(unknown)}; it takes {sorted(options)}")
        new._set_loss_options(**{**options, **loss_options})
        return new

    def extra_repr(self):
        text = f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"
        text += f", ignore_index={self.ignore_index}, reduction={self.reduction!r}"
        for name, default in (("label_smoothing", 0.0), ("z_loss", 0.0), ("softcap", None)):
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)!r}"
        return text
