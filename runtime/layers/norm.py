"""RMS norms, computed in fp32.

The compiler stores every norm weight in fp32 with the `1 + w` of zero-centred RMSNorm already folded in, so one
formula covers all families: `y = w · x / sqrt(mean(x²) + eps)`, evaluated in fp32 and cast back to `x.dtype`.

With `_fused` set (CUDA) `RMSNorm` runs the Triton kernels of `gpu.kernels.fused_ops`; `RMSNorm.add` also folds
the residual add in front of the norm (`s = x + delta` rounded to the compute dtype, then `y = norm(s)`), one launch
at every layer boundary. The functions here are the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.runtime.layers.base import REQUIRED, Op


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x², -1) + eps)` in fp32 (returns fp32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] fp32 -> `w · rms_normalize(x)` cast back to x.dtype."""
    return (rms_normalize(x, eps) * weight).to(x.dtype)


class RMSNorm(Op):
    """`weight [dim]` fp32; normalises over the last dim."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED
        self._eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            from ft.runtime.gpu.kernels.fused_ops import rms_norm as fused
            return fused(x, self.weight, self._eps)
        return rms_norm(x, self.weight, self._eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) with s = x + delta in x's dtype (delta None: s = x): a residual add and the next norm."""
        if delta is None:
            return x, self(x)
        if self._fused:
            from ft.runtime.gpu.kernels.fused_ops import add_rms_norm
            return add_rms_norm(x, delta, self.weight, self._eps)
        s = x + delta
        return s, rms_norm(s, self.weight, self._eps)


class RMSNormGated(Op):
    """Gated DeltaNet output norm: `w · rmsnorm(x) · silu(z)` (plain `w`, not zero-centred), per value head."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED
        self._eps = eps

    def __call__(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # x, z: [..., dv]
        return (rms_normalize(x, self._eps) * self.weight * F.silu(z.float())).to(x.dtype)
