"""Drop-in modules. They hold parameters and call remat.ops; no math lives here.

The fused layers keep their parameters in stock submodules (`norm`, `linear`, `fc1`, `fc2`),
so their state_dict is that of the unfused stack with those names, and `from_modules` builds
one from existing modules, copying the weights.
"""

import torch

from .ops.fused import layer_norm_linear, mlp
from .ops.gelu import gelu
from .ops.layer_norm import layer_norm

ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


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


class GELU(torch.nn.GELU):
    """torch.nn.GELU on remat's kernel (exact or tanh). Autograd keeps the input only."""

    def forward(self, x):
        return gelu(x, self.approximate)


def _copy_parameters(target, source):
    with torch.no_grad():
        for name, param in source.named_parameters():
            target.get_parameter(name).copy_(param)


def _activation_name(module):
    if not isinstance(module, torch.nn.GELU):
        raise TypeError(f"activation must be a torch.nn.GELU, got {type(module).__name__}")
    return "gelu_tanh" if module.approximate == "tanh" else "gelu"


def _check_recompute(recompute):
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be True or False, got {recompute!r}")
    return recompute


class LayerNormLinear(torch.nn.Module):
    """Linear(LayerNorm(x)) that keeps x and fp32 row statistics instead of LayerNorm(x).

    state_dict: norm.weight, norm.bias, linear.weight, linear.bias. recompute=False keeps
    LayerNorm(x) like the unfused pair does.
    """

    def __init__(self, in_features, out_features, bias=True, eps=1e-5, norm_bias=True,
                 recompute=True, device=None, dtype=None):
        super().__init__()
        self.norm = torch.nn.LayerNorm(in_features, eps=eps, bias=norm_bias, device=device, dtype=dtype)
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recompute = _check_recompute(recompute)

    def forward(self, x):
        return layer_norm_linear(x, self.norm.weight, self.norm.bias, self.linear.weight,
                                 self.linear.bias, self.norm.eps, self.recompute)

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


class MLP(torch.nn.Module):
    """fc2(gelu(fc1(x))) that keeps x and the fc1 output only, never the GELU output.

    activation: "gelu" (exact) or "gelu_tanh". state_dict: fc1.*, fc2.*. recompute=False
    keeps the GELU output like the unfused stack does.
    """

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
        return mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                   ACTIVATIONS[self.activation], self.recompute)

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
        return mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                   ACTIVATIONS[self.activation], self.recompute,
                   norm_weight=self.norm.weight, norm_bias=self.norm.bias, eps=self.norm.eps,
                   layer_norm=True)

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
