"""Tensor-core FP4 MoE for decode: each routed expert is decoded once per call, for all of its tokens (NVFP4 or
MXFP4 records, as in `nvfp4_decode.py`).

`nvfp4_decode.py` gives every (token, expert) pair its own program that decodes the expert's weights and runs FMAs:
about 7 instructions per weight per pair, so a call costs issue slots in proportion to pairs (T=8, top-8 of 256:
64 pairs) and reaches ~0.25 of HBM. Here a program owns one *distinct* expert and one tile of BN output rows:

    gate_up: grid (P, cdiv(I, BN))   program (p, n): if p is the lowest pair routed to expert e = ids[p] (else it
                                     exits), act[q_t, n] = bf16(act(g, u)) for every token t routed to e (pair q_t)
    down:    grid (P, cdiv(H, BN))   the same grouping; out[q_t, n] = w[q_t] * (down rows n) . act[q_t]   fp32 [P, H]
and the caller sums out over k in a fixed order. A weight tile is decoded once into bf16 and multiplied on the tensor
cores against all TP (= next power of two >= T) token rows: `tl.dot` of [BN, BK/2] weights by [BK/2, TP] tokens,
the even and odd K columns as two dots (a code byte holds columns 2j and 2j + 1, so no interleave is needed; the
activations are loaded in the same split). The grouping is computed in every program from the [T, k] ids (a few
hundred bytes from L1): no sort, no plan, no host work, and the grid depends on shapes only (CUDA-graph safe).
Invariant: an expert appears at most once among a token's k ids (top-k routing).

Decoding (CUDA, `_DEQUANT` inline PTX; ~2 instructions per weight): a code byte pair is moved to the top nibbles of
two 16-bit halves (`prmt`), `(v & 0x80008000) | ((v >> 6) & 0x01C001C0)` turns each half's nibble `s e1 e0 m` into
the bf16 bits of E2M1 * 2^-126 (the subnormal 0.5 included), and one `fma.rn.bf16x2` by the block scale times
2^104 gives E2M1 * scale * 2^-22: a product of <= 6 significant bits, exact in bf16 and a normal number (an E8M0
scale 2^(b - 127) the same way, for the bytes b >= 24 and <= 150 that scales use). The
interpreter builds the same values through fp16 bits (`nvfp4_triton._e2m1_shifted`). `scale_2 * 2^22` is applied
to the fp32 accumulator, so results equal the FMA kernels' up to fp32 summation order (deterministic: no atomics).

Mapped reads (host_base != 0) and dead pairs (slot < 0, not mapped: loads masked, contributes 0) behave as in
`nvfp4_decode.py` (`_records`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_wait

from .nvfp4_decode import _records, check_moe_args
from .fp4_format import _e2m1_shifted, _gated, _row_bias, _row_scale, _scale_shifted
from .nvfp4_triton import _fit_block_k, _mma, _to_bf16
from ..record_layout import RecordLayout

# From this many tokens a decode call runs here; below, `nvfp4_decode`'s per-pair FMA kernels are faster (one token
# has no expert to share, and its ~8 experts leave most of the GPU idle either way). tools/bench_moe_decode.py, H200.
MMA_MIN_TOKENS = 3
# Per kernel (_GU gate_up, _D down): BN output rows per program (gate_up: BN gate + BN up rows), BK K columns per
# step, warps, pipeline stages: the fastest at T = 4 and 8 of tools/bench_moe_decode.py's sweep on an H200
# (benchmarks/gpu_full.md)
MMA_BLOCKS = {"BN_GU": 32, "BK_GU": 256, "WARPS_GU": 2, "STAGES_GU": 3,
              "BN_D": 64, "BK_D": 256, "WARPS_D": 2, "STAGES_D": 3}

# 4 code bytes ($4) and their 4 bf16 multipliers ($5: bytes 0, 1; $6: bytes 2, 3) -> even columns ($0: bytes 0, 1;
# $1: bytes 2, 3) and odd columns ($2, $3), two bf16 per register (element 2r in the low half)
_DEQUANT = tl.constexpr("""{
.reg .b32 z, nz, v, w, t;
mov.b32 z, 0;
mov.b32 nz, 0x80008000;
prmt.b32 v, $4, z, 0x1404;
shl.b32 w, v, 4;
shr.b32 t, w, 6;
and.b32 t, t, 0x01C001C0;
and.b32 w, w, 0x80008000;
or.b32 w, w, t;
fma.rn.bf16x2 $0, w, $5, nz;
shr.b32 t, v, 6;
and.b32 t, t, 0x01C001C0;
and.b32 w, v, 0x80008000;
or.b32 w, w, t;
fma.rn.bf16x2 $2, w, $5, nz;
prmt.b32 v, $4, z, 0x3424;
shl.b32 w, v, 4;
shr.b32 t, w, 6;
and.b32 t, t, 0x01C001C0;
and.b32 w, w, 0x80008000;
or.b32 w, w, t;
fma.rn.bf16x2 $1, w, $6, nz;
shr.b32 t, v, 6;
and.b32 t, t, 0x01C001C0;
and.b32 w, v, 0x80008000;
or.b32 w, w, t;
fma.rn.bf16x2 $3, w, $6, nz;
}""")
_SCALE_UP = tl.constexpr(2.028240960365167e31)  # 2^104
_E8M0_UP = tl.constexpr(5.192296858534828e33)  # 2^112: `_scale_shifted`'s E8M0 value (scale * 2^-8) * 2^112


@triton.jit
def _weight_halves(rec, OFF_C: tl.constexpr, OFF_S: tl.constexpr, rows, row_mask, K: tl.constexpr, k0,
                   BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, GPS: tl.constexpr, E8M0: tl.constexpr):
    # rows [BN] -> (even, odd) bf16 [BN, BK/2] = W[rows, k0 + 2j] and W[rows, k0 + 2j + 1], times 2^-22
    j = tl.arange(0, BK // 2)
    g = tl.arange(0, BK // 16)  # 16-column groups; GPS of them share a scale byte
    r64 = rows.to(tl.int64)[:, None]
    c = tl.load(rec + OFF_C + r64 * (K // 2) + (k0 // 2 + j)[None, :], mask=row_mask[:, None], other=0)
    sc = tl.load(rec + OFF_S + r64 * (K // (16 * GPS)) + ((k0 // 16 + g) // GPS)[None, :], mask=row_mask[:, None],
                 other=0)
    if ASM:  # [BN, BK/16] scale * 2^104, exact in bf16 (<= 4 significant bits); sm_89+ converts e4m3 in hardware
        if E8M0:  # 2^(b - 135) * 2^112 = 2^(b - 23): finite and exact for the bytes scales use (b <= 150)
            m = (_scale_shifted(sc.to(tl.uint16), True) * _E8M0_UP).to(tl.bfloat16)
        else:
            m = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _SCALE_UP).to(tl.bfloat16)
        m = tl.reshape(tl.broadcast_to(m[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))  # a scale per 8 bytes
        even, odd = tl.inline_asm_elementwise(_DEQUANT, "=r,=r,=r,=r,r,r,r", [c, m],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        s = _scale_shifted(sc.to(tl.uint16), E8M0)  # [BN, BK/16] fp32 scale * 2^-8
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))
        cu = c.to(tl.uint16)
        even = (_e2m1_shifted(cu & 15) * s).to(tl.bfloat16)
        odd = (_e2m1_shifted(cu >> 4) * s).to(tl.bfloat16)
    return even, odd


@triton.jit
def _x_halves(x, t, live, K: tl.constexpr, k0, TP: tl.constexpr, BK: tl.constexpr):
    # token rows t [TP] of x bf16 [*, K] -> (even, odd) bf16 [TP, BK/2]: columns k0 + 2j and k0 + 2j + 1 (0 if dead)
    v = tl.load(x + t.to(tl.int64)[:, None] * K + k0 + tl.arange(0, BK)[None, :], mask=live[:, None], other=0.0)
    return tl.split(tl.reshape(v, (TP, BK // 2, 2)))


@triton.jit
def _group(topk_ids, p, T, TOPK: tl.constexpr, TP: tl.constexpr, KP: tl.constexpr):
    # pair p -> (owner: p is the lowest pair routed to expert ids[p]; tokens t [TP]; live[t]: t routed to that
    # expert; q[t]: its pair id t * TOPK + j)
    e = tl.load(topk_ids + p)
    t = tl.arange(0, TP)
    j = tl.arange(0, KP)[None, :]
    q = t[:, None] * TOPK + j  # [TP, KP]
    valid = (t[:, None] < T) & (j < TOPK)
    hit = (tl.load(topk_ids + q, mask=valid, other=-1) == e) & valid
    first = tl.min(tl.min(tl.where(hit, q, TP * TOPK), axis=1), axis=0)
    live = tl.max(hit.to(tl.int32), axis=1) > 0
    q = t * TOPK + tl.sum(tl.where(hit, j, 0), axis=1)
    return first == p, t, live, q


@triton.jit
def _gate_up_mma_kernel(
    pool, slot_stride, host_base, host_stride, x, act, topk_ids, slot_row, T,
    TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    OFF_GU: tl.constexpr, OFF_GUS: tl.constexpr, OFF_GUS2: tl.constexpr, OFF_GUB: tl.constexpr,
    TP: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ASM: tl.constexpr, F32: tl.constexpr, MAPPED: tl.constexpr, PDL: tl.constexpr,
    GPS: tl.constexpr, E8M0: tl.constexpr, S2: tl.constexpr, BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    # act[q, n] = bf16(act(g, u)) for the pairs q of the expert owned by this program (act bf16 [P, I])
    pdl_wait(PDL)
    p = tl.program_id(0)
    owner, t, live, q = _group(topk_ids, p, T, TOPK, TP, KP)
    if owner:
        rec, rec_live = _records(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, p >= 0, MAPPED)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = n < I * rec_live.to(tl.int32)
        acc_g = tl.zeros((BN, TP), dtype=tl.float32)
        acc_u = tl.zeros((BN, TP), dtype=tl.float32)
        for k0 in range(0, H, BK):
            xe, xo = _x_halves(x, t, live, H, k0, TP, BK)
            ge, go = _weight_halves(rec, OFF_GU, OFF_GUS, n, n_mask, H, k0, BN, BK, ASM, GPS, E8M0)
            acc_g = _mma(go, xo, _mma(ge, xe, acc_g, F32), F32)
            ue, uo = _weight_halves(rec, OFF_GU, OFF_GUS, I + n, n_mask, H, k0, BN, BK, ASM, GPS, E8M0)
            acc_u = _mma(uo, xo, _mma(ue, xe, acc_u, F32), F32)
        g = (acc_g * _row_scale(rec, OFF_GUS2, n, n_mask, S2)[:, None]
             + _row_bias(rec, OFF_GUB, n, n_mask, BIAS)[:, None])
        u = (acc_u * _row_scale(rec, OFF_GUS2, I + n, n_mask, S2)[:, None]
             + _row_bias(rec, OFF_GUB, I + n, n_mask, BIAS)[:, None])
        a = _gated(g, u, SWIGLU, ALPHA, LIMIT)
        tl.store(act + q.to(tl.int64)[None, :] * I + n[:, None], _to_bf16(a, F32),
                 mask=live[None, :] & (n < I)[:, None])


@triton.jit
def _down_mma_kernel(
    pool, slot_stride, host_base, host_stride, act, out, pair_weight, topk_ids, slot_row, T,
    TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    OFF_D: tl.constexpr, OFF_DS: tl.constexpr, OFF_DS2: tl.constexpr, OFF_DB: tl.constexpr,
    TP: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ASM: tl.constexpr, F32: tl.constexpr, MAPPED: tl.constexpr, PDL: tl.constexpr,
    GPS: tl.constexpr, E8M0: tl.constexpr, S2: tl.constexpr, BIAS: tl.constexpr,
):
    # out[q, n] = w[q] * ((down row n) . act[q] + bias[n]) for the pairs q of the expert owned by this program
    # (fp32 [P, H])
    pdl_wait(PDL)
    p = tl.program_id(0)
    owner, t, live, q = _group(topk_ids, p, T, TOPK, TP, KP)
    if owner:
        rec, rec_live = _records(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, p >= 0, MAPPED)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = n < H * rec_live.to(tl.int32)
        acc = tl.zeros((BN, TP), dtype=tl.float32)
        for k0 in range(0, I, BK):
            ae, ao = _x_halves(act, q, live, I, k0, TP, BK)
            de, do = _weight_halves(rec, OFF_D, OFF_DS, n, n_mask, I, k0, BN, BK, ASM, GPS, E8M0)
            acc = _mma(do, ao, _mma(de, ae, acc, F32), F32)
        y = acc * _row_scale(rec, OFF_DS2, n, n_mask, S2)[:, None] + _row_bias(rec, OFF_DB, n, n_mask, BIAS)[:, None]
        w = tl.load(pair_weight + q, mask=live, other=0.0).to(tl.float32)
        tl.store(out + q.to(tl.int64)[None, :] * H + n[:, None], y * w[None, :],
                 mask=live[None, :] & (n < H)[:, None])


@triton.jit
def _sum_pairs_kernel(src, out, H: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr,
                      ROUND_BF16: tl.constexpr, PDL: tl.constexpr):
    # out[t, h] = sum over j < TOPK of src[t * TOPK + j, h]  (src fp32 [P, H]; one fixed order: deterministic)
    pdl_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    j = tl.arange(0, KP)
    v = tl.load(src + (t * TOPK + j).to(tl.int64)[:, None] * H + h[None, :],
                mask=(j < TOPK)[:, None] & (h < H)[None, :], other=0.0)
    total = tl.sum(v, axis=0)
    if ROUND_BF16:  # the interpreter truncates on a bf16 store: round to nearest even first
        total = _to_bf16(total, True)
    tl.store(out + t.to(tl.int64) * H + h, total, mask=h < H)


def moe_nvfp4_mma(
    pool: torch.Tensor,
    layout: RecordLayout,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    slot_row: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    blocks: dict[str, int] | None = None,
    host_base: int = 0,
    host_stride: int = 0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`nvfp4_decode.moe_nvfp4_device`'s contract (same arguments and result, host work by shapes only), computed
    expert by expert on the tensor cores (module docstring). blocks: overrides of `MMA_BLOCKS`."""
    check_moe_args(pool, layout, x, topk_ids, slot_row, topk_weights)
    b = {**MMA_BLOCKS, **(blocks or {})}
    unknown = set(b) - set(MMA_BLOCKS)
    if unknown:
        raise ValueError(f"unknown MMA block keys {sorted(unknown)}; known: {sorted(MMA_BLOCKS)}")
    (T, k), H, I = topk_ids.shape, layout.hidden, layout.inter
    if T == 0 or k == 0:
        return torch.zeros(T, H, dtype=out_dtype, device=x.device)
    for key in ("BK_GU", "BK_D"):
        if b[key] < 32 or b[key] & (b[key] - 1):
            raise ValueError(f"{key} {b[key]} must be a power of two >= 32")
    if H % 32 or I % 32:
        raise ValueError(f"hidden {H} and inter {I} must be multiples of 32")
    if host_base % 16 or (host_base and host_stride % 16):
        raise ValueError(f"host_base {host_base:#x} and host_stride {host_stride} must be 16-byte aligned")
    asm = x.device.type == "cuda"  # only the interpreter runs kernels on CPU tensors
    xb = x.to(torch.bfloat16).contiguous()
    ids, row = topk_ids.contiguous(), slot_row.contiguous()
    common = dict(TP=max(2, triton.next_power_of_2(T)), KP=triton.next_power_of_2(k), ASM=asm, F32=not asm,
                  MAPPED=host_base != 0, **pdl_args(x.device))
    host = (host_base, host_stride if host_base else 0)
    act = torch.empty(T * k, I, dtype=torch.bfloat16, device=x.device)
    _gate_up_mma_kernel[(T * k, triton.cdiv(I, b["BN_GU"]))](
        pool, layout.stride, *host, xb, act, ids, row, T, k, H, I,
        layout.off_gate_up, layout.off_gate_up_scale, BN=b["BN_GU"], BK=_fit_block_k(b["BK_GU"], H),
        num_warps=b["WARPS_GU"], num_stages=b["STAGES_GU"], **layout.kernel_args("gate_up"), **common)
    out = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    _down_mma_kernel[(T * k, triton.cdiv(H, b["BN_D"]))](
        pool, layout.stride, *host, act, out, topk_weights.reshape(-1).contiguous(), ids, row, T, k, H, I,
        layout.off_down, layout.off_down_scale, BN=b["BN_D"], BK=_fit_block_k(b["BK_D"], I),
        num_warps=b["WARPS_D"], num_stages=b["STAGES_D"], **layout.kernel_args("down"), **common)
    total = torch.empty(T, H, dtype=out_dtype, device=x.device)
    _sum_pairs_kernel[(T, triton.cdiv(H, 1024))](out, total, H, k, triton.next_power_of_2(k), BH=1024,
                                                  ROUND_BF16=not asm and out_dtype == torch.bfloat16,
                                                  num_warps=4, **pdl_args(x.device))
    return total


def decode_kernel(num_tokens: int):
    """The decode MoE kernel for a call of `num_tokens` tokens (both take `moe_nvfp4_device`'s arguments)."""
    from .nvfp4_decode import moe_nvfp4_device

    return moe_nvfp4_mma if num_tokens >= MMA_MIN_TOKENS else moe_nvfp4_device
