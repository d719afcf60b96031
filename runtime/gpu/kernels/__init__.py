"""Triton kernels of the CUDA path, each beside its PyTorch reference and tests."""
