"""One module per op family: reference, custom-op registration, public function."""

from .fused import layer_norm_linear, mlp
from .gelu import gelu
from .layer_norm import layer_norm

__all__ = ["gelu", "layer_norm", "layer_norm_linear", "mlp"]
