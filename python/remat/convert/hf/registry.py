"""The Hugging Face model families remat converts. Each family is one file of this package that
registers one Family: its classes, the submodule names its rules read, the remat classes of its
attention, and what a probe call of its modules needs."""

import dataclasses
from collections.abc import Callable, Mapping

import torch

# A layer's wirings: the alternative ways its forward feeds its LayerNorms to the modules after them,
# each a tuple of (LayerNorm child, consumer path) pairs; the first wiring whose modules all exist in
# the layer applies. A consumer is an attention or MLP child with a rule, or a Linear below the layer
# ("self_attention.query_key_value": the LayerNorm fused into that Linear, its module kept stock).
# One LayerNorm may feed several consumers. Each LayerNorm's output must feed only its consumers: the
# probe, which runs the whole layer, checks it.

@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    attention: Mapping[str, type] = dataclasses.field(default_factory=dict)  # stock class name -> remat mixin
    mlps: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # stock class name -> MLPParts
    layers: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # layer class name -> wirings
    layer_reason: Callable | None = None  # (layer) -> why its LayerNorms do not feed its wiring (post-LN), or None
    probe_kwargs: Callable | None = None  # (module, param) -> keyword arguments a probe call needs

    def classes(self):
        return {*self.attention, *self.mlps, *self.layers}


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


def family_of(module):
    """The family one of whose classes `module` is (or was, before its swap), or None."""
    name = stock_name(module)
    return next((family for family in FAMILIES.values() if name in family.classes()), None)


def stock_name(module):
    """The name of `module`'s stock class (also once it is swapped to a remat class)."""
    return getattr(module, "remat_stock", type(module)).__name__


def probe_tensor(param, *shape, seed=2):
    """A random tensor of `shape` on `param`'s device and dtype, for a probe call's other inputs."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(param.device, param.dtype)

