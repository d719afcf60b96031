"""Rotary position embedding, rotate_half (NeoX) layout, optionally partial.

The first `rotary_dim` dims of each head are rotated: dim `i < rotary_dim/2` pairs with `i + rotary_dim/2`; the rest
pass through. mrope (qwen3_5_moe) on text input has three identical position streams, which makes it exactly this.
"""

from __future__ import annotations

import torch


class Rotary:
    """cos/sin for arbitrary positions; nothing is precomputed for max_position_embeddings (262k · dim would be
    large), the angles of one forward's positions are computed on the fly."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        # Same expression and dtype as the reference implementation, so the angles are bit-identical.
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self._on: dict[torch.device, torch.Tensor] = {}  # inv_freq per device: no host copy per call (CUDA graphs)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int64 -> cos, sin [N, rotary_dim] in `dtype`."""
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos/sin [N, rotary_dim] -> rotated x (same shape and dtype)."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
