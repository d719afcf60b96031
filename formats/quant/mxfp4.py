"""MXFP4 bytes (OCP Microscaling FP4, the gpt-oss expert layout); shared by the compiler and the runtime.

A quantized matrix `W [out, in]` (`in % 32 == 0`) is two tensors:
  blocks uint8 [out, in/2]    two E2M1 codes per byte, element 2j in the LOW nibble, 2j+1 in the high one
  scales uint8 [out, in/32]   one E8M0 power-of-two scale per block of 32 consecutive input elements

gpt-oss checkpoints store the codes as `*_blocks [E, out, in/32, 16]` (the same bytes, the last two dims merged here)
and the scales as `*_scales [E, out, in/32]`. E2M1 code bits: bit 3 sign, bits 0-2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6].

Exact dequantization (transformers' `_convert_moe_packed_tensors`, in float32):
    W[o, i] = E2M1[code(o, i)] · 2^(scales[o, i // 32] − 127)
Every product is exact in float32 (and in bfloat16, except for results below bfloat16's normal range). The OCP spec
reserves scale 255 for NaN; gpt-oss never writes it, and this decoder (like transformers') reads it as 2^128 = inf.
"""

from __future__ import annotations

import torch

from ft.formats.quant.nvfp4 import e2m1_values

BLOCK = 32  # elements per E8M0 scale
SCALE_BIAS = 127


def check_shapes(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ValueError unless (blocks, scales) form one MXFP4 matrix (optionally with leading dims)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.dim() < 2 or scales.shape[:-1] != blocks.shape[:-1] or scales.shape[-1] * BLOCK != blocks.shape[-1] * 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([..., out, in/2] and [..., out, in/32])")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact float32 [..., out, in] from MXFP4 (blocks u8 [..., out, in/2], scales u8 [..., out, in/32])."""
    check_shapes(blocks, scales)
    values = e2m1_values(blocks).unflatten(-1, (-1, BLOCK))            # [..., out, in/32, 32]
    powers = torch.exp2(scales.float() - SCALE_BIAS)                   # [..., out, in/32], exact powers of two
    return (values * powers.unsqueeze(-1)).flatten(-2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., out, in] -> (blocks u8 [..., out, in/2], scales u8 [..., out, in/32]); the OCP-style encoder of
    synthetic checkpoints: per 32-block shared exponent e = floor(log2(amax)) − 2 (0 for an all-zero block), clamped
    to [−127, 127], then each element's nearest E2M1 magnitude of min(|x| / 2^e, 6). Not bit-identical to OpenAI's
    rounding; what matters is that `dequantize` of its output is exact."""
    from ft.formats.quant.nvfp4 import E2M1_LUT, pack_nibbles

    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs in % {BLOCK} == 0, got a last dim of {w.shape[-1]}")
    g = w.float().unflatten(-1, (-1, BLOCK))                            # [..., out, in/32, 32]
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -149))) - 2, torch.zeros_like(amax))
    e = e.clamp(-SCALE_BIAS, SCALE_BIAS)
    x = (g / torch.exp2(e).unsqueeze(-1)).abs().clamp(max=6.0)
    mags = E2M1_LUT[:8]
    code = (x.unsqueeze(-1) - mags).abs().argmin(-1).to(torch.uint8)   # nearest magnitude (ties: the smaller)
    code = code | ((g < 0).to(torch.uint8) << 3)
    return pack_nibbles(code.flatten(-2)), (e + SCALE_BIAS).to(torch.uint8)
