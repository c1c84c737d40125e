"""Drop-in modules. They hold parameters and call remat.ops; no math lives here."""

import torch

from . import ops


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm on remat's kernels: same constructor, parameters and state_dict keys.

    Autograd keeps the input and fp32 mean/rstd per row; the backward recomputes the normalised
    input from them.
    """

    def forward(self, x):
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

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
