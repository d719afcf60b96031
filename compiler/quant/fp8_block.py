"""Block-scaled FP8 (e4m3fn, 128x128 tiles) as DeepSeek-V3, Qwen3-*-FP8 and GLM-*-FP8 releases store it.

A linear `W [N, K]` is `weight` float8_e4m3fn [N, K] plus `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)], which
despite its name is the dequantization MULTIPLIER of each tile (ragged last tiles included):

    W[i, j] = float32(weight[i, j]) * weight_scale_inv[i // 128, j // 128]

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
    """Exact float32 [N, K] from weight e4m3 [N, K] and the tile grid weight_scale_inv [ceil(N/128), ceil(K/128)]."""
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
