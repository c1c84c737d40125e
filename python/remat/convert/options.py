"""What remat.convert was asked to do, checked once and handed to every rule as one object."""

import dataclasses
from collections.abc import Callable

LAYERS = frozenset({"layernorm", "gelu", "attention", "mlp", "loss", "experts"})


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """layers: the rules to apply (a subset of LAYERS); recompute: the fused layers' switch (False keeps
    what eager keeps); filter_fn(module, fqn) -> bool: the modules convert may change (None: all)."""

    layers: frozenset = LAYERS
    recompute: bool = True
    filter_fn: Callable | None = None

    def __post_init__(self):
        object.__setattr__(self, "layers", _layer_set(self.layers))
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute must be True or False, got {self.recompute!r}")
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise TypeError(f"filter_fn must be a function (module, fqn) -> bool, got {type(self.filter_fn).__name__}")

    def wants(self, *layers):
        """Whether any of the rules `layers` is asked for."""
        return any(layer in self.layers for layer in layers)


def _layer_set(layers):
    if isinstance(layers, str):  # a single name, not its letters
        layers = (layers,)
    try:
        layers = frozenset(layers)
    except TypeError:
        raise TypeError(f"layers must be a name or a collection of names from {sorted(LAYERS)}, "
                        f"got {layers!r}") from None
    unknown = layers - LAYERS
    if unknown:
        raise ValueError(f"layers must be a subset of {sorted(LAYERS)}, got unknown {sorted(map(str, unknown))}")
    return layers
