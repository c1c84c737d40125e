"""The Hugging Face model families remat converts. Each family is one file of this package that
registers one Family: its classes, the submodule names its rules read, the remat classes of its
attention, what a probe call of its modules needs, and the configs `remat memory` builds."""

import dataclasses
from collections.abc import Callable, Mapping

# Pre-LN layer: ((LayerNorm, attention), (LayerNorm, MLP)) child names; each LayerNorm's output feeds
# only the module after it (checked by the probe, which runs the whole layer).
# Pair: (intermediate attr, its class name, output attr, its class name) of an FFN split over two
# siblings (BERT's), the output computing the whole FFN.


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    attention: Mapping[str, type] = dataclasses.field(default_factory=dict)  # stock class name -> remat mixin
    mlps: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # stock class name -> MLPParts
    layers: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # layer class name -> pre-LN pairs
    pairs: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # layer class name -> FFN pair
    probe_kwargs: Callable | None = None  # (module, param) -> keyword arguments a probe call needs
    memory_models: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # name -> (model_type, fields)

    def classes(self):
        return {*self.attention, *self.mlps, *self.layers, *self.pairs}


FAMILIES = {}


def register(family):
    """Add `family` (its file calls this once, at import)."""
    FAMILIES[family.name] = family
    return family


def _merged(field):
    return {name: value for family in FAMILIES.values() for name, value in getattr(family, field).items()}


def attention_mixin(name):
    """The remat mixin for the stock attention class `name`, or None."""
    return _merged("attention").get(name)


def mlp_parts(name):
    return _merged("mlps").get(name)


def layer_rule(name):
    return _merged("layers").get(name)


def pair_rule(name):
    return _merged("pairs").get(name)


def family_of(module):
    """The family one of whose classes `module` is, or None."""
    name = type(module).__name__
    return next((family for family in FAMILIES.values() if name in family.classes()), None)


def memory_models():
    """{name: (model_type, config fields)} of the Hugging Face models `remat memory` builds."""
    return _merged("memory_models")
