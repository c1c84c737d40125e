"""Mixtral: the attention as Mistral's (rotary, GQA; llama.py) with input_layernorm fused into q/k/v.
The sparse MoE block stays stock: transformers 5.24 holds its experts (MixtralExperts) as 3-D
parameters, one per projection for all the experts, not as Linear modules, which remat's fused gated
MLP takes. post_attention_layernorm, in front of it, stays stock too: its output feeds the router
and, gathered per expert, each expert's projection, so a fusion into the router alone keeps it all
the same."""

from .llama import WIRING, _RematRotaryAttention, probe_kwargs
from .registry import Family, register


class _RematMixtralAttention(_RematRotaryAttention):
    pass


def _moe_reason(moe):
    """Why the MixtralSparseMoeBlock `moe` runs as it is (and the norm before it)."""
    experts = moe._modules.get("experts")
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False)} if experts is not None else {}
    if shapes and all(len(shape) == 3 for shape in shapes.values()):
        held = ", ".join(f"{n} {shape}" for n, shape in shapes.items())
        what = f"its experts ({type(experts).__name__}) are 3-D parameters ({held}), not Linear modules"
    else:
        what = f"its experts ({type(experts).__name__}) are not the 3-D MixtralExperts remat knows"
    return (f"{what}: remat's fused gated MLP takes Linears, so the MoE block runs as it is, and so does the norm "
            "before it (its output feeds the router and, gathered per expert, each expert's projection: fused "
            "into the router alone it would be kept all the same)")


register(Family(
    name="mixtral",
    attention={"MixtralAttention": _RematMixtralAttention},
    layers={"MixtralDecoderLayer": WIRING},
    norms={"MixtralRMSNorm": "llama"},
    stock_mlps={"MixtralSparseMoeBlock": _moe_reason},
    probe_kwargs=probe_kwargs,
))
