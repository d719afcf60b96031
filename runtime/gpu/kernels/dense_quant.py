"""Dequantizing GEMV for dense linears kept quantized on the GPU (`Linear(keep_quantized=True)`), for decode.

    y[t, n] = sum_i W[n, i] * x[t, i]      x [T, K] (T <= 8; bf16, fp16, fp32), W quantized [N, K] -> y [T, N]

The weight is read in its stored form and decoded in registers, so a decode step moves 1 B per weight (`fp8_row`) or
9/16 B (`nvfp4`, scales included) instead of the 2 B of a bf16 copy, and nothing is dequantized into memory. Grid
cdiv(N, R): a program takes R weight rows for every row of x (the token axis is the record axis A of
`nvfp4_gemv.rows_dot`, padded to a power of two), so the weight crosses from HBM once whatever T. Each program
reads its rows in chunks of BKW u64 words across K (one word per thread along K), each chunk's loads issued together
before its FMAs; TILES makes one chunk span the models' whole K. bf16 activations come as u64 words of four and are
reused for the R rows (fp16 / fp32 ones, e.g. test models, are loaded one at a time: correct, not tuned).

* `nvfp4`: codes u8 [N, K/2] and e4m3 scales [N, K/16], passed as one base pointer and the byte offset of the scales
  from it (`Linear` keeps them in one buffer): `rows_dot` itself, the expert kernels' decode (E2M1 x e4m3 exact, value
  x 2^-22). `weight_scale_2` (scalar or per row) times 2^22 is applied to the fp32 accumulator.
* `fp8_row`: e4m3 weights [N, K], 8 per u64 word. A u32 of four bytes gives two fp16 bit patterns per shift
  (`(b & 0x80) << 8 | (b & 0x7F) << 7` on bytes 0 and 2, then on bytes 1 and 3), each the e4m3 value x 2^-8
  (subnormals included; no NaN in weights), converted in place like the E2M1 pairs (`nvfp4_gemv.f16x2_f32`): about
  3 instructions per weight, no lookup, any arch from sm_80. The per-row fp32 scale times 2^8 is applied to the
  accumulator.
Each weight x activation product is exact in fp32; the result differs from `F.linear` on the dequantized weight by
fp32 summation order and by where the global / row scale is applied (on the accumulator instead of on each rounded
weight). PyTorch reference: `reference_linear`. Tiles (`TILES`): rows per program, words per K chunk, warps;
`tools/bench_dense.py --quantized` times them against the bf16 GEMV on the models' shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.formats.quant import fp8, nvfp4

from .nvfp4_gemv import _bf16_at, f16x2_f32, rows_dot
from .pdl import pdl_args, pdl_wait

MAX_TOKENS = 8  # rows of x one call takes (Linear.GEMV_MAX_TOKENS)
# per scheme, by the most rows of x they serve: R weight rows per program, BKW u64 words per unrolled K chunk (16
# weights a word for nvfp4, 8 for fp8_row), warps. At decode the call is latency-bound: what counts is how many loads
# are in flight and how few each thread waits on. Up to 2 rows of x, both schemes: one word of a chunk per thread, 8
# warps (R 2, fastest at T = 1 on both models' projections); above, where the activations' reuse over the R rows
# counts, R 8 (19-40 % faster than R 4 at T = 8). Sweeps: `benchmarks/dense_quant.md`. sm_90 builds without register
# spills (`tools/bench_dense.py --compile-only`).
TILES = {"nvfp4": ((2, {"R": 2, "BKW": 128, "num_warps": 8}), (MAX_TOKENS, {"R": 8, "BKW": 128, "num_warps": 8})),
         "fp8_row": ((2, {"R": 2, "BKW": 128, "num_warps": 8}), (MAX_TOKENS, {"R": 8, "BKW": 64, "num_warps": 8}))}


def tiles_for(scheme: str, T: int) -> dict:
    """The TILES entry of `scheme` for T rows of x."""
    return next(t for most, t in TILES[scheme] if T <= most)


@triton.jit
def _tokens(x, K, T, A: tl.constexpr):
    # the A (>= T) activation rows as [1, A, 1] pointers and their mask
    t = tl.arange(0, A)[None, :, None]
    return x + t.to(tl.int64) * K, t < T


@triton.jit
def _store(out, v, rows, N, T, A: tl.constexpr):
    # v fp32 [R, A] -> out[t, rows] in out's dtype
    t = tl.arange(0, A)[None, :]
    r = rows[:, None]
    tl.store(out + t.to(tl.int64) * N + r, v.to(out.dtype.element_ty), mask=(r < N) & (t < T))


@triton.jit
def _nvfp4_gemv_kernel(w, OFF_S, s2, x, out, N, T, KB: tl.constexpr, S2_PER_ROW: tl.constexpr,
                       R: tl.constexpr, A: tl.constexpr, BKW: tl.constexpr, ASM: tl.constexpr, XBF16: tl.constexpr,
                       PDL: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    if S2_PER_ROW:  # weights are not written by earlier kernels: loaded before the wait, with the codes' round trip
        scale = tl.load(s2 + rows, mask=rows < N, other=0.0)[:, None]
    else:
        scale = tl.load(s2)
    pdl_wait(PDL)
    xrow, x_mask = _tokens(x, 16 * KB, T, A)
    v = rows_dot(w, 0, OFF_S, rows[:, None, None], (rows < N)[:, None, None], xrow, x_mask, KB, R, A, BKW,
                 ASM, XBF16=XBF16)  # [R, A], value * 2^-22
    _store(out, v * (scale * 4194304.0), rows, N, T, A)


@triton.jit
def _e4m3_pair(w, J: tl.constexpr, ASM: tl.constexpr):
    # w u32 (4 e4m3 bytes) -> fp32 (byte J, byte J + 2), each the e4m3 value * 2^-8
    s = w >> (8 * J)
    return f16x2_f32(((s & 0x800080) << 8) | ((s & 0x7F007F) << 7), ASM)


@triton.jit
def _fp8_rows_gemv_kernel(w, scale, x, out, N, T, KW: tl.constexpr, R: tl.constexpr, A: tl.constexpr,
                     BKW: tl.constexpr, ASM: tl.constexpr, XBF16: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    s = tl.load(scale + rows, mask=rows < N, other=0.0) * 256.0  # a weight: read before the wait
    pdl_wait(PDL)
    xrow, x_mask = _tokens(x, 8 * KW, T, A)
    kw = tl.max_contiguous(tl.arange(0, BKW), 1)[None, None, :]  # one word per thread along K (rows_dot's layout)
    wp = w.to(tl.pointer_type(tl.uint64)) + rows[:, None, None].to(tl.int64) * KW  # row: KW words of 8 weights
    xw = xrow.to(tl.pointer_type(tl.uint64))  # XBF16: 2 u64 (8 bf16) of activations per word of weights
    r_live = (rows < N)[:, None, None]
    acc = tl.zeros([R, A, BKW], dtype=tl.float32)
    for k0 in tl.static_range(0, KW, BKW):
        in_k = (k0 + kw) < KW
        words = tl.load(wp + (k0 + kw), mask=r_live & in_k, other=0)  # [R, 1, BKW]
        lo, hi = words.to(tl.uint32), (words >> 32).to(tl.uint32)  # weights 0..3, 4..7
        xm = x_mask & in_k
        if XBF16:
            x0 = tl.load(xw + 2 * (k0 + kw), mask=xm, other=0)  # activations 0..3 of the word
            x1 = tl.load(xw + 2 * (k0 + kw) + 1, mask=xm, other=0)  # 4..7
            x0l, x0h = x0.to(tl.uint32), (x0 >> 32).to(tl.uint32)
            x1l, x1h = x1.to(tl.uint32), (x1 >> 32).to(tl.uint32)
            for j in tl.static_range(2):  # weights j, j + 2 of each u32
                a, b = _e4m3_pair(lo, j, ASM)
                c, d = _e4m3_pair(hi, j, ASM)
                acc += a * _bf16_at(x0l, x0h, j) + b * _bf16_at(x0l, x0h, j + 2)
                acc += c * _bf16_at(x1l, x1h, j) + d * _bf16_at(x1l, x1h, j + 2)
        else:  # fp16 / fp32 activations, one load each
            xe = xrow + 8 * (k0 + kw)
            for j in tl.static_range(2):
                a, b = _e4m3_pair(lo, j, ASM)
                c, d = _e4m3_pair(hi, j, ASM)
                acc += a * tl.load(xe + j, mask=xm, other=0).to(tl.float32)
                acc += b * tl.load(xe + j + 2, mask=xm, other=0).to(tl.float32)
                acc += c * tl.load(xe + j + 4, mask=xm, other=0).to(tl.float32)
                acc += d * tl.load(xe + j + 6, mask=xm, other=0).to(tl.float32)
    _store(out, tl.sum(acc, axis=2) * s[:, None], rows, N, T, A)


X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # bf16: read as u64 words of four; the others one by one


def supported(scheme: str, k: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `quantized_gemv` takes a call with in_features k (whole u64 words of weights and scale blocks per row)
    and activations of `dtype`."""
    return dtype in X_DTYPES and k % 16 == 0 and scheme in TILES


def launch_consts(scheme: str, K: int, T: int, tiles: dict | None = None) -> dict:
    """The constexprs of a call with in_features K and T rows of x: the tile (`tiles_for`, updated by `tiles`), the
    token axis A, the words per row (KB for nvfp4, KW for fp8_row) and per unrolled chunk (BKW), and num_warps: the
    tile's, or, unless `tiles` names it, fewer where a chunk is narrow: down to one word of the R rows' chunk per
    thread (more words a thread wait on more loads each: `benchmarks/dense_quant.md`), so a short K does not leave
    threads holding copies."""
    tile = {**tiles_for(scheme, T), **(tiles or {})}
    words = K // 16 if scheme == "nvfp4" else K // 8
    bkw = min(tile["BKW"], triton.next_power_of_2(words))
    warps = tile["num_warps"]
    if "num_warps" not in (tiles or {}):
        warps = min(warps, max(1, tile["R"] * bkw // 32))
    return {"R": tile["R"], "A": triton.next_power_of_2(T), "BKW": bkw, "KB" if scheme == "nvfp4" else "KW": words,
            "num_warps": warps}


def quantized_gemv(scheme: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor | None, *, tiles: dict | None = None) -> torch.Tensor:
    """x bf16 [T, K] (contiguous, T <= MAX_TOKENS) -> bf16 [T, N]. nvfp4: weight u8 [N, K/2] and weight_scale e4m3
    [N, K/16] in one allocation (any order), weight_scale_2 f32 scalar or [N]; fp8_row: weight e4m3 [N, K],
    weight_scale f32 [N]. tiles: overrides of `tiles_for(scheme, T)` (benchmarks)."""
    T, K = x.shape
    N = weight.shape[0]
    if not supported(scheme, K, x.dtype) or T > MAX_TOKENS:
        raise ValueError(f"no {scheme} GEMV for x {x.dtype} [{T}, {K}]: bf16, fp16 or fp32 activations, in_features "
                         f"a multiple of 16 and at most {MAX_TOKENS} rows are needed")
    if weight.data_ptr() % 16:
        raise ValueError("the quantized weight must start 16-byte aligned (it is read as u64 words)")
    x = x.contiguous()
    if x.data_ptr() % 16:  # activations are read as u64 words
        x = x.clone()
    meta = launch_consts(scheme, K, T, tiles)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, meta["R"]),)
    meta.update(ASM=x.device.type == "cuda", XBF16=x.dtype == torch.bfloat16, **pdl_args(x.device))
    if scheme == "nvfp4":
        if weight.shape[1] * 2 != K:
            raise ValueError(f"NVFP4 weight [{N}, {weight.shape[1]}] does not match in_features {K}")
        codes = weight.view(torch.uint8)
        off_s = weight_scale.data_ptr() - codes.data_ptr()
        _nvfp4_gemv_kernel[grid](codes, off_s, weight_scale_2.reshape(-1), x, out, N, T,
                                 S2_PER_ROW=weight_scale_2.numel() != 1, **meta)
    else:
        if weight.shape[1] != K:
            raise ValueError(f"FP8 weight [{N}, {weight.shape[1]}] does not match in_features {K}")
        _fp8_rows_gemv_kernel[grid](weight.view(torch.uint8), weight_scale, x, out, N, T, **meta)
    return out


def reference_linear(scheme: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor | None) -> torch.Tensor:
    """fp32 x @ dequantize(W).T: what `quantized_gemv` computes, up to summation order."""
    if scheme == "nvfp4":
        w = nvfp4.dequantize(weight, weight_scale, weight_scale_2)
    else:
        w = fp8.dequantize(weight, weight_scale)
    return x.float() @ w.t()
