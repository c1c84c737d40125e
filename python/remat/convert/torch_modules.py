"""torch's own modules: nn.LayerNorm, nn.GELU and nn.MultiheadAttention swapped one by one.

A lone LayerNorm or GELU on remat's kernels saves no memory (the Linear after it keeps its output);
they are swapped for speed and for the fusions' sake. nn.MultiheadAttention becomes
RematMultiheadAttention, whose self-attention calls run remat.attention.
"""

import torch
from torch import nn

from .. import nn as remat_nn
from .._guards import fallback, hook_reason
from .._validate import autocast_dtype
from ..ops.attention import multihead_self_attention
from .patterns import gelu_approximate, unsupported_reason
from .swap import with_class


def _is_causal_mask(mask, seq):
    """True when `mask` is exactly the (seq, seq) causal mask (bool: True = masked; float: -inf above).

    Under torch.compile only the shape is checked: the values would have to come back to the
    host, a graph break. The caller's is_causal=True hint is then trusted, as
    nn.MultiheadAttention itself trusts it for need_weights=False without key_padding_mask
    (it drops the mask and runs causal attention).
    """
    if mask.shape != (seq, seq):
        return False
    if torch.compiler.is_compiling():
        return True
    upper = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, upper))
    return bool(((mask == float("-inf")) == upper).all() and (mask.masked_fill(upper, 0) == 0).all())


class RematMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention whose self-attention runs on remat.attention.

    Same constructor, parameters, state_dict keys and call convention. remat's path runs when
    the call is self-attention (query is key is value, a 3-D batch), need_weights=False, no
    key_padding_mask, attn_mask None (or exactly the causal mask with is_causal=True; under
    torch.compile any (seq, seq) mask with is_causal=True, see _is_causal_mask), a packed
    in-projection without bias_k/add_zero_attn, and the input in the parameters' dtype or autocast
    on. Dropout in training runs on remat.attention's dropout_p (its own mask, drawn from torch's
    generator and regenerated in the backward: the same distribution, not the same draws as
    torch's). Every other call runs the stock
    nn.MultiheadAttention.forward, so conversion never breaks a model that worked. The
    remat path returns (output, None): no attention weights, as need_weights=False does.
    Autograd then keeps q, k, v, the output and fp32 log-sum-exps, never seq x seq.
    """

    def remat_fallback_reason(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """None when the remat path applies to this call, else the reason it does not."""
        if key is not query or value is not query:
            return "not self-attention"
        if need_weights:
            return "need_weights=True"
        if key_padding_mask is not None:
            return "key_padding_mask"
        if query.dim() != 3:
            return "unbatched input"
        if not self._qkv_same_embed_dim or self.bias_k is not None or self.add_zero_attn:
            return "unpacked in-projection, bias_k or add_zero_attn"
        # Under autocast the projections autocast, as torch's own do; outside it, a dtype mismatch is
        # torch's error, which the stock forward raises.
        if autocast_dtype(query.device.type) is None and query.dtype != self.in_proj_weight.dtype:
            return "input dtype differs from the parameters'"
        if attn_mask is not None:
            seq = query.shape[1] if self.batch_first else query.shape[0]
            if not (is_causal and _is_causal_mask(attn_mask, seq)):
                return "attn_mask other than the causal mask"
        elif is_causal:
            return "is_causal without attn_mask"
        return None

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        reason = self.remat_fallback_reason(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if reason is not None:
            fallback(self, reason)
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        x = query if self.batch_first else query.transpose(0, 1)
        out = multihead_self_attention(
            x, self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias,
            self.num_heads, self.num_heads, attn_mask is not None, self.dropout if self.training else 0.0,
        )
        return (out if self.batch_first else out.transpose(0, 1)), None

    def remat_revert(self):
        return with_class(self, nn.MultiheadAttention)


def leaf_swap(module, options, path, report):
    """The replacement for a single torch module, or None (with a report row when it was a candidate)."""
    kind = type(module)
    if kind is nn.LayerNorm and options.wants("layernorm"):
        reason = hook_reason(module)
        if reason is None:
            report.add(path, module, "swapped to remat.nn.LayerNorm")
            return remat_nn.LayerNorm.from_torch(module)
        report.add(path, module, "skipped", reason)
    elif kind is nn.GELU and options.wants("gelu"):
        reason = hook_reason(module) or (None if gelu_approximate(module) else "unknown approximate")
        if reason is None:
            report.add(path, module, "swapped to remat.nn.GELU")
            return remat_nn.GELU(module.approximate)
        report.add(path, module, "skipped", reason)
    elif kind is nn.MultiheadAttention and options.wants("attention"):
        reason = hook_reason(module)
        if reason is None:
            note = "self-attention calls with need_weights=False and no masks run remat.attention; others run torch"
            if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
                note = "kdim/vdim, bias_k or add_zero_attn: every call runs torch"
            report.add(path, module, "swapped to RematMultiheadAttention", note)
            return with_class(module, RematMultiheadAttention)
        report.add(path, module, "skipped", reason)
    elif isinstance(module, (nn.LayerNorm, nn.GELU, nn.MultiheadAttention)) and not isinstance(
            module, (remat_nn.LayerNorm, remat_nn.GELU, RematMultiheadAttention)):
        report.add(path, module, "skipped", "subclass of a stock layer (its forward may differ)")
    elif unsupported_reason(module):
        report.add(path, module, "skipped", unsupported_reason(module))
    return None
