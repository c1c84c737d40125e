"""One module per op family: the reference, the custom-op registration, the public function.

The public functions are re-exported by the top-level package (remat.layer_norm, remat.gelu,
...); the module names here stay free for the modules themselves (remat.ops.layer_norm).
"""
