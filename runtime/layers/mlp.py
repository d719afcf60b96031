"""Gated SiLU MLP with fused `[gate; up]` rows: dense layers and the shared expert.

`[g; u] = gate_up_proj · x` (gate rows first), `y = down_proj · (silu(g) ⊙ u)`. With `_fused` set (CUDA) the
activation `silu(g) ⊙ u` is one Triton launch (`ft.runtime.gpu.kernels.fused_ops.silu_mul`, same rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.runtime.layers.base import Op
from ft.runtime.layers.linear import Linear


class GatedMLP(Op):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = Linear()   # [2·I, H]
        self.down_proj = Linear()      # [H, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                 # [T, 2I]
        if self._fused:
            from ft.runtime.gpu.kernels.fused_ops import silu_mul
            return self.down_proj(silu_mul(gate_up))
        g, u = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(g) * u)
