"""Rows of a quantized dense linear dequantized into the compute dtype in one pass: what a kept-quantized `Linear`
multiplies by when a call has more rows of x than the dequantizing GEMV takes (prefill chunks, big decode batches).

The values are the exact dequantization of `ft.formats.quant` (`nvfp4.dequantize`, `fp8.dequantize`: every product in
fp32, the same operands in the same order), rounded once to the output dtype, so `dequantize_rows(...)` equals
`dequantize(...).to(dtype)` bit for bit. E2M1 codes and e4m3 bytes become fp16 bit patterns by shifts (as in
`nvfp4_gemv._e2m1_pair` and `dense_quant`'s fp8 rows: the E2M1 value x 2^-14, the e4m3 value x 2^-8), so no arch needs
native fp8 conversions. One program converts BB stored bytes of one row: memory bound, 1 byte read for 4 (nvfp4) or 2
(fp8_row) bytes of bf16 written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BB_MAX = 1024  # stored bytes of a row per program


@triton.jit
def _f16_bits(p):
    # int32 holding an fp16 bit pattern in its low 16 bits -> that fp16 value in fp32 (exact)
    return p.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(b):
    # e4m3 bytes (int32 0..255, no NaN) -> fp32 values (exact)
    return _f16_bits(((b & 0x7F) << 7) | ((b & 0x80) << 8)) * 256.0


@triton.jit
def _e2m1(c):
    # E2M1 codes (int32 0..15) -> fp32 values (exact)
    return _f16_bits(((c & 7) << 9) | ((c & 8) << 12)) * 16384.0


@triton.jit
def _store(p, v, m):
    # fp32 v -> p's dtype, rounded to nearest even; bf16 by hand (Triton's interpreter truncates), no NaN / inf here
    if p.dtype.element_ty == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        tl.store(p, b.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
    else:
        tl.store(p, v.to(p.dtype.element_ty), mask=m)


@triton.jit
def _nvfp4_rows_kernel(w, s, s2, out, K2, S2_PER_ROW: tl.constexpr, BB: tl.constexpr):
    # w u8 [rows, K2] (element 2j in the low nibble of byte j), s u8 [rows, K2 / 8] (e4m3), s2 f32 [] or [rows]
    # -> out [rows, 2 * K2] = E2M1 * (f32(scale) * s2)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BB + tl.arange(0, BB)
    m = j < K2
    b = tl.load(w + r * K2 + j, mask=m, other=0).to(tl.int32)
    g = tl.load(s2 + r) if S2_PER_ROW else tl.load(s2)
    block = _e4m3(tl.load(s + r * (K2 // 8) + j // 8, mask=m, other=0).to(tl.int32)) * g
    o = out + r * 2 * K2 + 2 * j
    _store(o, _e2m1(b) * block, m)
    _store(o + 1, _e2m1(b >> 4) * block, m)


@triton.jit
def _fp8_rows_kernel(w, s, out, K, BB: tl.constexpr):
    # w u8 [rows, K] (e4m3), s f32 [rows] -> out [rows, K] = f32(w) * s
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BB + tl.arange(0, BB)
    m = j < K
    v = _e4m3(tl.load(w + r * K + j, mask=m, other=0).to(tl.int32)) * tl.load(s + r)
    _store(out + r * K + j, v, m)


def dequantize_rows(scheme: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                    weight_scale_2: torch.Tensor | None, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [r0, r1) of a stored linear (nvfp4: weight u8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 f32
    [] or [N]; fp8_row: weight e4m3 [N, K], weight_scale f32 [N]; all contiguous) -> `dtype` [r1 - r0, K]."""
    w = weight[r0:r1].view(torch.uint8)
    rows, nbytes = w.shape
    k = nbytes * 2 if scheme == "nvfp4" else nbytes
    out = torch.empty(rows, k, dtype=dtype, device=weight.device)
    if rows == 0:
        return out
    bb = min(BB_MAX, triton.next_power_of_2(nbytes))
    grid = (rows, triton.cdiv(nbytes, bb))
    if scheme == "nvfp4":
        s2 = weight_scale_2.reshape(-1)
        per_row = s2.numel() != 1
        _nvfp4_rows_kernel[grid](w, weight_scale[r0:r1].view(torch.uint8), s2[r0:r1] if per_row else s2, out,
                                 nbytes, S2_PER_ROW=per_row, BB=bb)
    elif scheme == "fp8_row":
        _fp8_rows_kernel[grid](w, weight_scale[r0:r1], out, nbytes, BB=bb)
    else:
        raise ValueError(f"dequantize_rows: unsupported scheme {scheme!r}")
    return out
