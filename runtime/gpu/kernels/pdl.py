"""Programmatic dependent launch (PDL, sm90+) for the kernels of a decode step.

A decode step is ~450 small kernels back to back, each a few microseconds; between two of them the GPU drains the
first and then launches the second. With PDL a kernel's programs may be launched while the previous kernel still
runs: each of our kernels first lets its successor launch (`griddepcontrol.launch_dependents`) and waits for its
predecessor to finish, with its memory visible (`griddepcontrol.wait`), before it touches any memory. So the wait
is the only ordering, and it is as strong as the stream's: no kernel reads or writes before everything before it has
completed. Kernels launched without PDL (cuBLAS, torch's) keep the stream's ordering on both sides. CUDA graphs keep
the programmatic edges.

    kernel[grid](..., **pdl_args(device))   and, as the kernel's first statement,   pdl_wait(PDL)
`ENABLED` is decided at import (a CUDA device of compute capability 9 or more and a Triton that has the
instructions); `pdl_args` gives PDL=False (and no launch option) for tensors off CUDA (the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _supported() -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


ENABLED = _supported()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    # let the successor launch (its programs still wait for this kernel where they call pdl_wait / pdl_wait_only)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait_only(PDL: tl.constexpr):
    # wait for the predecessor to finish, with its memory visible
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait_only(PDL)


def pdl_args(device: torch.device) -> dict:
    """The kernel arguments that turn PDL on for a launch on `device` (see the module docstring)."""
    return {"PDL": True, "launch_pdl": True} if ENABLED and device.type == "cuda" else {"PDL": False}
