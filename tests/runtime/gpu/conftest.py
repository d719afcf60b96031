"""GPU-runtime tests run everywhere: Triton kernels go through Triton's interpreter on machines without CUDA.

TRITON_INTERPRET must be set before the kernel module is imported (triton.jit reads it at decoration time).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
