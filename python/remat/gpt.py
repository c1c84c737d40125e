"""A pre-LN GPT block, built from stock PyTorch layers or from remat's fused layers.

Used by the block benchmark and `remat memory`: the same weights in both builds, so the two
give the same outputs and gradients, and differ only in what autograd keeps:

    stock (eager, SDPA)                          remat
    ln_1 → attn_qkv                              attn_qkv = LayerNormLinear (keeps x, not LN(x))
    SDPA (keeps q, k, v, o, lse)                 remat.attention (keeps q, k, v, o, lse)
    attn_out                                     attn_out (keeps o: the same storage as attention's)
    ln_2 → fc1 → GELU → fc2                      mlp = LayerNormMLP (keeps x and fc1's output)

Per layer in bf16 (s·b tokens, width h, FFN 4h): stock keeps 32·sbh bytes, remat 20·sbh.
"""

import dataclasses

import torch
import torch.nn.functional as F

from . import nn as remat_nn
from .ops.attention import attention


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    hidden: int = 2048
    heads: int = 16
    layers: int = 8
    ffn: int = 0  # 0: 4 * hidden
    eps: float = 1e-5
    activation: str = "gelu"  # or "gelu_tanh"

    @property
    def ffn_hidden(self):
        return self.ffn or 4 * self.hidden


def _split_heads(qkv, heads):
    """(b, s, 3h) → q, k, v of shape (b, heads, s, d): strided views of qkv, no copy."""
    batch, seq, _ = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, -1).unbind(2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _merge_heads(o):
    """(b, heads, s, d) → (b, s, heads·d); a view when o is laid out as (b, s, heads, d)."""
    batch, heads, seq, dim = o.shape
    return o.transpose(1, 2).reshape(batch, seq, heads * dim)


class TorchGPTBlock(torch.nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)), from stock PyTorch layers and causal SDPA."""

    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        h, kw = config.hidden, {"device": device, "dtype": dtype}
        self.config = config
        self.ln_1 = torch.nn.LayerNorm(h, eps=config.eps, **kw)
        self.attn_qkv = torch.nn.Linear(h, 3 * h, **kw)
        self.attn_out = torch.nn.Linear(h, h, **kw)
        self.ln_2 = torch.nn.LayerNorm(h, eps=config.eps, **kw)
        self.fc1 = torch.nn.Linear(h, config.ffn_hidden, **kw)
        self.act = torch.nn.GELU("tanh" if config.activation == "gelu_tanh" else "none")
        self.fc2 = torch.nn.Linear(config.ffn_hidden, h, **kw)

    def forward(self, x):
        q, k, v = _split_heads(self.attn_qkv(self.ln_1(x)), self.config.heads)
        x = x + self.attn_out(_merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return x + self.fc2(self.act(self.fc1(self.ln_2(x))))


class RematGPTBlock(torch.nn.Module):
    """The same block on remat's fused layers and attention."""

    def __init__(self, config, recompute=True, device=None, dtype=None):
        super().__init__()
        h, kw = config.hidden, {"device": device, "dtype": dtype}
        self.config = config
        self.attn_qkv = remat_nn.LayerNormLinear(h, 3 * h, eps=config.eps, recompute=recompute, **kw)
        self.attn_out = torch.nn.Linear(h, h, **kw)
        self.mlp = remat_nn.LayerNormMLP(h, config.ffn_hidden, config.activation, eps=config.eps,
                                         recompute=recompute, **kw)

    def forward(self, x):
        q, k, v = _split_heads(self.attn_qkv(x), self.config.heads)
        x = x + self.attn_out(_merge_heads(attention(q, k, v, causal=True)))
        return x + self.mlp(x)

    @classmethod
    def from_torch(cls, block, recompute=True):
        """A remat block with `block`'s weights (copied)."""
        weight = block.attn_qkv.weight
        new = cls(block.config, recompute=recompute, device=weight.device, dtype=weight.dtype)
        pairs = [
            (new.attn_qkv.norm, block.ln_1), (new.attn_qkv.linear, block.attn_qkv),
            (new.attn_out, block.attn_out), (new.mlp.norm, block.ln_2),
            (new.mlp.fc1, block.fc1), (new.mlp.fc2, block.fc2),
        ]
        with torch.no_grad():
            for target, source in pairs:
                for name, param in source.named_parameters():
                    target.get_parameter(name).copy_(param)
        return new


def torch_stack(config, device=None, dtype=None):
    """config.layers stock blocks, with fresh random weights."""
    return torch.nn.Sequential(*(TorchGPTBlock(config, device, dtype) for _ in range(config.layers)))


def remat_stack(stack, recompute=True):
    """The remat build of a stock stack, with the same weights."""
    return torch.nn.Sequential(*(RematGPTBlock.from_torch(block, recompute) for block in stack))
