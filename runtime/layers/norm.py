"""RMS norms, computed in fp32.

The compiler stores every norm weight in fp32 with the `1 + w` of zero-centred RMSNorm already folded in, so one
formula covers all families: `y = w · x / sqrt(mean(x²) + eps)`, evaluated in fp32 and cast back to `x.dtype`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.runtime.layers.base import REQUIRED, Op


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x², -1) + eps)` in fp32 (returns fp32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(Op):
    """`weight [dim]` fp32; normalises over the last dim."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED
        self._eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self._eps) * self.weight).to(x.dtype)


class RMSNormGated(Op):
    """Gated DeltaNet output norm: `w · rmsnorm(x) · silu(z)` (plain `w`, not zero-centred), per value head."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED
        self._eps = eps

    def __call__(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # x, z: [..., dv]
        return (rms_normalize(x, self._eps) * self.weight * F.silu(z.float())).to(x.dtype)
