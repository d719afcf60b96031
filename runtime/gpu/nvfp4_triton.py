"""Fused NVFP4 MoE (W4A16) in Triton, reading FTW expert records straight from a pool of slots.

Shapes: T tokens, k = top-k, P = T*k (token, expert) pairs, pair p = t*k + j. The pool is uint8 [S, stride]: slot s
holds one expert record (layout in `record_layout.py`). Pairs are grouped by slot into blocks of BLOCK_M rows (padded
with the sentinel P), so one program multiplies BLOCK_M activation rows by one expert's weight tile: the same kernel
serves decode (P = k pairs, mostly one row per block) and prefill (many rows per expert).

Dequantization happens in registers, from bits, with no lookup table in memory:
* E2M1 nibble `s eee`  -> fp16 bits `s 0 0 e e e 0...` equals the E2M1 value times 2^-14 (subnormal 0.5 included);
* e4m3 byte `s eeee mmm` -> fp16 bits `s 0 eeee mmm 0...` equals the e4m3 value times 2^-8;
* their product has at most 5 significant bits, so it is exact in bf16; the dot runs bf16 x bf16 -> fp32 and the
  per-row fp32 `scale_2` (times 2^22 to undo both shifts) is applied once to the fp32 accumulator.
So the kernel differs from the exact reference only by fp32 summation order.

Codes pack element 2j in the low nibble, so the K loop splits x into even and odd columns and runs two dots of K/2
instead of interleaving nibbles.

`plan_blocks` runs on the host, so a call needs the routing there (one sync); decode calls whose experts are all
resident use the device-planned variant in `nvfp4_decode.py` instead, which reuses this file's dequantization.

The kernels are JIT-compiled by Triton at first use (one compile per tile configuration, about a second each); they
are not yet compiled ahead into the FTW `kernels/` slot.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .record_layout import RecordLayout

_UNSHIFT = 4194304.0  # 2^22 = 2^14 (E2M1 shift) * 2^8 (e4m3 shift)


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
def _weight_tile(rec, off_codes, off_scale, rows, row_mask, K, k0, j):
    # rows [BN] output rows; j [BK/2] byte index in the K tile -> (w_even, w_odd) bf16 [BN, BK/2], value * 2^-22
    codes = tl.load(rec + off_codes + rows[:, None] * (K // 2) + (k0 // 2 + j)[None, :], mask=row_mask[:, None], other=0)
    sc = tl.load(rec + off_scale + rows[:, None] * (K // 16) + ((k0 + 2 * j) // 16)[None, :], mask=row_mask[:, None], other=0)
    c = codes.to(tl.uint16)
    s = _e4m3_shifted(sc.to(tl.uint16))
    w_even = (_e2m1_shifted(c & 15) * s).to(tl.bfloat16)
    w_odd = (_e2m1_shifted(c >> 4) * s).to(tl.bfloat16)
    return w_even, w_odd


@triton.jit
def _mma(a, b_t, acc, DOT_F32: tl.constexpr):
    # acc += a @ b_t.T. Triton's CPU interpreter mis-multiplies bf16 dots, so it runs them as exact fp32 (the
    # operands are bf16-exact either way); compiled kernels use bf16 tensor cores.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b_t), acc)


@triton.jit
def _to_bf16(v, DOT_F32: tl.constexpr):
    # fp32 -> bf16 with round-to-nearest-even. The interpreter truncates on a plain cast, so there the rounding is
    # done on the bits first (the cast of an already-bf16 value is then exact).
    if DOT_F32:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _gate_up_kernel(
    pool, slot_stride, x, act, sorted_pairs, block_slot, num_pairs, topk, H, I,
    OFF_GU, OFF_GUS, OFF_GUS2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    # act[p, n] = bf16(silu(g) * u), g = row n, u = row I + n of gate_up applied to x[p // topk]
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot + pid_m).to(tl.int64)
    rec = pool + slot * slot_stride
    pairs = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    tok = (pairs // topk).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < I
    j = tl.arange(0, BLOCK_K // 2)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        xp = x + tok[:, None] * H + k0 + 2 * j[None, :]
        x_even = tl.load(xp, mask=m_mask[:, None], other=0.0)
        x_odd = tl.load(xp + 1, mask=m_mask[:, None], other=0.0)
        ge, go = _weight_tile(rec, OFF_GU, OFF_GUS, n, n_mask, H, k0, j)
        acc_g = _mma(x_even, ge, acc_g, DOT_F32)
        acc_g = _mma(x_odd, go, acc_g, DOT_F32)
        ue, uo = _weight_tile(rec, OFF_GU, OFF_GUS, I + n, n_mask, H, k0, j)
        acc_u = _mma(x_even, ue, acc_u, DOT_F32)
        acc_u = _mma(x_odd, uo, acc_u, DOT_F32)
    s2 = (rec + OFF_GUS2).to(tl.pointer_type(tl.float32))
    g = acc_g * (tl.load(s2 + n, mask=n_mask, other=0.0) * 4194304.0)[None, :]
    u = acc_u * (tl.load(s2 + I + n, mask=n_mask, other=0.0) * 4194304.0)[None, :]
    a = g / (1.0 + tl.exp(-g)) * u
    out = act + pairs.to(tl.int64)[:, None] * I + n[None, :]
    tl.store(out, _to_bf16(a, DOT_F32), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    pool, slot_stride, act, out, pair_weight, sorted_pairs, block_slot, num_pairs, H, I,
    OFF_D, OFF_DS, OFF_DS2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    # out[p, n] = weight[p] * (down row n) . act[p]   (fp32)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot + pid_m).to(tl.int64)
    rec = pool + slot * slot_stride
    pairs = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    p64 = pairs.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < H
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ap = act + p64[:, None] * I + k0 + 2 * j[None, :]
        a_even = tl.load(ap, mask=m_mask[:, None], other=0.0)
        a_odd = tl.load(ap + 1, mask=m_mask[:, None], other=0.0)
        we, wo = _weight_tile(rec, OFF_D, OFF_DS, n, n_mask, I, k0, j)
        acc = _mma(a_even, we, acc, DOT_F32)
        acc = _mma(a_odd, wo, acc, DOT_F32)
    s2 = tl.load((rec + OFF_DS2).to(tl.pointer_type(tl.float32)) + n, mask=n_mask, other=0.0) * 4194304.0
    w = tl.load(pair_weight + pairs, mask=m_mask, other=0.0)
    res = acc * s2[None, :] * w[:, None]
    tl.store(out + p64[:, None] * H + n[None, :], res, mask=m_mask[:, None] & n_mask[None, :])


def plan_blocks(pair_slots: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Group pairs by slot. pair_slots int [P] (-1 = pair not computed here).

    Returns (sorted_pairs int32 [nb * block_m], padded with P; block_slot int32 [nb]). Slots ascend, so a prefill's
    blocks of one expert are adjacent and its weight tiles stay hot in L2.
    """
    pair_slots = np.asarray(pair_slots).reshape(-1)
    num_pairs = pair_slots.shape[0]
    live = np.nonzero(pair_slots >= 0)[0]
    if live.size == 0:
        return np.empty(0, np.int32), np.empty(0, np.int32)
    order = live[np.argsort(pair_slots[live], kind="stable")]
    slots_sorted = pair_slots[order]
    uniq, starts, counts = np.unique(slots_sorted, return_index=True, return_counts=True)
    nblk = (counts + block_m - 1) // block_m
    sorted_pairs = np.full(int(nblk.sum()) * block_m, num_pairs, np.int32)
    block_slot = np.repeat(uniq, nblk).astype(np.int32)
    dst = 0
    for st, cnt, nb in zip(starts.tolist(), counts.tolist(), nblk.tolist()):
        sorted_pairs[dst : dst + cnt] = order[st : st + cnt]
        dst += nb * block_m
    return sorted_pairs, block_slot


def pick_blocks(num_rows_per_expert: float, hidden: int, inter: int) -> dict[str, int]:
    """Tile sizes: decode (about one row per expert) wants narrow N tiles to spread a few experts over all SMs."""
    if num_rows_per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N_GU": 32, "BLOCK_N_D": 64, "BLOCK_K": 128}
    return {"BLOCK_M": 64, "BLOCK_N_GU": 64, "BLOCK_N_D": 64, "BLOCK_K": 64}


def moe_nvfp4(
    pool: torch.Tensor,
    layout: RecordLayout,
    x: torch.Tensor,
    pair_slots: np.ndarray,
    topk_weights: torch.Tensor,
    blocks: dict[str, int] | None = None,
    pair_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert mixture over the pairs whose slot is >= 0.

    pool u8 [S, stride] (same device as x); x bf16 [T, H]; pair_slots int [T*k] host array; topk_weights [T, k].
    Returns fp32 [T, H] = sum over computed pairs of weight * expert(x). Pairs with slot -1 contribute nothing, so
    partial sums from other devices add exactly.
    pair_out: fp32 [T*k, H] to write the computed pairs' rows into (other rows untouched); it is returned instead,
    not summed over k. Calls over disjoint pairs with the same `blocks` then fill it exactly as one call would.
    """
    T, H = x.shape
    k = topk_weights.shape[1]
    if H != layout.hidden or pool.dtype != torch.uint8 or pool.shape[1] != layout.stride:
        raise ValueError(f"pool [S, {layout.stride}] u8 and x [T, {layout.hidden}] expected, got {tuple(pool.shape)} {tuple(x.shape)}")
    live = int((np.asarray(pair_slots) >= 0).sum())
    out = pair_out if pair_out is not None else torch.zeros(T * k, H, dtype=torch.float32, device=x.device)
    if pair_out is not None and (tuple(out.shape) != (T * k, H) or out.dtype != torch.float32):
        raise ValueError(f"pair_out must be fp32 [{T * k}, {H}], got {out.dtype} {tuple(out.shape)}")
    if live == 0:
        return out if pair_out is not None else out.view(T, k, H).sum(1)
    b = blocks or pick_blocks(live / max(1, len(np.unique(pair_slots[pair_slots >= 0]))), H, layout.inter)
    if H % b["BLOCK_K"] or layout.inter % b["BLOCK_K"]:
        b = dict(b, BLOCK_K=32)
    sorted_pairs, block_slot = plan_blocks(pair_slots, b["BLOCK_M"])
    dev = x.device
    sp = torch.from_numpy(sorted_pairs).to(dev, non_blocking=True)
    bs = torch.from_numpy(block_slot).to(dev, non_blocking=True)
    xb = x.to(torch.bfloat16).contiguous()
    act = torch.empty(T * k, layout.inter, dtype=torch.bfloat16, device=dev)
    wts = topk_weights.reshape(-1).to(torch.float32).contiguous()
    nb = block_slot.shape[0]
    interp = dev.type != "cuda"  # only the interpreter runs kernels on CPU tensors
    I = layout.inter
    _gate_up_kernel[(nb, triton.cdiv(I, b["BLOCK_N_GU"]))](
        pool, layout.stride, xb, act, sp, bs, T * k, k, H, I,
        layout.off_gate_up, layout.off_gate_up_scale, layout.off_gate_up_scale_2,
        BLOCK_M=b["BLOCK_M"], BLOCK_N=b["BLOCK_N_GU"], BLOCK_K=b["BLOCK_K"], DOT_F32=interp,
    )
    _down_kernel[(nb, triton.cdiv(H, b["BLOCK_N_D"]))](
        pool, layout.stride, act, out, wts, sp, bs, T * k, H, I,
        layout.off_down, layout.off_down_scale, layout.off_down_scale_2,
        BLOCK_M=b["BLOCK_M"], BLOCK_N=b["BLOCK_N_D"], BLOCK_K=min(b["BLOCK_K"], I), DOT_F32=interp,
    )
    return out if pair_out is not None else out.view(T, k, H).sum(1)
