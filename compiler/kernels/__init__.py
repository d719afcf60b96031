"""Prebuilt Triton kernels for an FTW (`ft kernels build`, `ft checkpoint --kernels`): see build.py."""

from ft.compiler.kernels.build import DEFAULT_ARCHS, ArchResult, add_kernels, build_kernel_set, parse_archs

__all__ = ["DEFAULT_ARCHS", "ArchResult", "add_kernels", "build_kernel_set", "parse_archs"]
