"""Host-planned NVFP4 MoE: the routing is on the host (host-planned calls bring it there for the cache), so the
block plan of the tile kernels (`nvfp4_triton.moe_blocks`) is built with numpy. Resident prefill plans on the device
instead (`prefill_plan.py`); both plans have one format: pairs grouped by slot into blocks of BLOCK_M rows, padded
with the sentinel P, one slot per block.
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels.nvfp4_triton import moe_blocks, pick_blocks
from .record_layout import RecordLayout


def plan_blocks(pair_slots: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Group pairs by slot on the host. pair_slots int [P] (-1 = pair not computed here).

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


def moe_nvfp4(
    pool: torch.Tensor,
    layout: RecordLayout,
    x: torch.Tensor,
    pair_slots: np.ndarray,
    topk_weights: torch.Tensor,
    blocks: dict[str, int] | None = None,
    pair_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert mixture over the pairs whose slot is >= 0, planned on the host.

    pool u8 [S, stride] (same device as x); x bf16 [T, H]; pair_slots int [T*k] host array; topk_weights [T, k].
    Returns fp32 [T, H] = sum over computed pairs of weight * expert(x). Pairs with slot -1 contribute nothing, so
    partial sums from other devices add exactly.
    pair_out: fp32 [T*k, H] to write the computed pairs' rows into (other rows untouched); it is returned instead,
    not summed over k. Calls over disjoint pairs with the same `blocks` then fill it exactly as one call would.
    """
    T, H = x.shape
    k = topk_weights.shape[1]
    if H != layout.hidden or pool.dtype != torch.uint8 or pool.shape[1] != layout.stride:
        raise ValueError(f"pool [S, {layout.stride}] u8 and x [T, {layout.hidden}] expected, got "
                         f"{tuple(pool.shape)} {tuple(x.shape)}")
    pair_slots = np.asarray(pair_slots).reshape(-1)
    live = pair_slots[pair_slots >= 0]
    out = pair_out if pair_out is not None else torch.zeros(T * k, H, dtype=torch.float32, device=x.device)
    if pair_out is not None and (tuple(out.shape) != (T * k, H) or out.dtype != torch.float32):
        raise ValueError(f"pair_out must be fp32 [{T * k}, {H}], got {out.dtype} {tuple(out.shape)}")
    if live.size:
        b = blocks or pick_blocks(live.size / len(np.unique(live)), H, layout.inter)
        sorted_pairs, block_slot = plan_blocks(pair_slots, b["BLOCK_M"])
        dev = x.device
        sp = torch.from_numpy(sorted_pairs).to(dev, non_blocking=True)
        bs = torch.from_numpy(block_slot).to(dev, non_blocking=True)
        wts = topk_weights.reshape(-1).to(torch.float32).contiguous()
        moe_blocks(pool, layout, x.to(torch.bfloat16).contiguous(), k, sp, bs, wts, out, b)
    return out if pair_out is not None else out.view(T, k, H).sum(1)
