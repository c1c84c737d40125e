"""Triton kernels of remat, one module per op family (installed as ``remat.triton_kernels``)."""
