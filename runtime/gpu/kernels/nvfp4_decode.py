"""Device-planned FP4 MoE for decode: routing and the expert -> slot lookup never leave the device (NVFP4 records,
and MXFP4 ones with gpt-oss's biases and clamped SwiGLU: the format is a constexpr, `RecordLayout.kernel_args`).

The host-planned tile kernels (`host_plan.py`) need the routing on the host (`plan_blocks` groups pairs by slot), one
host sync per MoE layer. Here the launch grid depends on shapes only: for T tokens and top-k, P = T*k pairs,

    gate_up: grid (P, cdiv(I, BN_GU))   program (p, n-tile): act[p, n] = bf16(act(g, u)) for the BN gate rows n and
                                        BN up rows I + n of expert ids[p] (slot slot_row[ids[p]]) against x[p // k]
    down:    grid (T, cdiv(H, BN_D))    combine="tokens" (default): out[t, n] = sum_j w[t, j] * down_j[n] . act[t*k+j]
                                        for the k pairs of token t in one program, summed in a fixed order
             grid (P, cdiv(H, BN_D))    combine="pairs": out[p] = w[p] * down(act[p]), then a torch sum over k
No `.cpu()`, `.item()` or data-dependent shape anywhere, so a call can be captured in a CUDA graph. "tokens" is two
launches per call and nothing else (weights of any float dtype are converted in the kernel, no sum kernel).

Each program reads its weight rows over the whole K (or a few unrolled K chunks, `BLOCK_K_*`) as wide independent
loads and decodes them in registers with about 4 instructions per weight in the inner loop (`nvfp4_gemv.rows_dot`:
layout, arithmetic, numerics). It is a GEMV, not a `tl.dot` tile that would be 15/16 padding at one row per expert.
Meant for small P (decode, P <= 64 in `device_path.MAX_DEVICE_PAIRS`); two pairs of one expert (T > 1) each read its
bytes, the second mostly from L2. Tiles are in `DECODE_BLOCKS`; `tools/bench_moe_decode.py` sweeps them on a GPU.

A pair whose slot is < 0 (expert not resident) is never read: every load of its record is masked off and it
contributes exactly 0 (its act row is written as 0). Callers guarantee residency; `check_resident` is a debug check
(it syncs) that raises instead.

Mapped reads (host_base != 0, "zero-copy"): such a pair reads expert e's record straight from the layer's bank at
the device address `host_base + e * host_stride` (same `RecordLayout` as a slot), so every pair is live. Such a
pair's record bytes cross the bus on every call (nothing is kept in VRAM; two pairs of one expert read it twice).
On CUDA the caller guarantees the bank is page-locked and mapped (cudaHostRegister / pinned with a device pointer)
and stays so for the call; on CPU under the interpreter any host address works. host_base == 0 compiles the
kernels without the host branch (the `MAPPED` constexpr).

Numerics: E2M1 and e4m3 decode from bits to the same values as `nvfp4_triton._weight_tile_k` (value * 2^-14, * 2^-8);
each code times its bf16 activation is exact in fp32, summed over the 16 codes of a scale block, times the block's
scale, summed over K; `scale_2 * 2^22` (2^22 for MXFP4) is applied to the fp32 accumulator, the biases added and the
gated activation rounded to bf16 by `_to_bf16`. So the result equals the host-planned kernel's up to fp32 rounding
order. Deterministic: no atomics, every sum (over K, over the k experts of a token, torch's sum for "pairs") runs in
a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_release, pdl_wait, pdl_wait_only

from .nvfp4_gemv import rows_dot
from .fp4_format import _gated, _row_bias, _row_scale
from .nvfp4_triton import _to_bf16
from ..record_layout import RecordLayout

# Tiles: BLOCK_N_* weight rows per program (gate_up: BN gate + BN up rows), BLOCK_K_* K elements per unrolled chunk
# (capped at K: whole-K tiles), WARPS_* warps. "BLOCK_K" / "num_warps" in a `blocks` dict set both kernels' values.
# The fastest at T = 1..8 of `tools/bench_moe_decode.py`'s sweep on an H200 at H 2048 / I 512 (Triton 3.6; the
# numbers are in benchmarks/gpu_full.md).
DECODE_BLOCKS = {"BLOCK_N_GU": 4, "BLOCK_K_GU": 512, "WARPS_GU": 4, "BLOCK_N_D": 8, "BLOCK_K_D": 256, "WARPS_D": 8}
COMBINES = ("tokens", "pairs")


@triton.jit
def _records(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, p_mask, MAPPED: tl.constexpr):
    # pairs p (a scalar or [GP]) -> (record base u8 pointers, live). Not MAPPED: live = p_mask & slot >= 0; a dead
    # pair's pointer is clamped to slot 0 and every load through it is masked off by the caller. MAPPED: a pair
    # without a slot reads the bank record at the int64 address host_base + e * host_stride; live = p_mask.
    e = tl.load(topk_ids + p, mask=p_mask, other=0).to(tl.int64)
    slot = tl.load(slot_row + e, mask=p_mask, other=-1)
    rec = pool + tl.maximum(slot, 0).to(tl.int64) * slot_stride
    if MAPPED:
        host = (host_base + e * host_stride).to(tl.pointer_type(tl.uint8))
        rec = tl.where(slot >= 0, rec, host)
        live = p_mask
    else:
        live = p_mask & (slot >= 0)
    return rec, live


@triton.jit
def _gate_up_kernel(
    pool, slot_stride, host_base, host_stride, x, act, topk_ids, slot_row, copied, topk, H, I,
    OFF_GU, OFF_GUS, OFF_GUS2, OFF_GUB, KB: tl.constexpr,
    BN: tl.constexpr, BKB: tl.constexpr, INTERP: tl.constexpr, MAPPED: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr, GPS: tl.constexpr, E8M0: tl.constexpr, S2: tl.constexpr, BIAS: tl.constexpr,
    SWIGLU: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    # act[p, n] = bf16(act(g, u)), g = row n, u = row I + n of gate_up applied to x[p // topk] (+ their biases);
    # 0 for a dead pair. EARLY: the previous kernel (mode mapped's copy) released this one only after its own
    # predecessors completed, and writes only the records of pairs with copied[p] == 1: the others start at once.
    p = tl.program_id(0)
    if EARLY:
        pdl_release(PDL)
        if tl.load(copied + p) == 1:
            pdl_wait_only(PDL)
    else:
        pdl_wait(PDL)
    n0 = tl.program_id(1) * BN
    r = tl.arange(0, 2 * BN)  # tile rows: gate rows n0 + r for r < BN, then up rows I + n0 + r - BN
    rows = (r % BN + (r // BN) * I + n0)[:, None]  # [2BN, 1]
    rec, live = _records(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, p >= 0, MAPPED)
    limit = I * live.to(tl.int32)  # a comparison, not `n_mask & live`: the interpreter mistypes that mask
    r_live = (r % BN + n0) < limit  # [2BN]
    x_live = tl.arange(0, 1)[None, :, None] < live.to(tl.int32)  # [1, 1, 1]
    xrow = x + (p // topk).to(tl.int64) * H
    v = rows_dot(rec, OFF_GU, OFF_GUS, rows[:, :, None], r_live[:, None, None], xrow, x_live, KB, 2 * BN, 1, BKB,
                 not INTERP, GPS, E8M0)  # [2BN, 1]
    v = v * _row_scale(rec, OFF_GUS2, rows, r_live[:, None], S2) + _row_bias(rec, OFF_GUB, rows, r_live[:, None], BIAS)
    v = tl.reshape(v, [2, BN])  # [2BN, 1] -> gate [BN], up [BN]
    half = tl.arange(0, 2)[:, None]
    g = tl.sum(tl.where(half == 0, v, 0.0), axis=0)
    u = tl.sum(tl.where(half == 1, v, 0.0), axis=0)
    n = n0 + tl.arange(0, BN)
    a = _gated(g, u, SWIGLU, ALPHA, LIMIT)
    a = tl.where(n < limit, a, 0.0)
    tl.store(act + p.to(tl.int64) * I + n, _to_bf16(a, INTERP), mask=n < I)


@triton.jit
def _down_kernel(
    pool, slot_stride, host_base, host_stride, act, out, pair_weight, topk_ids, slot_row, G, H, I,
    OFF_D, OFF_DS, OFF_DS2, OFF_DB, KB: tl.constexpr,
    GP: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr,
    INTERP: tl.constexpr, MAPPED: tl.constexpr, PDL: tl.constexpr,
    GPS: tl.constexpr, E8M0: tl.constexpr, S2: tl.constexpr, BIAS: tl.constexpr,
):
    # out[g, n] = sum over j < G of weight[g*G + j] * ((down row n of pair g*G + j) . act[g*G + j] + bias[n])
    # (fp32 [*, H])
    pdl_wait(PDL)
    g = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, GP)
    p = g * G + j  # [GP]
    rec, live = _records(pool, slot_stride, host_base, host_stride, topk_ids, slot_row, p, j < G, MAPPED)
    m2 = (n < H)[:, None] & live[None, :]  # [BN, GP]
    xrow = act + p.to(tl.int64)[None, :, None] * I
    v = rows_dot(rec[None, :, None], OFF_D, OFF_DS, n[:, None, None], m2[:, :, None], xrow, live[None, :, None],
                 KB, BN, GP, BKB, not INTERP, GPS, E8M0)  # [BN, GP]
    v = v * _row_scale(rec[None, :], OFF_DS2, n[:, None], m2, S2) + _row_bias(rec[None, :], OFF_DB, n[:, None], m2,
                                                                              BIAS)
    w = tl.load(pair_weight + p, mask=live, other=0.0).to(tl.float32)
    res = tl.where(m2, v * w[None, :], 0.0)
    tl.store(out + g.to(tl.int64) * H + n, tl.sum(res, axis=1), mask=n < H)


def decode_blocks(blocks: dict[str, int] | None = None) -> dict[str, int]:
    """`DECODE_BLOCKS` updated by `blocks` (its "BLOCK_K" / "num_warps" set both kernels' values)."""
    b = dict(DECODE_BLOCKS)
    blocks = dict(blocks or {})
    if "BLOCK_K" in blocks:
        b["BLOCK_K_GU"] = b["BLOCK_K_D"] = blocks.pop("BLOCK_K")
    if "num_warps" in blocks:
        b["WARPS_GU"] = b["WARPS_D"] = blocks.pop("num_warps")
    unknown = set(blocks) - set(b)
    if unknown:
        raise ValueError(f"unknown decode block keys {sorted(unknown)}; known: {sorted(b)}, BLOCK_K, num_warps")
    b.update(blocks)
    return b


def _words(block_k: int, K: int) -> int:
    # u64 code words (16 weights each) per K chunk: a power of two, at most enough for the whole K
    return max(1, min(triton.next_power_of_2(max(1, block_k // 16)), triton.next_power_of_2(K // 16)))


def moe_nvfp4_device(
    pool: torch.Tensor,
    layout: RecordLayout,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    slot_row: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    blocks: dict[str, int] | None = None,
    combine: str = "tokens",
    host_base: int = 0,
    host_stride: int = 0,
    out_dtype: torch.dtype = torch.float32,
    copied: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert mixture with device-side routing. Host work depends on shapes only (no sync).

    pool u8 [S, stride]; x [T, H] (cast to bf16); topk_ids int [T, k]; slot_row int32 [E] (expert -> slot of this
    layer, -1 = not resident: that pair contributes 0); topk_weights float [T, k]; all on one device.
    host_base: 0, or the device address of this layer's bank (expert e's record at host_base + e * host_stride,
    16-byte aligned, page-locked and mapped on CUDA): then a pair without a slot reads its record from there.
    blocks: tile overrides (see `DECODE_BLOCKS`); combine: "tokens" (fused sum over k) or "pairs" (torch sum).
    Returns [T, H] = sum over pairs with a slot (all pairs when host_base != 0) of weight * expert(x), summed in fp32
    and stored as `out_dtype` (combine "tokens": the down kernel rounds its fp32 sum on the store, so a caller that
    wants the compute dtype needs no cast launch; "pairs" always sums in fp32 first).
    copied: int32 [T * k] from mode mapped's gather, launched just before (`gather.py`): its copy writes the records
    of the pairs marked 1, and the gate_up programs of the other pairs run without waiting for it (same result).
    """
    check_moe_args(pool, layout, x, topk_ids, slot_row, topk_weights)
    T, H = x.shape
    if combine not in COMBINES:
        raise ValueError(f"unknown combine {combine!r}; supported: {', '.join(COMBINES)}")
    if pool.shape[0] == 0:
        raise ValueError("the slot pool is empty")
    extent = layout.extent  # bytes a record read may touch
    if host_base < 0 or host_stride < 0 or host_base % 16 or (host_base and (host_stride < extent or host_stride % 16)):
        raise ValueError(f"host_base {host_base:#x} must be >= 0 and 16-byte aligned; with host_base != 0, "
                         f"host_stride {host_stride} must be a multiple of 16 and >= the record extent {extent}")
    b = decode_blocks(blocks)
    T, k = topk_ids.shape
    if T == 0 or k == 0:
        return torch.zeros(T, H, dtype=out_dtype, device=x.device)
    host = (host_base, host_stride if host_base else 0)  # one compiled variant for all unmapped calls
    xb = x.to(torch.bfloat16).contiguous()
    if xb.data_ptr() % 16:  # activations are read as u64 words
        xb = xb.clone()
    ids, row = topk_ids.contiguous(), slot_row.contiguous()
    if copied is not None and (copied.dtype != torch.int32 or copied.numel() != T * k):
        raise ValueError(f"copied must be int32 [{T * k}] (a flag per pair), got {copied.dtype} {tuple(copied.shape)}")
    act = launch_gate_up(pool, layout, xb, ids, row, host, b, copied=copied)
    out = launch_down(pool, layout, act, topk_weights.reshape(-1).contiguous(), ids, row, host, b, combine,
                      out_dtype=out_dtype if combine == "tokens" else torch.float32)
    return out if combine == "tokens" else out.view(T, k, H).sum(1).to(out_dtype)


def launch_gate_up(pool, layout: RecordLayout, xb: torch.Tensor, ids: torch.Tensor, row: torch.Tensor,
                   host: tuple[int, int], b: dict[str, int], info: dict | None = None,
                   copied: torch.Tensor | None = None) -> torch.Tensor:
    """The gate_up kernel alone (checked inputs: xb bf16 [T, H] 16-byte aligned, ids [T, k], host (base, stride),
    b a full `decode_blocks` dict, copied as `moe_nvfp4_device`'s) -> act bf16 [T*k, I]. info: gets the compiled
    kernel under "gate_up"."""
    (T, k), H, I = ids.shape, layout.hidden, layout.inter
    act = torch.empty(T * k, I, dtype=torch.bfloat16, device=xb.device)
    interp = xb.device.type != "cuda"  # only the interpreter runs kernels on CPU tensors
    kernel = _gate_up_kernel[(T * k, triton.cdiv(I, b["BLOCK_N_GU"]))](
        pool, layout.stride, host[0], host[1], xb, act, ids, row, row if copied is None else copied, k, H, I,
        layout.off_gate_up, layout.off_gate_up_scale, KB=H // 16, BN=b["BLOCK_N_GU"],
        BKB=_words(b["BLOCK_K_GU"], H), INTERP=interp, MAPPED=host[0] != 0, EARLY=copied is not None,
        num_warps=b["WARPS_GU"],
        **layout.kernel_args("gate_up"), **pdl_args(xb.device),
    )
    if info is not None:
        info["gate_up"] = kernel
    return act


def launch_down(pool, layout: RecordLayout, act: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor,
                row: torch.Tensor, host: tuple[int, int], b: dict[str, int], combine: str,
                info: dict | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The down kernel alone (act bf16 [T*k, I] from `launch_gate_up`, wts float [T*k]) -> fp32 [T, H] for
    combine "tokens", [T*k, H] (weighted, not summed over k) for "pairs". info: gets the kernel under "down"."""
    (T, k), H, I = ids.shape, layout.hidden, layout.inter
    groups, G = (T, k) if combine == "tokens" else (T * k, 1)
    out = torch.empty(groups, H, dtype=out_dtype, device=act.device)  # the store rounds the fp32 sum
    kernel = _down_kernel[(groups, triton.cdiv(H, b["BLOCK_N_D"]))](
        pool, layout.stride, host[0], host[1], act, out, wts, ids, row, G, H, I,
        layout.off_down, layout.off_down_scale, KB=I // 16, GP=triton.next_power_of_2(G), BN=b["BLOCK_N_D"],
        BKB=_words(b["BLOCK_K_D"], I), INTERP=act.device.type != "cuda", MAPPED=host[0] != 0, num_warps=b["WARPS_D"],
        **layout.kernel_args("down"), **pdl_args(act.device),
    )
    if info is not None:
        info["down"] = kernel
    return out


def check_moe_args(pool, layout: RecordLayout, x, topk_ids, slot_row, topk_weights) -> None:
    """The shapes, dtypes and devices every device-routed MoE call (decode here, prefill in `prefill_plan.py`)
    needs; ValueError naming what is off."""
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


def check_resident(topk_ids: torch.Tensor, slot_row: torch.Tensor) -> None:
    """Debug check (syncs: never on the hot path): every routed expert has a slot, else ValueError."""
    ids = topk_ids.reshape(-1).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= slot_row.shape[0]):
        raise ValueError(f"topk_ids outside [0, {slot_row.shape[0]})")
    missing = torch.unique(ids[slot_row[ids] < 0]).tolist()
    if missing:
        raise ValueError(f"experts {missing} are routed but not resident; the device-planned path needs residency")
