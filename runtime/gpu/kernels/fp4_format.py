"""Decoding FP4 expert records in Triton registers, and the epilogue every expert kernel shares.

From bits, with no lookup table in memory:
* E2M1 nibble `s eee` -> fp16 bits `s 0 0 e e e 0...` equals the E2M1 value times 2^-14 (subnormal 0.5 included);
* a block scale -> its value times 2^-8: an e4m3 byte `s eeee mmm` through fp16 bits `s 0 eeee mmm 0...` (NVFP4),
  an E8M0 byte b (MXFP4, 2^(b - 127)) as the fp32 bits of 2^(b - 135).
So a weight is decoded as value * 2^-22 in every format, and the kernels undo the shift once on the fp32 accumulator
(`_row_scale`: times 2^22, times the row's scale_2 for NVFP4), add the row's bias where the format has one
(`_row_bias`), and apply the expert's activation (`_gated`: silu, gpt_oss's clamped SwiGLU, or deepseek_v4's
clamped silu). Which variant runs is a constexpr from `RecordLayout.kernel_args`, so every model compiles its own
kernels without per-call branching.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1_shifted(nib):
    # nib: uint16 in [0, 16) -> fp32 E2M1 value * 2^-14
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_shifted(b):
    # b: uint16 e4m3 byte -> fp32 e4m3 value * 2^-8 (NaN encodings never occur in scales)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_shifted(b, E8M0: tl.constexpr):
    # b: uint16 block-scale byte -> fp32 scale * 2^-8: e4m3 (NVFP4), or E8M0 (MXFP4: 2^(b - 127), so 2^(b - 135),
    # built from its bits, subnormal for b < 9; exact for every byte but 255, the format's NaN, which never occurs)
    if E8M0:
        e = b.to(tl.uint32)
        bits = tl.where(e >= 9, (e - 8) << 23, 1 << (tl.minimum(e, 8) + 14))
        s = bits.to(tl.float32, bitcast=True)
    else:
        s = _e4m3_shifted(b)
    return s


@triton.jit
def _gated(g, u, SWIGLU: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    # the expert's activation of fp32 g, u (record_layout): the clamped SwiGLU of gpt_oss, or silu(g) * u with g, u
    # first clamped at LIMIT when it is > 0 (deepseek_v4's clamped_silu)
    if SWIGLU:
        gc = tl.minimum(g, LIMIT)
        uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        a = (uc + 1.0) * (gc / (1.0 + tl.exp(-ALPHA * gc)))
    elif LIMIT > 0:
        gc = tl.minimum(g, LIMIT)
        uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        a = gc / (1.0 + tl.exp(-gc)) * uc
    else:
        a = g / (1.0 + tl.exp(-g)) * u
    return a


@triton.jit
def _row_scale(rec, OFF_S2, rows, mask, S2: tl.constexpr):
    # the factor on the fp32 accumulator of rows `rows`: scale_2[row] * 2^22 (NVFP4) or 2^22 (no second-level scale);
    # the 2^22 undoes the E2M1 (2^-14) and block-scale (2^-8) shifts
    if S2:
        f = tl.load((rec + OFF_S2).to(tl.pointer_type(tl.float32)) + rows, mask=mask, other=0.0) * 4194304.0
    else:
        f = tl.where(mask, 4194304.0, 0.0)
    return f


@triton.jit
def _row_bias(rec, OFF_B, rows, mask, BIAS: tl.constexpr):
    # fp32 bias of rows `rows` (0 without biases, or where masked)
    if BIAS:
        b = tl.load((rec + OFF_B).to(tl.pointer_type(tl.float32)) + rows, mask=mask, other=0.0)
    else:
        b = tl.where(mask, 0.0, 0.0)
    return b
