"""FP8 (e4m3fn) weights with a float32 scale per tensor or per output row; shared by the compiler and the runtime.

ModelOpt FP8 linears store `weight` float8_e4m3fn [out, in] and `weight_scale` float32 0-dim; FTW stores the scale
per output row ([out]) so that fused q/k/v rows keep their own scale. Exact dequantization in float32:
    W[o, i] = float32(weight[o, i]) * weight_scale[() or o]
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def check_shapes(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError unless (weight, scale) form one FP8 tensor with a per-tensor or per-row scale."""
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"FP8 dtypes must be float8_e4m3fn / float32, got {weight.dtype} / {scale.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"FP8 weight must be at least 2-D, got {tuple(weight.shape)}")
    if scale.numel() != 1 and scale.shape != weight.shape[:-1]:
        raise ValueError(f"FP8 weight_scale {tuple(scale.shape)} must be a scalar or per row "
                         f"{tuple(weight.shape[:-1])}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact float32 [..., out, in] from fp8 weight [..., out, in] and scale (0-dim/1-element or [..., out])."""
    check_shapes(weight, scale)
    s = scale.to(weight.device)
    s = s.reshape(()) if s.numel() == 1 else s.unsqueeze(-1)
    return weight.float() * s
