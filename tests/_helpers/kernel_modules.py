"""The Triton kernel modules as the tests import them."""

import importlib


def kernel_module(name):
    """remat.triton_kernels.<name> once installed (pip install -e .), else the in-tree triton_kernels.<name>."""
    try:
        return importlib.import_module(f"remat.triton_kernels.{name}")
    except ImportError:
        return importlib.import_module(f"triton_kernels.{name}")
