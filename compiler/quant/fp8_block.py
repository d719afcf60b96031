"""Block-scaled FP8 (e4m3fn, 128x128 tiles) as DeepSeek-V3, Qwen3-*-FP8 and GLM-*-FP8 releases store it.

A linear `W [N, K]` is `weight` float8_e4m3fn [N, K] plus `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)], which
despite its name is the dequantization MULTIPLIER of each tile (ragged last tiles included):

    W[i, j] = float32(weight[i, j]) * weight_scale_inv[i // 128, j // 128]

Scale formats (`quantization_config.scale_fmt`, transformers' `FineGrainedFP8Config`): "float" stores the grid as
F32 (DeepSeek-V3, Qwen3-*-FP8, GLM-*-FP8); "ue8m0" stores each scale as one E8M0 byte, the power of two
2^(e - 127) (DeepSeek-V4: F8_E8M0, `torch.float8_e8m0fnu`; MXFP8-style checkpoints: U8 bytes, which transformers
reads as the same exponents). `scale_values` turns either into the exact float32 multipliers (every 2^(e - 127),
e in 0..254, is a float32, 2^-127 a subnormal one); e = 255 is E8M0's NaN (transformers' float8_e8m0fnu cast gives
NaN, its U8 path 2^128 = inf) and is refused: no real weight has it.

FTW has no block-FP8 scheme: the compiler dequantizes these linears (exact float32, rounded once to the output
dtype) or re-quantizes experts to NVFP4. For row-wise handling (`ft.compiler.linear.Rows`: concatenation and row
permutation act on dim 0 of every tensor) the tile grid is expanded along the rows to `[N, ceil(K/128)]` on load;
column tiles stay as they are.
"""

from __future__ import annotations

import math

import torch

from ft.formats.quant.fp8 import E4M3_MAX

BLOCK = 128
MIN_AMAX = 1e-12  # an all-zero tile still gets a positive scale


SCALE_FMTS = {"float": ("F32",), "ue8m0": ("F8_E8M0", "U8")}  # scale_fmt -> safetensors dtypes of its scales
E8M0_NAN = 255


def scale_fmt(config: dict) -> str:
    """The checkpoint's declared scale format ("float" unless its quantization_config says otherwise)."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return (qc or {}).get("scale_fmt") or "float"


def scale_values(s: torch.Tensor, what: str = "scales") -> torch.Tensor:
    """Exact float32 multipliers of stored scales: F32 as is, E8M0 (float8_e8m0fnu or U8 exponent bytes) as
    2^(e - 127). Raises ValueError on an E8M0 NaN (255) or any other dtype."""
    if s.dtype == torch.float32:
        return s
    if s.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"{what}: block scales must be float32 or E8M0 (float8_e8m0fnu / uint8), got {s.dtype}")
    e = s.view(torch.uint8)
    if bool((e == E8M0_NAN).any()):
        raise ValueError(f"{what}: E8M0 scale byte 255 (NaN) at {tuple(int(i) for i in (e == E8M0_NAN).nonzero()[0])}")
    return torch.exp2(e.float() - 127)


def e8m0(s: torch.Tensor) -> torch.Tensor:
    """float32 powers of two 2^-127..2^127 -> their E8M0 bytes as float8_e8m0fnu (exact; anything else refused)."""
    m, e = torch.frexp(s.float())  # s = 0.5 * 2^(e) for powers of two
    if not bool((m == 0.5).all()) or int(e.min()) - 1 < -127 or int(e.max()) - 1 > 127:
        raise ValueError("E8M0 scales must be powers of two in [2^-127, 2^127]")
    return (e - 1 + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def grid(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the scale grid of a [rows, cols] weight: ceil-div by the block on both dims."""
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def rows_of(scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
    """Tile grid [ceil(N/128), ceil(K/128)] -> one scale row per weight row [N, ceil(K/128)] (row i takes tile row
    i // 128)."""
    return scale_inv.repeat_interleave(BLOCK, dim=0)[:rows].contiguous()


def dequantize_rows(weight: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """Exact float32 [N, K] from weight e4m3 [N, K] and per-row column-tile scales [N, ceil(K/128)]."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or row_scale.dtype != torch.float32:
        raise ValueError(f"block FP8 dtypes must be float8_e4m3fn / float32, got {weight.dtype} / {row_scale.dtype}")
    if row_scale.shape != (n, math.ceil(k / BLOCK)):
        raise ValueError(f"block FP8 row scales {tuple(row_scale.shape)} do not fit weight {(n, k)}")
    return weight.float() * row_scale.repeat_interleave(BLOCK, dim=1)[:, :k]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Exact float32 [N, K] from weight e4m3 [N, K] and the tile grid weight_scale_inv [ceil(N/128), ceil(K/128)]
    (float32 or E8M0)."""
    scale_inv = scale_values(scale_inv, "weight_scale_inv")
    if scale_inv.shape != grid(*weight.shape):
        raise ValueError(f"block FP8 weight_scale_inv {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)}: want {list(grid(*weight.shape))}")
    return dequantize_rows(weight, rows_of(scale_inv, weight.shape[0]))


def quantize(w: torch.Tensor, round_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (weight e4m3 [N, K], weight_scale_inv f32 [ceil(N/128), ceil(K/128)]).

    Zero-pad to whole tiles, per tile `s = max(amax, 1e-12) / 448`, `q = clamp(W / s, +-448)` cast with round to
    nearest even, crop. `round_scale(s) >= s` (a map on the [ceil(N/128), ceil(K/128)] float32 scale grid) may
    replace the scales by larger values, which is always valid: the codes just use less of the e4m3 range."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantize needs a 2-D weight, got {tuple(w.shape)}")
    n, k = w.shape
    gr, gc = grid(n, k)
    padded = torch.zeros(gr * BLOCK, gc * BLOCK, dtype=torch.float32)
    padded[:n, :k] = w.detach().float()
    tiles = padded.view(gr, BLOCK, gc, BLOCK)
    s = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / E4M3_MAX  # [gr, gc]
    if round_scale is not None:
        s = round_scale(s).float()
    q = (tiles / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(gr * BLOCK, gc * BLOCK)[:n, :k].contiguous(), s.contiguous()
