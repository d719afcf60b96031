"""Skinny GEMM for plain (bf16 / fp16) dense linears at decode: one Triton launch that streams the weight once.

  dense_gemv(x [T, K], weight [N, K], bias [N] | None) -> y [T, N] in x.dtype,   T <= MAX_TOKENS
  y = cast(x · weightᵀ + bias): products and sums in fp32, bias added to the fp32 sum, one rounding to x.dtype, so
  y equals `dense_gemv_ref` (and `F.linear`, which also rounds its fp32 result once) up to fp32 summation order.

At decode the weight is the traffic (N K elements against T K for x and T N for y), and cuBLAS's skinny-GEMM
kernels reach well under HBM speed on it. Kernel (grid cdiv(N, BLOCK_N), a function of shapes only: no host syncs
and no allocation but the output, so it can be captured in a CUDA graph):
  program i owns weight rows [i BLOCK_N, (i + 1) BLOCK_N) and loops over K in BLOCK_K steps against all T rows of x
  (tiny, served from L2), so every weight byte is read exactly once; the [T, BLOCK_N] result is stored directly.
  No split-K: at the target models' K <= 4096 a program's rows are a few BLOCK_K steps (FMA: BLOCK_N down to 1,
  one round of loads for N = 64), and a weight too small to fill PROGRAMS programs (N < 2112 under DOT) is <= 4 MB,
  whose time is the launch and a few HBM latencies; split-K's zeroed fp32 buffer or counter, atomics and separate
  cast would add about as much as it hides. x is re-read from L2 by every program: T / BLOCK_N of the weight bytes.
Two inner products, chosen by T and N (`TILES`, from tools/bench_dense.py's sweep on the H200):
  * FMA: an fp32 [BLOCK_T, BLOCK_N, BLOCK_K] accumulator of x ⊙ w, reduced over K once at the end (as
    `router._router_kernel`); acc_elems caps it (BLOCK_K shrinks as T or BLOCK_N grow). T FMAs per weight element.
    Wins where the weight is small (T <= 2: N < 8192; larger T: N <= 256): many small programs, no pipeline to fill.
  * DOT (larger T, or a large N: the FMA accumulator grows with T, and plain loads are not pipelined): tl.dot of the
    weight tile [BLOCK_N, BLOCK_K] with xᵀ [BLOCK_K, BLOCK_T] on the tensor cores, fp32 accumulation, tiles
    cp.async-pipelined through shared memory; fp32 inputs use input_precision "ieee" (no TF32).
    Triton's interpreter multiplies bf16 dot operands as raw bits, so there (UPCAST) the tiles go to fp32 first:
    bf16 / fp16 products are exact in fp32 either way.
Block sizes (`launch_tiles`): FMA BLOCK_N = rows_x_tokens / BLOCK_T (at least 1), so the accumulator stays small;
DOT BLOCK_N the largest power of two in [min_block_n, max_block_n] that leaves >= PROGRAMS (2 per SM of an H200)
programs, else min_block_n, and BLOCK_K = tile_elems / BLOCK_N but at most a min_k_steps-th of K (a pipeline of at
least that many K steps). Invariants: weight [N, K] contiguous in x's dtype, bias [N] contiguous; x [T, K] with a
unit last stride (rows may be strided; otherwise it is copied). Under the interpreter (CPU tensors, tests) the bf16
rounding is done on the bits (`fused_ops._cast`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.fused_ops import _cast, _rne_bits
from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_wait

MAX_TOKENS = 16
PROGRAMS = 264  # 2 x the H200's 132 SMs: enough programs that every SM streams weight rows
# dot_from_n: per token count (the first key >= T), the N from which DOT runs. DOT num_warps 1: one warp per 16
# weight rows of the MMA, and BLOCK_N <= 16. Swept by tools/bench_dense.py (H200, T = 1 and 8, the projections of
# both target models and their LM heads): e.g. T = 1 in_proj_qkvz [12288, 2048] 16.6 -> 14.6 us, the Qwen3.6 LM head
# [248320, 2048] 250 -> 227 us (98 % of the HBM read rate), qkv_proj [5120, 2048] 8.5 -> 7.9 us.
TILES = {"dot_from_n": {2: 8192, MAX_TOKENS: 257},
         "fma": {"rows_x_tokens": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 2, "acc_elems": 16384},
         "dot": {"min_block_n": 8, "max_block_n": 16, "tile_elems": 2048, "min_k_steps": 4, "num_warps": 1,
                 "num_stages": 4}}


@triton.jit
def fma_rows(wrow, rm, x, sx, t, tm, K, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # fp32 [BT, BR] = x[t] · w[row]ᵀ for row pointers wrow [BR] (mask rm) and token rows t [BT] (mask tm) of x (row
    # stride sx), over K: an fp32 [BT, BR, BK] accumulator of products, reduced over K once at the end
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_R, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        km = k < K
        wv = tl.load(wrow[:, None] + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)      # [BR, BK]
        xv = tl.load(x + t[:, None] * sx + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)  # [BT, BK]
        acc += xv.to(tl.float32)[:, None, :] * wv.to(tl.float32)[None, :, :]
    return tl.sum(acc, axis=2)


@triton.jit
def _dense_gemv_kernel(x, sx, w, b, out, T, N, K, HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, RNE_BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BN] weight rows = output columns
    nm = n < N
    t = tl.arange(0, BLOCK_T)                                                     # [BT] token rows
    tm = t < T
    wrow = w + n.to(tl.int64) * K                                                 # [BN] row pointers
    if DOT:
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            km = k < K
            wv = tl.load(wrow[:, None] + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)      # [BN, BK]
            xv = tl.load(x + t[:, None] * sx + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)  # [BT, BK]
            if UPCAST:
                wv, xv = wv.to(tl.float32), xv.to(tl.float32)
            acc = tl.dot(wv, tl.trans(xv), acc, input_precision=PRECISION)       # [BN, BT]
        y = tl.trans(acc)                                                         # [BT, BN]
    else:
        y = fma_rows(wrow, nm, x, sx, t, tm, K, BLOCK_T, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        y += tl.load(b + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out + t[:, None] * N + n[None, :], _cast(y, out.dtype.element_ty, RNE_BITS),
             mask=tm[:, None] & nm[None, :])


def launch_tiles(N: int, K: int, T: int, tiles: dict | None = None) -> dict:
    """{DOT, BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages} as launched for x [T, K] · [N, K]ᵀ (module docstring):
    TILES' choice, with the entries of `tiles` over it (benchmark sweeps: DOT, BLOCK_N, BLOCK_K, num_warps,
    num_stages, acc_elems; a num_warps of 0 keeps TILES'). BLOCK_K at least 16 and at most next_power_of_2(K)."""
    over = tiles or {}
    dot = bool(over.get("DOT", N >= next(n0 for t, n0 in sorted(TILES["dot_from_n"].items()) if T <= t)))
    kp2 = triton.next_power_of_2(K)
    if dot:
        t = {**TILES["dot"], **over}
        block_t = max(8, triton.next_power_of_2(T))  # the MMA's smallest N
        block_n = t.get("BLOCK_N")
        if block_n is None:
            block_n = t["max_block_n"]
            while block_n > t["min_block_n"] and triton.cdiv(N, block_n) < PROGRAMS:
                block_n //= 2
        block_k = t.get("BLOCK_K") or max(16, min(t["tile_elems"] // block_n, kp2 // t["min_k_steps"]))
    else:
        t = {**TILES["fma"], **over}
        block_t = triton.next_power_of_2(T)
        block_n = t.get("BLOCK_N") or max(1, t["rows_x_tokens"] // block_t)
        block_k = min(t["BLOCK_K"], t["acc_elems"] // (block_t * block_n))
    warps = t.get("num_warps") or TILES["dot" if dot else "fma"]["num_warps"]
    return {"DOT": dot, "BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_K": max(16, min(block_k, kp2)),
            "num_warps": warps, "num_stages": t["num_stages"]}


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               tiles: dict | None = None) -> torch.Tensor:
    """x [T, K] (T <= MAX_TOKENS), weight [N, K] contiguous in x's dtype, bias [N] or None -> [T, N] in x.dtype
    (module docstring). `tiles` overrides entries of TILES' choice (benchmark sweeps; `launch_tiles`)."""
    T, K = x.shape
    N = weight.shape[0]
    if weight.shape != (N, K) or weight.dtype != x.dtype or not weight.is_contiguous() or T > MAX_TOKENS:
        raise ValueError(f"dense_gemv: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} "
                         f"(contiguous: {weight.is_contiguous()}); wants T <= {MAX_TOKENS}, weight [N, K] contiguous")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"dense_gemv: bias {tuple(bias.shape)}, wants ({N},) contiguous")
    x = x if x.stride(1) == 1 or K == 1 else x.contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    t = launch_tiles(N, K, T, tiles)
    upcast = x.device.type != "cuda"     # the interpreter: fp32 dot operands (module docstring)
    _dense_gemv_kernel[(triton.cdiv(N, t["BLOCK_N"]),)](
        x, x.stride(0), weight, weight if bias is None else bias, out, T, N, K, HAS_BIAS=bias is not None,
        DOT=t["DOT"], PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        RNE_BITS=_rne_bits(x), BLOCK_T=t["BLOCK_T"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
        num_warps=t["num_warps"], num_stages=t["num_stages"], **pdl_args(x.device))
    return out


def dense_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `dense_gemv` computes, up to fp32 summation order: fp32 x · weightᵀ (+ bias), rounded once to x.dtype."""
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
