"""One module per op family: the reference, the family's declaration (custom ops, fakes, autograd), the
public function; ops/_family.py turns each declaration into its ops.

The public functions are re-exported by the top-level package (remat.layer_norm, remat.gelu,
...); the module names here stay free for the modules themselves (remat.ops.layer_norm).
FAMILIES lists the declared families, name -> OpFamily, for the tooling that loops over them.
"""

# Each module declares its family on import; this order is FAMILIES' order, and so the order of
# the benchmark suites (the quick ones first).
from . import layer_norm, rms_norm, gelu, gated, attention, attention_varlen, linear_cross_entropy, experts  # noqa: F401, I001
from ._family import FAMILIES, registered_calls

__all__ = ["FAMILIES", "registered_calls"]
