"""FP4 weight-row GEMV tiles for decode (`rows_dot`): wide independent loads, few ALU ops per weight.

    v[r, a] = sum_k W_a[row(r, a), k] * x_a[k] * 2^-22          fp32 [R, A]   (the caller applies scale_2 * 2^22)

W_a is the FP4 weight of record a (a pool slot or a mapped bank record), W[o, k] = E2M1(code[o, k]) *
scale[o, k // G]: NVFP4 e4m3 scales per G = 16 codes, or MXFP4 E8M0 scales per G = 32 (`GPS` = G / 16 words share
one scale byte; `nvfp4_triton._scale_shifted`); x_a is record a's bf16 activation row. A is a small record axis:
1 in gate_up (2*BN rows of one pair: its gate and up rows), the k pairs of a token in down (BN rows of each, every
pair its own record and activation row).

Memory. A row of K codes is K/16 little-endian u64 words; word b holds the 16 codes of scale block b (code 16b + i in
nibble i, as `record_layout` stores them: element 2j in the low nibble of byte j). A K chunk of BKB words is one
[R, A, BKB] u64 load plus the matching [R, A, BKB] e4m3 scale bytes, and the block's 16 activations are 4 u64 loads
(each 4 bf16). The chunks are unrolled (KB is a constexpr), so a program issues all of its weight bytes before its
first FMA: up to R * A * K / 2 bytes in flight per program.

Register layout. Every load is issued one word (or scale byte, or activation u64) per thread along K
(`max_contiguous(.., 1)`), and the record axis A sits between rows and K, so the code, scale and activation tiles
(shapes [R, A, BKB] and [1, A, BKB]) get the same blocked layout from Triton's coalescing pass: lanes and warps along
K, then along A, rows in registers. No tile goes through shared memory; each activation value is loaded once per
thread and reused for its R rows; the only cross-thread work is the final sum over K (shuffles).

Arithmetic per weight. Each u32 half of a word holds 8 codes; for j in 0..3, `((w >> 4j) & 0x70007) << 9 |
((w >> 4j) & 0x80008) << 12` builds two fp16 bit patterns at once (codes j and j + 4, one per 16-bit half), each equal
to the E2M1 value times 2^-14 (the subnormal 0.5 included): exactly the values of `nvfp4_triton._e2m1_shifted`. On
CUDA an inline `cvt.f32.f16` converts both halves in place (Triton's own f16 path repacks halves with an extra PRMT);
the interpreter takes the plain Triton path. The product with the activation is exact in fp32 (<= 2 + 8 significant
bits) and is summed over the block's 16 codes; the block sum is multiplied by the block's e4m3 scale
(`_e4m3_shifted`, value times 2^-8, decoded once per 16 weights). About 4 instructions per weight in the inner loop
(2 to unpack, 1 conversion, 1 FMA); 5 to 9 per weight over a whole sm_90 kernel, by tile config, with address math,
the sum over K and the epilogue (`tools/bench_moe_decode.py --compile-only` prints it per config). Factoring the
scale out of the block sum is exact in real arithmetic; in fp32 it differs from multiplying every weight by its
scale only by rounding, like a change of summation order.

Masking: rows, words or activations outside the masks load as 0 (code 0 is +0.0, scale 0), so they add exactly 0 and
their bytes are never read. Every sum runs in a fixed order: deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp4_format import _scale_shifted


@triton.jit
def _e2m1_pair(w, J: tl.constexpr, ASM: tl.constexpr):
    # w u32 (8 codes, code i in bits 4i..4i+3) -> fp32 (code J, code J + 4), each the E2M1 value * 2^-14
    s = w >> (4 * J)
    t = ((s & 0x70007) << 9) | ((s & 0x80008) << 12)  # two fp16 patterns `s00eee0..`, one per 16-bit half
    return f16x2_f32(t, ASM)


@triton.jit
def f16x2_f32(t, ASM: tl.constexpr):
    # u32 holding two fp16 bit patterns -> fp32 (low half, high half)
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [t], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        lo, hi = lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
    else:
        lo = (t & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (t >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _bf16_at(lo, hi, J: tl.constexpr):
    # bf16 number J of the four in a u64 (given as its u32 halves lo, hi) -> fp32 (exact: the bits move up)
    if J == 0:
        b = lo << 16
    elif J == 1:
        b = lo & 0xFFFF0000
    elif J == 2:
        b = hi << 16
    else:
        b = hi & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _block_dot(words, xw, xm, R: tl.constexpr, A: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr,
               XBF16: tl.constexpr = True):
    # words u64 [R, A, BKB]; XBF16: xw u64 pointers [1, A or 1, BKB], a block's 16 bf16 activations the 4 u64 at
    # xw .. xw + 3; else xw typed pointers to the block's 16 activations (fp16 / fp32: one load each)
    # -> fp32 [R, A, BKB] = sum_i E2M1_i * 2^-14 * x[16b + i]
    lo = words.to(tl.uint32)  # codes 0..7 of the block
    hi = (words >> 32).to(tl.uint32)  # codes 8..15
    acc = tl.zeros([R, A, BKB], dtype=tl.float32)
    if XBF16:
        x0 = tl.load(xw, mask=xm, other=0)  # activations 0..3
        x1 = tl.load(xw + 1, mask=xm, other=0)  # 4..7
        x2 = tl.load(xw + 2, mask=xm, other=0)  # 8..11
        x3 = tl.load(xw + 3, mask=xm, other=0)  # 12..15
        x0l, x0h = x0.to(tl.uint32), (x0 >> 32).to(tl.uint32)
        x1l, x1h = x1.to(tl.uint32), (x1 >> 32).to(tl.uint32)
        x2l, x2h = x2.to(tl.uint32), (x2 >> 32).to(tl.uint32)
        x3l, x3h = x3.to(tl.uint32), (x3 >> 32).to(tl.uint32)
        for j in tl.static_range(4):  # codes j, j + 4 (low u32) and j + 8, j + 12 (high u32)
            e0, e4 = _e2m1_pair(lo, j, ASM)
            e8, e12 = _e2m1_pair(hi, j, ASM)
            acc += e0 * _bf16_at(x0l, x0h, j)
            acc += e4 * _bf16_at(x1l, x1h, j)
            acc += e8 * _bf16_at(x2l, x2h, j)
            acc += e12 * _bf16_at(x3l, x3h, j)
    else:
        for j in tl.static_range(4):
            e0, e4 = _e2m1_pair(lo, j, ASM)
            e8, e12 = _e2m1_pair(hi, j, ASM)
            acc += e0 * tl.load(xw + j, mask=xm, other=0).to(tl.float32)
            acc += e4 * tl.load(xw + 4 + j, mask=xm, other=0).to(tl.float32)
            acc += e8 * tl.load(xw + 8 + j, mask=xm, other=0).to(tl.float32)
            acc += e12 * tl.load(xw + 12 + j, mask=xm, other=0).to(tl.float32)
    return acc


@triton.jit
def rows_dot(rec, OFF_C, OFF_S, rows, row_mask, xrow, x_mask, KB: tl.constexpr,
             R: tl.constexpr, A: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr,
             GPS: tl.constexpr = 1, E8M0: tl.constexpr = False, XBF16: tl.constexpr = True):
    """R weight rows of each of A records against each record's activation row -> fp32 [R, A] (module docstring).

    rec u8 pointers, a scalar or [1, A, 1] (record bases); rows int [R, A or 1, 1]; row_mask bool broadcastable to
    [R, A, 1]; xrow bf16 pointers, a scalar or [1, A, 1], to activation rows of K = 16 * KB elements, 8-byte aligned
    (XBF16 = False: fp16 / fp32 rows, read one element at a time: dense linears of such models, `dense_quant.py`);
    x_mask bool broadcastable to [1, A, 1]. Codes at rec + OFF_C (u8 [rows, K/2]), scales at rec + OFF_S (u8
    [rows, K/(16 GPS)]: e4m3 per 16 codes, GPS = 1, NVFP4; or E8M0 per 32, GPS = 2, E8M0, MXFP4); BKB words (power of
    two) per unrolled K chunk. Exactly 0 where row_mask is false. ASM: CUDA only."""
    kb = tl.max_contiguous(tl.arange(0, BKB), 1)[None, None, :]  # one word per thread along K: see the docstring
    wp = (rec + OFF_C).to(tl.pointer_type(tl.uint64)) + rows.to(tl.int64) * KB  # row: KB words
    sp = rec + OFF_S + rows.to(tl.int64) * (KB // GPS)  # row: KB / GPS scale bytes
    xw = xrow.to(tl.pointer_type(tl.uint64))  # 4 u64 of activations per word of codes (XBF16)
    acc = tl.zeros([R, A, BKB], dtype=tl.float32)
    for k0 in tl.static_range(0, KB, BKB):
        in_k = (k0 + kb) < KB
        m = row_mask & in_k
        words = tl.load(wp + (k0 + kb), mask=m, other=0)
        sc = tl.load(sp + (k0 + kb) // GPS, mask=m, other=0)  # GPS = 2: two words share a scale byte
        if XBF16:
            part = _block_dot(words, xw + 4 * (k0 + kb), x_mask & in_k, R, A, BKB, ASM)
        else:
            part = _block_dot(words, xrow + 16 * (k0 + kb), x_mask & in_k, R, A, BKB, ASM, False)
        acc += part * _scale_shifted(sc.to(tl.uint16), E8M0)
    return tl.sum(acc, axis=2)
