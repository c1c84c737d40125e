"""One module per op family: reference, custom-op registration, public function."""

from .layer_norm import layer_norm

__all__ = ["layer_norm"]
