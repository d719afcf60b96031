"""NVFP4 bytes, exactly as NVIDIA ModelOpt stores them; shared by the compiler and the runtime.

A quantized linear `W [out, in]` (`in % 16 == 0`) is three tensors:
  weight       uint8          [out, in/2]   two E2M1 codes per byte, element 2j in the LOW nibble, 2j+1 in the high one
  weight_scale float8_e4m3fn  [out, in/16]  one scale per block of 16 consecutive input elements
  weight_scale_2 float32      []  or [out]  per-tensor global (ModelOpt, 0-dim) or per output row (FTW)

E2M1 code (4 bits): bit 3 = sign, bits 0-2 index the magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6].

Exact dequantization, in ModelOpt's evaluation order (`per_block_scale = q_scale.float() * double_scale`, then the
E2M1 value times that scale), everything in float32:
    W[o, i] = E2M1[code(o, i)] * (float32(weight_scale[o, i // 16]) * weight_scale_2[o or ()])
The order matters only in the last bit of fp32 for arbitrary scales; every consumer uses this function.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 16  # elements per e4m3 block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# value of each 4-bit code 0..15 (8 = -0.0)
E2M1_LUT = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
# value pair of each packed byte 0..255: [low nibble (even element), high nibble (odd element)]
_PAIR_LUT = torch.stack([E2M1_LUT.repeat(16), E2M1_LUT.repeat_interleave(16)], dim=1)  # [256, 2]


@functools.cache
def _pair_lut(device: torch.device) -> torch.Tensor:
    """_PAIR_LUT on `device`, copied once: a copy per call is a pageable H2D, which blocks the host until the GPU has
    drained its queue (a prefill dequantizing 5 projections a layer stalled 200 times)."""
    return _PAIR_LUT.to(device)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (values 0..15, n even) -> packed uint8 [..., n/2]; element 2j -> low nibble of byte j."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles: expected uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim {codes.shape[-1]} is odd")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., n/2] -> uint8 codes [..., n] (inverse of pack_nibbles)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles: expected uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., n/2] -> float32 E2M1 values [..., n] (one gather through the 256-entry pair table)."""
    return _pair_lut(packed.device)[packed.long()].flatten(-2)


def check_shapes(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> None:
    """Raise ValueError unless (weight, scale, scale_2) form one NVFP4 tensor (optionally with leading dims)."""
    if weight.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or scale_2.dtype != torch.float32:
        raise ValueError(
            "NVFP4 dtypes must be uint8 / float8_e4m3fn / float32, "
            f"got {weight.dtype} / {scale.dtype} / {scale_2.dtype}"
        )
    if weight.dim() < 2 or scale.shape[:-1] != weight.shape[:-1] or scale.shape[-1] * BLOCK != weight.shape[-1] * 2:
        raise ValueError(f"NVFP4 weight {tuple(weight.shape)} and weight_scale {tuple(scale.shape)} do not match "
                         f"([..., out, in/2] and [..., out, in/16])")
    if scale_2.numel() != 1 and scale_2.shape != weight.shape[:-1]:
        raise ValueError(f"NVFP4 weight_scale_2 {tuple(scale_2.shape)} must be a scalar or per row "
                         f"{tuple(weight.shape[:-1])}")


def block_scales(scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float32 [..., out, in/16]: f32(weight_scale) * weight_scale_2 (scalar, or broadcast per output row)."""
    s2 = scale_2.reshape(()) if scale_2.numel() == 1 else scale_2.unsqueeze(-1)
    return scale.float() * s2


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Exact float32 [..., out, in] from NVFP4 (weight u8 [..., out, in/2], scale e4m3 [..., out, in/16],
    scale_2 f32 scalar or [..., out])."""
    check_shapes(weight, scale, scale_2)
    values = e2m1_values(weight)  # [..., out, in]
    blocks = block_scales(scale, scale_2.to(weight.device))  # [..., out, in/16]
    out = values.unflatten(-1, (-1, BLOCK)) * blocks.unsqueeze(-1)
    return out.flatten(-2)
