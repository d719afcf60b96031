"""Device-planned NVFP4 MoE for prefill: the pairs are grouped by expert on the device, with no host sync.

The host-planned call (`host_plan.moe_nvfp4`) brings the routing to the host to build its block plan. Here, for a
layer whose routed experts have slots in `slot_row` (mode resident, static's GPU layers), the same plan is built with
torch ops on the device, sized by shapes only, so a prefill chunk never waits for the host:

    P = T * k pairs (pair p = t * k + j), E experts, BM = BLOCK_M
    key[p]      = topk_ids[p] if slot_row[topk_ids[p]] >= 0 else E       (E: the bucket of pairs without a slot)
    order       = stable argsort of key; bounds[e] = first sorted position of bucket e (searchsorted), bounds[E+1] = P
    nblk[e]     = cdiv(bounds[e+1] - bounds[e], BM);  blk_start = exclusive cumsum of nblk
    sorted position i of bucket e  ->  padded row blk_start[e] * BM + (i - bounds[e])
    block b     ->  bucket e = #{e : blk_end[e] <= b};  slot_row[e] for e < E, else -1

Upper bound on the number of blocks, used as the plan's (and the grid's) fixed size:
    sum_e cdiv(c_e, BM) <= sum_e (c_e + BM - 1) / BM <= P / BM + n (BM - 1) / BM,  n = nonempty buckets <= min(E+1, P)
    so NB = cdiv(P, BM) + min(E + 1, P) always suffices. Blocks past the used ones get slot -1 and only padding rows
    (sentinel P): the kernels exit at once for them. A bucket-E block (pairs without a slot) has slot -1 too: the
    down kernel writes zeros to its pairs' rows and reads no record, so every row of the [P, H] output is written
    and no zero fill is needed.
Experts ascend, so one expert's blocks are adjacent (its record stays hot in L2); the stable sort keeps pairs of an
expert in pair order, so the plan is a pure function of the routing (and equals `plan_blocks` when slots ascend with
experts). Every op here (index_select, sort, searchsorted, cumsum, scatter, pad) is asynchronous on CUDA.

The sum over k runs in torch in a fixed order (deterministic, no atomics); the kernels are those of
`nvfp4_triton.py`, so a pair's row is computed exactly as a host-planned call computes it with the same tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from .kernels.nvfp4_decode import check_moe_args
from .kernels.nvfp4_triton import moe_blocks, pick_blocks
from .record_layout import RecordLayout


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Fixed upper bound on the blocks of a plan of `num_pairs` pairs over `num_experts` experts (+ the dead bucket)."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts + 1, num_pairs)


def plan_blocks_device(topk_ids: torch.Tensor, slot_row: torch.Tensor,
                       block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group pairs by expert on the device (no sync). topk_ids int [T, k]; slot_row int32 [E] (-1 = no slot).

    Returns (sorted_pairs int32 [NB * block_m], padded with P; block_slot int32 [NB], -1 = no record), with
    NB = `max_blocks(P, E, block_m)`: the plan format of `host_plan.plan_blocks` at a size fixed by shapes.
    """
    ids = topk_ids.reshape(-1).long()
    E = slot_row.shape[0]
    slot = slot_row.index_select(0, ids)  # [P]
    sorted_pairs, bucket = plan_by_expert(torch.where(slot >= 0, ids, E), E, block_m)
    return sorted_pairs, F.pad(slot_row, (0, 2), value=-1).index_select(0, bucket)  # buckets E, E+1 -> -1


def plan_by_expert(key: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouping above for bucket keys int [T, k] (or [P]) in [0, E] -> (sorted_pairs int32 [NB * block_m],
    bucket int64 [NB]: each block's key; E + 1 for unused blocks). A caller gives the blocks their slots through
    any lookup of E + 2 entries indexed by `bucket` (`prefill_pipeline.py` runs one plan with several lookups)."""
    dev = key.device
    key = key.reshape(-1).long()
    P, E = key.numel(), num_experts
    nb = max_blocks(P, E, block_m)
    skey, order = torch.sort(key, stable=True)  # [P] bucket of each sorted position, its pair id
    bounds = torch.searchsorted(skey, torch.arange(E + 2, device=dev))  # [E+2] first position of each bucket
    nblk = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m  # [E+1] blocks per bucket
    blk_end = torch.cumsum(nblk, 0)  # [E+1]
    row0 = (blk_end - nblk) * block_m - bounds[:-1]  # padded row of sorted position i in bucket e: row0[e] + i
    dest = row0.index_select(0, skey) + torch.arange(P, device=dev)
    sorted_pairs = torch.full((nb * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    bucket = torch.searchsorted(blk_end, torch.arange(nb, device=dev), right=True)  # [NB] in [0, E+1]
    return sorted_pairs, bucket


def moe_nvfp4_prefill(
    pool: torch.Tensor,
    layout: RecordLayout,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    slot_row: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    blocks: dict[str, int] | None = None,
) -> torch.Tensor:
    """Expert mixture with a device-built plan (no host sync; host work depends on shapes only).

    pool u8 [S, stride]; x [T, H] (cast to bf16); topk_ids int [T, k]; slot_row int32 [E] (expert -> slot of this
    layer, -1 = none: that pair contributes 0); topk_weights [T, k]; all on one device.
    blocks: a tile configuration (`nvfp4_triton.TILE_CONFIGS`); None picks by P / min(E, P) rows per expert.
    Returns fp32 [T, H] = sum over pairs with a slot of weight * expert(x), summed over k in order j = 0..k-1.
    """
    check_moe_args(pool, layout, x, topk_ids, slot_row, topk_weights)
    T, H = x.shape
    k = topk_ids.shape[1]
    P, E = T * k, slot_row.shape[0]
    if P == 0:
        return torch.zeros(T, H, dtype=torch.float32, device=x.device)
    b = blocks or pick_blocks(P / min(E, P), H, layout.inter)
    sorted_pairs, block_slot = plan_blocks_device(topk_ids, slot_row.contiguous(), b["BLOCK_M"])
    out = torch.empty(P, H, dtype=torch.float32, device=x.device)  # every row written (dead pairs: 0)
    wts = topk_weights.reshape(-1).to(torch.float32).contiguous()
    moe_blocks(pool, layout, x.to(torch.bfloat16).contiguous(), k, sorted_pairs, block_slot, wts, out, b)
    return out.view(T, k, H).sum(1)
