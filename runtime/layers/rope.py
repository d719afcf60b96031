"""Rotary position embedding, rotate_half (NeoX) layout, optionally partial.

The first `rotary_dim` dims of each head are rotated: dim `i < rotary_dim/2` pairs with `i + rotary_dim/2`; the rest
pass through. mrope (qwen3_5_moe) on text input has three identical position streams, which makes it exactly this.
YaRN (gpt_oss, `rope_type = yarn`) only changes the inverse frequencies (a ramp between the original and the
`factor`-interpolated ones) and multiplies cos and sin by `rope_attention_factor`, as transformers'
`_compute_yarn_parameters` does.
"""

from __future__ import annotations

import math

import torch

from ft.formats.config import ModelConfig


class Rotary:
    """cos/sin for arbitrary positions; nothing is precomputed for max_position_embeddings (262k · dim would be
    large), the angles of one forward's positions are computed on the fly."""

    def __init__(self, rotary_dim: int, theta: float, *, inv_freq: torch.Tensor | None = None,
                 scale: float = 1.0) -> None:
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        # Same expression and dtype as the reference implementation, so the angles are bit-identical.
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)) \
            if inv_freq is None else inv_freq
        self.scale = scale  # multiplies cos and sin (YaRN's attention factor)
        self._on: dict[torch.device, torch.Tensor] = {}  # inv_freq per device: no host copy per call (CUDA graphs)

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> "Rotary | None":
        """The model's rotary embedding (None without rotary dims)."""
        if not cfg.rotary_dim:
            return None
        if cfg.rope_type == "yarn":
            return cls(cfg.rotary_dim, cfg.rope_theta, inv_freq=yarn_inv_freq(cfg), scale=cfg.rope_attention_factor)
        return cls(cfg.rotary_dim, cfg.rope_theta)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int64 -> cos, sin [N, rotary_dim] in `dtype`."""
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.scale != 1.0:
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """float32 [rotary_dim / 2]: YaRN's blend of extrapolated (original) and interpolated (/ factor) frequencies over
    the dims between the correction range of beta_fast and beta_slow rotations (same expressions as transformers)."""
    dim, base, factor = cfg.rotary_dim, cfg.rope_theta, cfg.rope_factor
    orig = cfg.rope_original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # weight of the original frequency per dim
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos/sin [N, rotary_dim] -> rotated x (same shape and dtype)."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
