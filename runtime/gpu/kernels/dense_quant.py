"""Dequantizing GEMV for dense linears kept quantized on the GPU (`Linear(keep_quantized=True)`), for decode.

    y[t, n] = sum_i W[n, i] * x[t, i]      x [T, K] (T small), W quantized [N, K] -> y [T, N] in x's dtype

The weight is read in its stored form and decoded in registers, so a decode step moves 1 B per weight (`fp8_row`) or
9/16 B (`nvfp4`, scales included) instead of the 2 B of a bf16 copy, and nothing is dequantized into memory. One
program handles one row of x and BLOCK_N weight rows; programs of the same weight rows are adjacent in the grid, so
for a few rows of x the weight comes from DRAM about once. Larger T (prefill, `Linear.GEMV_MAX_TOKENS`) goes to
`Linear`'s chunked PyTorch dequantization, where the matmul dominates.

* `nvfp4`: codes u8 [N, K/2] and e4m3 scales [N, K/16] are decoded exactly as in the NVFP4 expert kernels
  (`nvfp4_triton._weight_tile`: E2M1 x e4m3 is exact in bf16, value x 2^-22), `weight_scale_2` (scalar or per row)
  times 2^22 is applied to the fp32 accumulator. The two tensors are passed as one base pointer and the byte offset
  of the scales from it (`Linear` keeps them in one buffer).
* `fp8_row`: e4m3 weights decoded from bits (value x 2^-8, exact in fp32), the per-row fp32 scale times 2^8 applied
  to the accumulator.
Each weight x activation product is exact in fp32; the result differs from `F.linear` on the dequantized weight by
fp32 summation order and by where the global/row scale is applied (on the accumulator instead of on each rounded
weight). PyTorch reference: `reference_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.formats.quant import fp8, nvfp4

from .nvfp4_decode import _gemv_tile
from .fp4_format import _e4m3_shifted
from .pdl import pdl_args, pdl_wait

BLOCK_N = 32


@triton.jit
def _nvfp4_gemv_kernel(w, OFF_S, s2, x, out, N, K, S2_PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < N
    acc = _gemv_tile(w, 0, OFF_S, rows, mask, x + t.to(tl.int64) * K, K, BLOCK_N, BLOCK_K)
    if S2_PER_ROW:
        scale = tl.load(s2 + rows, mask=mask, other=0.0)
    else:
        scale = tl.load(s2)
    tl.store(out + t.to(tl.int64) * N + rows, (acc * (scale * 4194304.0)).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_rows_gemv_kernel(w, scale, x, out, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + kk < K
        xv = tl.load(x + t.to(tl.int64) * K + k0 + kk, mask=k_mask, other=0.0).to(tl.float32)
        b = tl.load(w + rows[:, None].to(tl.int64) * K + (k0 + kk)[None, :], mask=mask[:, None] & k_mask[None, :],
                    other=0)
        acc += tl.sum(_e4m3_shifted(b.to(tl.uint16)) * xv[None, :], axis=1)
    s = tl.load(scale + rows, mask=mask, other=0.0) * 256.0
    tl.store(out + t.to(tl.int64) * N + rows, (acc * s).to(out.dtype.element_ty), mask=mask)


def nvfp4_block_k(k: int) -> int | None:
    """The K tile of the NVFP4 GEMV for in_features k (a power of two in 32..128 dividing k), None if none does."""
    return next((b for b in (128, 64, 32) if k % b == 0), None)


def supported(scheme: str, k: int) -> bool:
    return scheme == "fp8_row" or (scheme == "nvfp4" and nvfp4_block_k(k) is not None)


def quantized_gemv(scheme: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] (contiguous) -> [T, N]. nvfp4: weight u8 [N, K/2] and weight_scale e4m3 [N, K/16] in one allocation
    (any order), weight_scale_2 f32 scalar or [N]; fp8_row: weight e4m3 [N, K], weight_scale f32 [N]."""
    T, K = x.shape
    N = weight.shape[0]
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    grid = (T, triton.cdiv(N, BLOCK_N))
    if scheme == "nvfp4":
        block_k = nvfp4_block_k(K)
        if block_k is None or weight.shape[1] * 2 != K:
            raise ValueError(f"NVFP4 GEMV needs in_features divisible by 32 matching the weight, got K={K}")
        codes = weight.view(torch.uint8)
        off_s = weight_scale.data_ptr() - codes.data_ptr()
        per_row = weight_scale_2.numel() != 1
        _nvfp4_gemv_kernel[grid](codes, off_s, weight_scale_2.reshape(-1), x, out, N, K, S2_PER_ROW=per_row,
                                 BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=4, **pdl_args(x.device))
    elif scheme == "fp8_row":
        _fp8_rows_gemv_kernel[grid](weight.view(torch.uint8), weight_scale, x, out, N, K, BLOCK_N=BLOCK_N,
                                    BLOCK_K=128, num_warps=4, **pdl_args(x.device))
    else:
        raise ValueError(f"no GEMV for scheme {scheme!r}")
    return out


def reference_linear(scheme: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor | None) -> torch.Tensor:
    """fp32 x @ dequantize(W).T: what `quantized_gemv` computes, up to summation order."""
    if scheme == "nvfp4":
        w = nvfp4.dequantize(weight, weight_scale, weight_scale_2)
    else:
        w = fp8.dequantize(weight, weight_scale)
    return x.float() @ w.t()
