"""DistilBERT: self-attention on remat.attention (post-LN: no LayerNorm to fuse in front), and the
FFN module fused (lin1 -> activation -> lin2 (+ dropout))."""

from .modules import MLPParts, _RematSplitAttention
from .registry import Family, register


class _RematDistilBertSelfAttention(_RematSplitAttention):
    remat_head_dim_attr = "attention_head_size"
    remat_projections = ("q_lin", "k_lin", "v_lin")
    remat_output_projection = "out_lin"


register(Family(
    name="distilbert",
    attention={"DistilBertSelfAttention": _RematDistilBertSelfAttention},
    mlps={"FFN": MLPParts("lin1", "activation", "lin2", "dropout")},
))
