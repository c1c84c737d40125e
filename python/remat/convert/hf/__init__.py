"""Hugging Face transformers support for remat.convert, by structure: structure.py probes what reads
what, rules.py fuses what that shows safe (modules.py holds the swapped classes, handoff.py the links by
which one does the work of the modules before it; probe.py checks each fusion against the stock
forward), interface.py makes "remat" the model's attention implementation, experts.py its experts',
head_norm.py fuses q/k norms into the attention, loss.py the LM head into its loss. bloom.py is the one
family swapped by class (its ALiBi attention), a plan of its own applied after the rules by structure.
What each swap computes and when it runs stock: docs/huggingface.md.
"""

import sys

from .bloom import swap_attention as swap_bloom_attention
from .experts import convert_experts, revert_experts
from .interface import convert_attention, revert_attention
from .loss import convert_loss, revert_loss
from .modules import RematFusedLayerNorm
from .probe import PROBE_BROKEN
from .rules import convert_children
from .structure import example_inputs
from .structure import probe as probe_structure

__all__ = ["PROBE_BROKEN", "RematFusedLayerNorm", "convert_attention", "convert_children",
           "convert_experts", "convert_loss", "example_inputs", "is_hf_model", "probe_structure",
           "revert_attention", "revert_experts", "revert_loss", "swap_bloom_attention"]


def is_hf_model(model):
    """True when `model` is a transformers PreTrainedModel (transformers not imported: False)."""
    if sys.modules.get("transformers") is None:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)
