"""Mode mapped's miss path on the device: plan where each missing record goes, then copy it from mapped host memory.

One decode call of one MoE layer, P = T * k routed pairs (P <= 64), with no host involvement (CUDA-graph safe):

1. `_plan_kernel` (one program, pairs in order): a pair whose expert has a slot in the device table reads it (a
   hit). A missing expert takes the next usable *fill candidate* of this layer, if any: a slot the host offered
   (`candidates` int32 [2, R]: slots and the owner the host believes each holds). A candidate is usable when the
   device's owner mirror (`owner` int32 [S], flat ids layer * E + expert) still agrees with the host (a fill the host
   has not read back yet may have taken it since) and no hit of this call reads it. Taking it evicts the old owner
   and admits the new expert in the device table and owner mirror at once, so later calls (later layers, the next
   step) see it; a second pair of the same expert then hits it. A miss without a usable candidate goes to staging
   row `staging0 + p` (read once, not admitted). Out: `pair_slot` [P] (the row the pair's kernel reads) and
   `pair_copy` [P] (1 = its record must be copied there; every miss, filled or staged; the CPU lane may then turn a
   staged miss into 2 = computed on the CPU, not copied: `cpu_lane.py`).
2. `_copy_kernel`, grid (P, chunks): copies the records of the pairs with `pair_copy`, 32 KiB per program in 4 KiB
   loads, so enough independent reads are in flight to fill the link (run M: 50.2 GB/s against 54 for copy-engine
   H2D; the GEMV kernel reading records in place reached 30).

Then the resident kernel runs over `pair_slot` (`moe_nvfp4_device` with topk_ids = arange(P)). The host reads the
call's routing, `pair_slot` and `pair_copy` back a step later and mirrors each fill in its own table
(`ExpertCache.adopt`), so host and device tables agree without the host ever uploading over a device change.
Every miss crosses the bus once, and with candidates it also becomes a cache entry: admission costs no extra bytes.

`plan_reference` is the PyTorch reference of step 1 (the CPU emulation runs it; tests compare the kernel with it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .record_layout import COMPONENTS, RecordLayout

COPY_CHUNK, COPY_BLOCK = 4096, 512  # 8-byte words per program (32 KiB) and per load (4 KiB)


@triton.jit
def _plan_kernel(ids, table, owner, cand, pair_slot, pair_copy, layer, E, P, R, staging0,
                 BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    rp = tl.arange(0, BLOCK_P)
    rr = tl.arange(0, BLOCK_R)
    row = table + layer * E  # no .to() on scalar arguments: Triton turns an argument equal to 1 into a constant
    e_all = tl.load(ids + rp, mask=rp < P, other=0).to(tl.int64)
    s_all = tl.load(row + e_all, mask=rp < P, other=-1)
    cs = tl.load(cand + rr, mask=rr < R, other=-1)
    co = tl.load(cand + R + rr, mask=rr < R, other=-2)
    dev_owner = tl.load(owner + tl.maximum(cs, 0), mask=(rr < R) & (cs >= 0), other=-3)
    read_here = tl.sum(((cs[:, None] == s_all[None, :]) & (rp[None, :] < P)).to(tl.int32), axis=1)
    usable = (cs >= 0) & (dev_owner == co) & (read_here == 0)
    taken = tl.zeros([BLOCK_R], dtype=tl.int32)
    for p in range(P):
        tl.debug_barrier()  # the table stores of earlier pairs are visible to this pair's load
        e = tl.load(ids + p).to(tl.int64)
        s = tl.load(row + e)
        if s >= 0:
            tl.store(pair_slot + p, s)
            tl.store(pair_copy + p, 0)
        else:
            avail = usable & (taken == 0)
            j = tl.min(tl.where(avail, rr, BLOCK_R))
            if j < BLOCK_R:
                slot = tl.sum(tl.where(rr == j, cs, 0))
                old = tl.sum(tl.where(rr == j, co, 0))
                taken = tl.where(rr == j, 1, taken)
                if old >= 0:
                    tl.store(table + old, -1)  # the flat owner id indexes the [L, E] table
                tl.store(row + e, slot)
                tl.store(owner + slot, (layer * E + e).to(tl.int32))
                tl.store(pair_slot + p, slot)
            else:
                tl.store(pair_slot + p, staging0 + p)
            tl.store(pair_copy + p, 1)


@triton.jit
def _copy_kernel(pool, slot_stride, host_base, host_stride, ids, pair_slot, pair_copy, words,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(pair_copy + p) == 1:
        e = tl.load(ids + p).to(tl.int64)
        src = (host_base.to(tl.int64) + e * host_stride).to(tl.pointer_type(tl.int64))
        dst = (pool + tl.load(pair_slot + p).to(tl.int64) * slot_stride).to(tl.pointer_type(tl.int64))
        offs = tl.arange(0, BLOCK)
        for w0 in tl.static_range(0, CHUNK, BLOCK):
            w = c * CHUNK + w0 + offs
            tl.store(dst + w, tl.load(src + w, mask=w < words), mask=w < words)


def _check(pool, layout, topk_ids, host_base, host_stride, staging0) -> int:
    P = topk_ids.numel()
    extent = max(getattr(layout, "off_" + c) + layout.nbytes(c) for c in COMPONENTS)
    if host_base < 0 or host_base % 16 or host_stride % 16 or host_stride < extent:
        raise ValueError(f"gather needs a 16-byte aligned mapped bank address (0: none) and stride >= {extent}")
    if not 0 < P <= 64:
        raise ValueError(f"gather plans 1..64 pairs per call, got {P}")
    if staging0 < 0 or staging0 + P > pool.shape[0]:
        raise ValueError(f"staging rows {staging0}..{staging0 + P - 1} are outside the pool of {pool.shape[0]} rows")
    return -(-extent // 8)


def gather_missing(pool: torch.Tensor, layout: RecordLayout, topk_ids: torch.Tensor, table: torch.Tensor, layer: int,
                   host_base: int, host_stride: int, staging0: int, *, owner: torch.Tensor | None = None,
                   candidates: torch.Tensor | None = None, between=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan and copy one call's misses (module docstring) -> (pair_slot, pair_copy), int32 [P] each.

    pool u8 [rows, stride]; topk_ids [T, k]; table int32 [L, E] (updated in place by fills); host_base: the device
    address of this layer's mapped bank (expert e at host_base + e * host_stride). owner int32 [S] and candidates
    int32 [2, R] enable fills; without them every miss is staged. Rows staging0 .. staging0 + P - 1 must be free for
    this call's kernels. `between(pair_slot, pair_copy)` launches work after the plan and before the copies (the CPU
    lane's post, which takes misses off the copy list). host_base 0: the bank is not mapped, nothing is copied, and
    `between` must take every miss."""
    words = _check(pool, layout, topk_ids, host_base, host_stride, staging0)
    P, dev = topk_ids.numel(), pool.device
    ids = topk_ids.reshape(-1).contiguous()
    if candidates is None or owner is None:
        owner = torch.full((1,), -1, dtype=torch.int32, device=dev)
        candidates = torch.full((2, 1), -1, dtype=torch.int32, device=dev)
    R = candidates.shape[1]
    pair_slot = torch.empty(P, dtype=torch.int32, device=dev)
    pair_copy = torch.empty(P, dtype=torch.int32, device=dev)
    _plan_kernel[(1,)](ids, table, owner, candidates, pair_slot, pair_copy, layer, table.shape[1], P, R, staging0,
                       BLOCK_P=64, BLOCK_R=max(16, triton.next_power_of_2(R)), num_warps=1)
    if between is not None:
        between(pair_slot, pair_copy)
    if host_base == 0:  # no mapping: `between` took every staged miss (the CPU lane's lane-only layers)
        return pair_slot, pair_copy
    _copy_kernel[(P, triton.cdiv(words, COPY_CHUNK))](
        pool, layout.stride, host_base, host_stride, ids, pair_slot, pair_copy, words,
        CHUNK=COPY_CHUNK, BLOCK=COPY_BLOCK, num_warps=4)
    return pair_slot, pair_copy


def plan_reference(topk_ids: torch.Tensor, table: torch.Tensor, layer: int, staging0: int, *,
                   owner: torch.Tensor | None = None, candidates: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring in PyTorch (host loops; updates `table` / `owner` in place like the kernel)."""
    ids = topk_ids.reshape(-1).long().tolist()
    E = table.shape[1]
    row = table[layer]
    cs, co = (candidates.long().tolist() if candidates is not None and owner is not None else ([], []))
    hits = {int(row[e]) for e in ids if int(row[e]) >= 0}
    usable = [s >= 0 and int(owner[s]) == o and s not in hits for s, o in zip(cs, co)]
    slots, copy = [], []
    for p, e in enumerate(ids):
        s = int(row[e])
        if s >= 0:
            slots.append(s)
            copy.append(0)
            continue
        j = next((j for j, ok in enumerate(usable) if ok), None)
        if j is None:
            slots.append(staging0 + p)
        else:
            usable[j] = False
            slot, old = cs[j], co[j]
            if old >= 0:
                table.view(-1)[old] = -1
            row[e] = slot
            owner[slot] = layer * E + e
            slots.append(slot)
        copy.append(1)
    return torch.tensor(slots, dtype=torch.int32), torch.tensor(copy, dtype=torch.int32)
