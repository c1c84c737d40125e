"""The flat arguments of remat.ops.fused's autograd Functions: per Linear its weight, bias and flat LoRA
adapters, their layout, and what the Functions need of them (which gradients, what to keep)."""

import collections
import functools

from ..specs import Linear
from ._lora import _PER_ADAPTER, _adapter_needs, _flatten, _unflatten

_Needs = collections.namedtuple("_Needs", "weight bias adapters")


# What a fused Function's forward and backward compute and keep follows from its inputs' needs_input_grad and its
# layout alone: decided once per combination (a converted layer's calls bring the same ones at every step), not
# worked out again at every call. needs: a _Needs per Linear; the flags: see the Functions' forwards.
_NormLinearsNeeds = collections.namedtuple("_NormLinearsNeeds", "needs norm_grad normed")
_MLPNeeds = collections.namedtuple("_MLPNeeds", "needs norm_grad up_input dh activation")


@functools.lru_cache(maxsize=1024)
def _norm_linears_needs(needs_input_grad, layout):
    """_LayerNormLinears': whether the norm's backward runs, and whether norm(x) is needed (for each dW and dA)."""
    needs = tuple(_unpack_needs(needs_input_grad[7:], layout))
    return _NormLinearsNeeds(needs, any(needs_input_grad[:3]),
                             any(n.weight or any(a[0] for a in n.adapters) for n in needs))


@functools.lru_cache(maxsize=1024)
def _mlp_needs(needs_input_grad, has_norm, layout):
    """_MLP's: whether the norm's backward runs, the up projections' input is needed (for their dW and dA), dh is
    (for dx, the norm's gradients, those and the up biases' and adapters') and act(h) is (for dW2 and down's dA)."""
    needs = tuple(_unpack_needs(needs_input_grad[5:], layout))
    up_needs, down_needs = needs[:-1], needs[-1]
    norm_grad = has_norm and any(needs_input_grad[1:4])
    up_input = any(n.weight or any(a[0] for a in n.adapters) for n in up_needs)
    dh = (needs_input_grad[1] or norm_grad or up_input
          or any(n.bias or any(a[1] or a[2] for a in n.adapters) for n in up_needs))
    activation = down_needs.weight or any(a[0] for a in down_needs.adapters)
    return _MLPNeeds(needs, norm_grad, up_input, dh, activation)


def _kept_intermediates(intermediates, needs):
    """The adapters' rank-r intermediates A(x) whose B's gradient is needed (None for the others)."""
    if not intermediates:  # no adapters (every fused call of a converted model without LoRA)
        return ()
    return [t if a[1] else None for t, a in zip(intermediates, [a for n in needs for a in n.adapters])]


# What a fused Function knows of its Linears besides their tensors: per Linear, its adapters' scales, and
# whether its weight is stored (in, out) (remat.specs.Linear's transposed).
_LinearsLayout = collections.namedtuple("_LinearsLayout", "scales transposed")


def _flat_linears(linears):
    """(the flat tensors of `linears` for a fused Function: per Linear its weight, bias and flat adapters;
    their _LinearsLayout). A bias is made contiguous: the GELU kernel may add it."""
    tensors, scales = [], []
    for linear in linears:
        flat, linear_scales = _flatten(linear.adapters)
        tensors += [linear.weight, linear.bias.contiguous() if linear.bias is not None else None, *flat]
        scales.append(linear_scales)
    return tensors, _LinearsLayout(tuple(scales), tuple(bool(linear.transposed) for linear in linears))


def _unpack_linears(tensors, layout):
    """[remat.specs.Linear] from the flat tensors of a fused Function and their _LinearsLayout."""
    if not any(layout.scales):  # no adapters (every fused call of a converted model without LoRA): weight, bias pairs
        return [Linear(tensors[2 * i], tensors[2 * i + 1], (), transposed)
                for i, transposed in enumerate(layout.transposed)]
    linears, i = [], 0
    for scales, transposed in zip(layout.scales, layout.transposed):
        size = _PER_ADAPTER * len(scales)
        linears.append(Linear(tensors[i], tensors[i + 1], tuple(_unflatten(tensors[i + 2:i + 2 + size], scales)),
                              transposed))
        i += 2 + size
    return linears


def _unpack_needs(needs, layout):
    """[_Needs(weight, bias, per-adapter needs)] from the needs_input_grad of the flat tensors."""
    if not any(layout.scales):
        return [_Needs(needs[2 * i], needs[2 * i + 1], []) for i in range(len(layout.scales))]
    out, i = [], 0
    for scales in layout.scales:
        out.append(_Needs(needs[i], needs[i + 1], _adapter_needs(needs[i + 2:], len(scales))))
        i += 2 + _PER_ADAPTER * len(scales)
    return out
