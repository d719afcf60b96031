"""Device-planned NVFP4 MoE for decode: routing and the expert -> slot lookup never leave the device.

The host-planned kernels of `nvfp4_triton.py` need the routing on the host (`plan_blocks` groups pairs by slot), one
host sync per MoE layer. Here the launch grid depends on shapes only: for T tokens and top-k, P = T*k pairs,

    gate_up: grid (P, cdiv(I, BLOCK_N_GU))    program (p, n-tile) reads e = topk_ids[p], slot = slot_row[e]
    down:    grid (P, cdiv(H, BLOCK_N_D))     combine="pairs":  out[p] = w[p] * down(act[p]), then a torch sum over k
             grid (T, cdiv(H, BLOCK_N_D))     combine="tokens": out[t] = sum_{j=0..k-1} w[t, j] * down(act[t*k + j]),
                                              summed in the fixed order j = 0..k-1 inside one program
No `.cpu()`, `.item()` or data-dependent shape anywhere, so a call can be captured in a CUDA graph. Meant for small
P (decode, P <= 64 in `device_path.MAX_DEVICE_PAIRS`): one program handles one pair, so it runs as a GEMV (elementwise
products + `tl.sum`) instead of a `tl.dot` tile that would be 15/16 padding.

A pair whose slot is < 0 (expert not resident) is never read: every load of its record is masked off and it
contributes exactly 0 (its act row is written as 0). Callers guarantee residency; `check_resident` is a debug check
(it syncs) that raises instead.

Mapped reads (host_base != 0, "zero-copy"): such a pair reads expert e's record straight from the layer's bank at
the device address `host_base + e * host_stride` (same `RecordLayout` as a slot), so every pair is live. Such a
pair's record bytes cross the bus on every call (nothing is kept in VRAM; two pairs of one expert read it twice).
On CUDA the caller guarantees the bank is page-locked and mapped (cudaHostRegister / pinned with a device pointer)
and stays so for the call; on CPU under the interpreter any host address works. host_base == 0 compiles the
kernels without the host branch (the `MAPPED` constexpr), i.e. exactly the code above.

Dequantization is bit-identical to `nvfp4_triton.py` (`_weight_tile`: E2M1 and e4m3 decoded from bits into bf16 values
times 2^-22, `scale_2 * 2^22` applied to the fp32 accumulator; the gated activation rounded to bf16 by
`_to_bf16`). Each product of a bf16 weight with a bf16 activation is exact in fp32, as in the tensor-core dot, so the
result equals the host-planned kernel's up to fp32 summation order. Deterministic: no atomics; the per-token sum over
k runs in a fixed order (torch's reduction or the program's j loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4_triton import _to_bf16, _weight_tile
from .record_layout import COMPONENTS, RecordLayout

DECODE_BLOCKS = {"BLOCK_N_GU": 32, "BLOCK_N_D": 32, "BLOCK_K": 128, "num_warps": 4}
COMBINES = ("pairs", "tokens")


@triton.jit
def _pair_record(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, n, N, MAPPED: tl.constexpr):
    # pair p, output rows n [BN] of N -> (record pointer, row mask). Not MAPPED: a dead pair (slot < 0) gets an
    # all-false mask (rows limited to N * 0), so every load through its pointer (clamped to slot 0) is masked off.
    # MAPPED: slot < 0 reads the bank record at the int64 address host_base + e * host_stride; every pair is live.
    e = tl.load(topk_ids + p).to(tl.int64)
    slot = tl.load(slot_row + e)
    rec = pool + tl.maximum(slot, 0).to(tl.int64) * slot_stride
    if MAPPED:
        host = (host_base.to(tl.int64) + e * host_stride).to(tl.pointer_type(tl.uint8))
        rec = tl.where(slot >= 0, rec, host)
        limit = N
    else:
        limit = N * (slot >= 0).to(tl.int32)  # a comparison, not `n_mask & live`: the interpreter mistypes that mask
    return rec, n < limit


@triton.jit
def _gemv_tile(rec, OFF_W, OFF_S, rows, w_mask, src, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # sum_i W[rows, i] * src[i] for one record, fp32 [BN] (value * 2^-22); src bf16 [K] (one activation row)
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        s_even = tl.load(src + k0 + 2 * j).to(tl.float32)
        s_odd = tl.load(src + k0 + 2 * j + 1).to(tl.float32)
        w_even, w_odd = _weight_tile(rec, OFF_W, OFF_S, rows, w_mask, K, k0, j)
        prod = w_even.to(tl.float32) * s_even[None, :] + w_odd.to(tl.float32) * s_odd[None, :]
        acc += tl.sum(prod, axis=1)
    return acc


@triton.jit
def _gate_up_pairs_kernel(
    pool, slot_stride, host_base, host_stride, x, act, topk_ids, slot_row, topk, H, I,
    OFF_GU, OFF_GUS, OFF_GUS2,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr, MAPPED: tl.constexpr,
):
    # act[p, n] = bf16(silu(g) * u), g = row n, u = row I + n of gate_up applied to x[p // topk]; 0 for a dead pair
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    xrow = x + (p // topk).to(tl.int64) * H
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < I
    rec, w_mask = _pair_record(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, n, I, MAPPED)
    acc_g = _gemv_tile(rec, OFF_GU, OFF_GUS, n, w_mask, xrow, H, BLOCK_N, BLOCK_K)
    acc_u = _gemv_tile(rec, OFF_GU, OFF_GUS, I + n, w_mask, xrow, H, BLOCK_N, BLOCK_K)
    s2 = (rec + OFF_GUS2).to(tl.pointer_type(tl.float32))
    g = acc_g * (tl.load(s2 + n, mask=w_mask, other=0.0) * 4194304.0)
    u = acc_u * (tl.load(s2 + I + n, mask=w_mask, other=0.0) * 4194304.0)
    a = g / (1.0 + tl.exp(-g)) * u
    a = tl.where(w_mask, a, 0.0)
    tl.store(act + p.to(tl.int64) * I + n, _to_bf16(a, INTERP), mask=n_mask)


@triton.jit
def _down_pair(pool, slot_stride, host_base, host_stride, act, topk_ids, slot_row, pair_weight, p, n, H, I,
               OFF_D, OFF_DS, OFF_DS2, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAPPED: tl.constexpr):
    # weight[p] * (down rows n) . act[p]  -> fp32 [BN]; exactly 0 for a dead pair and for rows n >= H
    rec, w_mask = _pair_record(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, n, H, MAPPED)
    acc = _gemv_tile(rec, OFF_D, OFF_DS, n, w_mask, act + p.to(tl.int64) * I, I, BLOCK_N, BLOCK_K)
    s2 = tl.load((rec + OFF_DS2).to(tl.pointer_type(tl.float32)) + n, mask=w_mask, other=0.0) * 4194304.0
    res = acc * s2 * tl.load(pair_weight + p)
    return tl.where(w_mask, res, 0.0)


@triton.jit
def _down_pairs_kernel(
    pool, slot_stride, host_base, host_stride, act, out, pair_weight, topk_ids, slot_row, H, I,
    OFF_D, OFF_DS, OFF_DS2,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAPPED: tl.constexpr,
):
    # out[p, n] = weight[p] * (down row n) . act[p]   (fp32 [P, H]; the caller sums over k)
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < H
    res = _down_pair(pool, slot_stride, host_base, host_stride, act, topk_ids, slot_row, pair_weight, p, n, H, I,
                     OFF_D, OFF_DS, OFF_DS2, BLOCK_N, BLOCK_K, MAPPED)
    tl.store(out + p.to(tl.int64) * H + n, res, mask=n_mask)


@triton.jit
def _down_tokens_kernel(
    pool, slot_stride, host_base, host_stride, act, out, pair_weight, topk_ids, slot_row, H, I,
    OFF_D, OFF_DS, OFF_DS2,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAPPED: tl.constexpr,
):
    # out[t, n] = sum over j = 0..TOPK-1 (in this order) of weight[t*TOPK + j] * (down row n) . act[t*TOPK + j]
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < H
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for jj in tl.static_range(TOPK):
        total += _down_pair(pool, slot_stride, host_base, host_stride, act, topk_ids, slot_row, pair_weight,
                            t * TOPK + jj, n, H, I, OFF_D, OFF_DS, OFF_DS2, BLOCK_N, BLOCK_K, MAPPED)
    tl.store(out + t.to(tl.int64) * H + n, total, mask=n_mask)


def _fit_block_k(block_k: int, *dims: int) -> int:
    # largest power of two <= block_k (and >= 32) dividing every reduction dim; H and I are multiples of 32
    while block_k > 32 and any(d % block_k for d in dims):
        block_k //= 2
    return block_k


def moe_nvfp4_device(
    pool: torch.Tensor,
    layout: RecordLayout,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    slot_row: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    blocks: dict[str, int] | None = None,
    combine: str = "pairs",
    host_base: int = 0,
    host_stride: int = 0,
) -> torch.Tensor:
    """Expert mixture with device-side routing. Host work depends on shapes only (no sync).

    pool u8 [S, stride]; x [T, H] (cast to bf16); topk_ids int [T, k]; slot_row int32 [E] (expert -> slot of this
    layer, -1 = not resident: that pair contributes 0); topk_weights [T, k]; all on one device.
    host_base: 0, or the device address of this layer's bank (expert e's record at host_base + e * host_stride,
    16-byte aligned, page-locked and mapped on CUDA): then a pair without a slot reads its record from there.
    Returns fp32 [T, H] = sum over pairs with a slot (all pairs when host_base != 0) of weight * expert(x).
    """
    T, H = x.shape
    if H != layout.hidden or pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != layout.stride:
        raise ValueError(f"pool [S, {layout.stride}] u8 and x [T, {layout.hidden}] expected, got "
                         f"{tuple(pool.shape)} {pool.dtype} {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids and topk_weights must both be [T={T}, k], got {tuple(topk_ids.shape)} "
                         f"{tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or slot_row.dtype != torch.int32 or slot_row.dim() != 1:
        raise ValueError(f"topk_ids int32/int64 and slot_row int32 [E] expected, got {topk_ids.dtype} "
                         f"{slot_row.dtype} {tuple(slot_row.shape)}")
    if len({t.device for t in (pool, x, topk_ids, slot_row, topk_weights)}) != 1:
        raise ValueError("pool, x, topk_ids, slot_row and topk_weights must be on one device")
    if combine not in COMBINES:
        raise ValueError(f"unknown combine {combine!r}; supported: {', '.join(COMBINES)}")
    if pool.shape[0] == 0:
        raise ValueError("the slot pool is empty")
    extent = max(getattr(layout, "off_" + c) + layout.nbytes(c) for c in COMPONENTS)  # bytes a record read may touch
    if host_base < 0 or host_stride < 0 or host_base % 16 or (host_base and (host_stride < extent or host_stride % 16)):
        raise ValueError(f"host_base {host_base:#x} must be >= 0 and 16-byte aligned; with host_base != 0, "
                         f"host_stride {host_stride} must be a multiple of 16 and >= the record extent {extent}")
    mapped = host_base != 0
    host_stride = host_stride if mapped else 0  # one compiled variant for all unmapped calls
    k, I, dev = topk_ids.shape[1], layout.inter, x.device
    P = T * k
    b = {**DECODE_BLOCKS, **(blocks or {})}
    bk_gu, bk_d = _fit_block_k(b["BLOCK_K"], H), _fit_block_k(b["BLOCK_K"], I)
    if T == 0 or k == 0:
        return torch.zeros(T, H, dtype=torch.float32, device=dev)
    xb = x.to(torch.bfloat16).contiguous()
    ids = topk_ids.contiguous()
    row = slot_row.contiguous()
    wts = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(P, I, dtype=torch.bfloat16, device=dev)
    interp = dev.type != "cuda"  # only the interpreter runs kernels on CPU tensors
    nw = b["num_warps"]
    _gate_up_pairs_kernel[(P, triton.cdiv(I, b["BLOCK_N_GU"]))](
        pool, layout.stride, host_base, host_stride, xb, act, ids, row, k, H, I,
        layout.off_gate_up, layout.off_gate_up_scale, layout.off_gate_up_scale_2,
        BLOCK_N=b["BLOCK_N_GU"], BLOCK_K=bk_gu, INTERP=interp, MAPPED=mapped, num_warps=nw,
    )
    offs = (layout.off_down, layout.off_down_scale, layout.off_down_scale_2)
    if combine == "tokens":
        out = torch.empty(T, H, dtype=torch.float32, device=dev)
        _down_tokens_kernel[(T, triton.cdiv(H, b["BLOCK_N_D"]))](
            pool, layout.stride, host_base, host_stride, act, out, wts, ids, row, H, I, *offs,
            TOPK=k, BLOCK_N=b["BLOCK_N_D"], BLOCK_K=bk_d, MAPPED=mapped, num_warps=nw,
        )
        return out
    out = torch.empty(P, H, dtype=torch.float32, device=dev)
    _down_pairs_kernel[(P, triton.cdiv(H, b["BLOCK_N_D"]))](
        pool, layout.stride, host_base, host_stride, act, out, wts, ids, row, H, I, *offs,
        BLOCK_N=b["BLOCK_N_D"], BLOCK_K=bk_d, MAPPED=mapped, num_warps=nw,
    )
    return out.view(T, k, H).sum(1)


def check_resident(topk_ids: torch.Tensor, slot_row: torch.Tensor) -> None:
    """Debug check (syncs: never on the hot path): every routed expert has a slot, else ValueError."""
    ids = topk_ids.reshape(-1).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= slot_row.shape[0]):
        raise ValueError(f"topk_ids outside [0, {slot_row.shape[0]})")
    missing = torch.unique(ids[slot_row[ids] < 0]).tolist()
    if missing:
        raise ValueError(f"experts {missing} are routed but not resident; the device-planned path needs residency")
