"""Tensor-core product of a few rows of x with a dense linear kept quantized, for decode batches of several sequences,
where the dequantizing GEMV (`dense_quant.py`) spends up to 8 CUDA-core FMAs and their activation unpacking on every
weight (qwen3.6's fp8_row projections at T = 8: 3.3x their T = 1 time).

    y[t, n] = sum_i W[n, i] * x[t, i]      x bf16 [T, K] (T <= MAX_TOKENS), W quantized [N, K] -> y bf16 [T, N]

Grid cdiv(N, BN): a program owns BN weight rows. Per K chunk of BK it loads the stored bytes of its rows ([BN, BK]
e4m3 bytes, or [BN, BK/2] E2M1 code pairs and their [BN, BK/16] e4m3 block scales), decodes them by shifts into
their exact values (`dense_dequant`'s `_e4m3` / `_e2m1`: no arch needs native fp8 conversions), and accumulates
`tl.dot(x [BT, BK], W^T [BK, BN])` in fp32 on the tensor cores, x padded to BT = 16 rows. A decoded weight is exact
in bf16: an e4m3 value has 4 significant bits, an E2M1 value times its e4m3 block scale at most 6, within bf16's 8
(and far inside its exponent range). The row scale (fp8_row) or `weight_scale_2` (nvfp4, scalar or per row)
multiplies the accumulator. So the result differs from `dense_quant.reference_linear` (fp32 x @ the exact
dequantization) only by fp32 summation order and the final rounding to bf16, as the GEMV's does. Tiles: `TILES`;
`tools/bench_dense.py --mma` times them beside the GEMV.

Where it runs (`Linear`, from `rows_from`): the GEMV's CUDA-core work grows with rows x weights, the tensor cores'
does not, but a program walks all of K serially, so this kernel has a floor whatever the shape. So it takes a call
once rows x N x K reaches MIN_WORK (which shapes take it from how many rows: `benchmarks/dense_quant.md`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dense_dequant import _e2m1, _e4m3
from .pdl import pdl_args, pdl_wait

MAX_TOKENS = 16  # rows of x one call takes: tl.dot's smallest M
# rows x weights from which a call runs here rather than in the GEMV (module doc); the NVFP4 GEMV spends less per
# weight than the fp8_row one (geom's o_proj at 8 rows: 19.1 us against out_proj's 22.6, both 8.4M weights)
MIN_WORK = {"nvfp4": 70_000_000, "fp8_row": 46_000_000}
# BN weight rows per program, BK weights of K per chunk, warps: BN 32 was fastest on 4 of the 5 projections timed on
# an H100 (more programs for N of 2-12k), within 5 % of BN 64 / BK 64 on a 248k-row lm_head; sm_80 / 90 / 120 build
# these without spills
TILES = {"nvfp4": {"BN": 32, "BK": 128, "num_warps": 4}, "fp8_row": {"BN": 32, "BK": 128, "num_warps": 4}}


def rows_from(scheme: str, n: int, k: int) -> int | None:
    """The fewest rows of x (>= 2) from which an [n, k] linear of `scheme` runs here, or None if never."""
    if scheme not in TILES or k % 16:
        return None
    rows = max(2, -(-MIN_WORK[scheme] // (n * k)))
    return rows if rows <= MAX_TOKENS else None


@triton.jit
def _mma_kernel(w, OFF_S, scale, x, out, N, T, K, NVFP4: tl.constexpr, S2_PER_ROW: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, BT: tl.constexpr, TC: tl.constexpr, PDL: tl.constexpr):
    # w u8: fp8_row [N, K]; nvfp4 [N, K/2] codes, the e4m3 scales [N, K/16] at byte offset OFF_S from w.
    # scale f32: fp8_row [N]; nvfp4 weight_scale_2, [] or [N] (S2_PER_ROW). TC: bf16 operands (tensor cores); off,
    # fp32 ones (Triton's interpreter multiplies bf16 operands' bit patterns), the same values
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    live = rows < N
    r64 = rows[:, None].to(tl.int64)
    if S2_PER_ROW:  # weights are not written by earlier kernels: loaded before the wait
        s = tl.load(scale + rows, mask=live, other=0.0)[None, :]
    else:
        s = tl.load(scale)
    pdl_wait(PDL)
    t = tl.arange(0, BT)[:, None]
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)[None, :]
        xt = tl.load(x + t.to(tl.int64) * K + k, mask=(t < T) & (k < K), other=0.0)  # [BT, BK]
        if NVFP4:
            j = k0 // 2 + tl.arange(0, BK // 2)[None, :]  # byte j: elements 2j (low nibble) and 2j + 1
            b = tl.load(w + r64 * (K // 2) + j, mask=live[:, None] & (j < K // 2), other=0).to(tl.int32)
            v = tl.join(_e2m1(b & 15), _e2m1(b >> 4)).reshape([BN, BK])
            g = k0 // 16 + tl.arange(0, BK // 16)[None, :]
            sb = tl.load(w + OFF_S + r64 * (K // 16) + g, mask=live[:, None] & (g < K // 16), other=0).to(tl.int32)
            v = (v.reshape([BN, BK // 16, 16]) * _e4m3(sb)[:, :, None]).reshape([BN, BK])
        else:
            b = tl.load(w + r64 * K + k, mask=live[:, None] & (k < K), other=0).to(tl.int32)
            v = _e4m3(b)
        if TC:
            acc += tl.dot(xt, tl.trans(v.to(tl.bfloat16)))
        else:
            acc += tl.dot(xt.to(tl.float32), tl.trans(v))
    tl.store(out + t.to(tl.int64) * N + rows[None, :], (acc * s).to(out.dtype.element_ty),
             mask=(t < T) & live[None, :])


def supported(scheme: str, k: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `quantized_mma` takes a call with in_features k and activations of `dtype` (bf16 only: the tensor
    cores multiply bf16, and fp16 / fp32 activations would be rounded)."""
    return dtype == torch.bfloat16 and k % 16 == 0 and scheme in TILES


def quantized_mma(scheme: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  weight_scale_2: torch.Tensor | None, *, tiles: dict | None = None) -> torch.Tensor:
    """x bf16 [T, K] (T <= MAX_TOKENS) -> bf16 [T, N]; the weights as `dense_quant.quantized_gemv` takes them (nvfp4:
    codes u8 [N, K/2] and e4m3 scales [N, K/16] in one allocation, weight_scale_2 f32 [] or [N]; fp8_row: e4m3 [N,
    K], weight_scale f32 [N]). tiles: overrides of TILES[scheme] (benchmarks)."""
    T, K = x.shape
    N = weight.shape[0]
    if not supported(scheme, K, x.dtype) or not 0 < T <= MAX_TOKENS:
        raise ValueError(f"no {scheme} tensor-core product for x {x.dtype} [{T}, {K}]: bf16 activations, in_features "
                         f"a multiple of 16 and 1 to {MAX_TOKENS} rows are needed")
    meta = {**TILES[scheme], **(tiles or {})}
    # BK >= 64 whatever K (masked): at BK 16 the NVFP4 decode's join / reshape came out of the H100's tensor-core
    # product doubled (Triton 3.6; the interpreter was exact), at 64 and 128 every code is exact
    meta["BK"] = min(meta["BK"], max(64, triton.next_power_of_2(K)))
    x = x.contiguous()
    if x.data_ptr() % 16:  # one pointer specialization, the one `ft kernels build` compiles (as the GEMV does)
        x = x.clone()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, meta["BN"]),)
    if scheme == "nvfp4":
        if weight.shape[1] * 2 != K:
            raise ValueError(f"NVFP4 weight [{N}, {weight.shape[1]}] does not match in_features {K}")
        codes = weight.view(torch.uint8)
        s2 = weight_scale_2.reshape(-1)
        _mma_kernel[grid](codes, weight_scale.data_ptr() - codes.data_ptr(), s2, x, out, N, T, K, NVFP4=True,
                          S2_PER_ROW=s2.numel() != 1, BT=MAX_TOKENS, TC=x.is_cuda, **meta, **pdl_args(x.device))
    else:
        if weight.shape[1] != K:
            raise ValueError(f"FP8 weight [{N}, {weight.shape[1]}] does not match in_features {K}")
        _mma_kernel[grid](weight.view(torch.uint8), 0, weight_scale, x, out, N, T, K, NVFP4=False, S2_PER_ROW=True,
                          BT=MAX_TOKENS, TC=x.is_cuda, **meta, **pdl_args(x.device))
    return out
