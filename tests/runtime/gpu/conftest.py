"""GPU-runtime tests run everywhere: Triton kernels go through Triton's interpreter on machines without CUDA.

TRITON_INTERPRET must be set before the kernel module is imported (triton.jit reads it at decoration time).
The benchmark helpers some tests exercise live in tools/ (not the runtime package): it goes on the import path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
