"""Hugging Face transformers support for remat.convert: one file per model family registers its classes,
submodule names, layer wirings, attention class and probe inputs
(registry.Family); modules.py holds the swapped classes they share, rules.py what convert does with
each module. The families, what each swap computes and when it runs stock: docs/huggingface.md.
"""

import sys

from . import bloom  # noqa: F401  (registers its family)
from .experts import convert_experts, revert_experts
from .interface import convert_attention, revert_attention
from .loss import convert_loss, revert_loss
from .modules import Handoff, RematFusedLayerNorm
from .registry import FAMILIES
from .rules import PROBE_BROKEN, convert_children
from .structure import example_inputs
from .structure import probe as probe_structure

__all__ = ["FAMILIES", "PROBE_BROKEN", "Handoff", "RematFusedLayerNorm", "convert_attention", "convert_children",
           "convert_experts", "convert_loss", "example_inputs", "is_hf_model", "probe_structure",
           "revert_attention", "revert_experts", "revert_loss"]


def is_hf_model(model):
    """True when `model` is a transformers PreTrainedModel (transformers not imported: False)."""
    if sys.modules.get("transformers") is None:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)
