"""Mode mapped's miss path on the device: plan where each missing record goes, then copy it from mapped host memory.

One decode call of one MoE layer, P = T * k routed pairs (P <= 64), with no host involvement (CUDA-graph safe):

1. `_plan_kernel` (one program): a pair whose expert has a slot in the device table reads it (a hit); a miss whose
   expert was prefetched (below) reads the prefetch row; any other miss goes to staging row `staging0 + p` (read
   once, not admitted: admission is the host's, a step later). It writes the call's record (int32 [4, W]: row 0 the
   expert ids, row 1 `pair_slot`, the row each pair's kernel reads, row 2 `pair_copy`, 1 = its record must be copied
   there, 3 = it was prefetched; the CPU lane may turn a 1 into 2 = computed on the CPU, not copied: `cpu/lane.py`;
   row 3 the experts prefetched for the call, -1 after them), which is also what the host reads back a step later
   (`mapped_readback.py`).
2. `_copy_kernel`, grid (P, chunks): copies the records of the pairs with `pair_copy` 1, 32 KiB per program in 4 KiB
   loads, so enough independent reads are in flight to fill the link (run M: 50.2 GB/s against 54 for copy-engine
   H2D; the GEMV kernel reading records in place reached 30).

Both launch with PDL (`pdl.py`), as the decode step's other kernels: without it each would wait for its predecessor
to drain before launching, and hold its successor back the same way. Then the resident kernel runs over `pair_slot`
(`moe_nvfp4_device` with topk_ids = arange(P) and `copied` = `pair_copy`): the copy lets it launch once everything
before the copy has completed, and its gate_up programs of pairs not being copied (hits, the CPU's) run during the
copy; only those of copied pairs wait for it. Every miss crosses the bus once. `plan_reference` is the PyTorch
reference of step 1 (the CPU emulation runs it; tests compare the kernel with it).

Prefetch (`prefetch_missing`, `OffloadConfig.prefetch` = M > 0): on a side stream, while the MoE layer before it
still computes, the layer's router applied to that layer's residual guesses its top-k (`gpu/prefetch.py`);
`_prefetch_kernel` (one program) takes the first M distinct guessed experts without a slot, every token's first
choice before any token's second, and `_copy_kernel` copies them into the layer's M prefetch rows. The layer's own
plan then reads a miss from its prefetch row when the guess was right, so the link works while the layer before
computes instead of after the router.
A wrong guess costs link time only: the plan stages and copies what was not prefetched, as without prefetch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..record_layout import RecordLayout
from .pdl import pdl_args, pdl_release, pdl_wait, pdl_wait_only

COPY_CHUNK, COPY_BLOCK = 4096, 512  # 8-byte words per program (32 KiB) and per load (4 KiB)
MAX_PREFETCH = 8  # records per prefetch: the link moves two to four while the layer before computes


@triton.jit
def _plan_kernel(ids, table, entry, pre_ids, pre_rows, layer, E, P, W, staging0, M,
                 HAS_PRE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rp = tl.arange(0, BLOCK_P)
    valid = rp < P
    row = table + layer * E  # no .to() on scalar arguments: Triton turns an argument equal to 1 into a constant
    e = tl.load(ids + rp, mask=valid, other=0).to(tl.int64)
    s = tl.load(row + e, mask=valid, other=-1)
    dst = tl.where(s >= 0, s, staging0 + rp)
    how = (s < 0).to(tl.int32)
    fetched = tl.full([BLOCK_P], -1, tl.int32)
    if HAS_PRE:  # a miss whose expert was prefetched reads its prefetch row (the ids are distinct: one match)
        rm = tl.arange(0, BLOCK_M)
        pe = tl.load(pre_ids + rm, mask=rm < M, other=-1)                              # [BM] int64
        pr = tl.load(pre_rows + rm, mask=rm < M, other=0)                              # [BM] int32
        match = (e[:, None] == pe[None, :]) & (pe[None, :] >= 0)                       # [BP, BM]
        got = (tl.max(match.to(tl.int32), axis=1) > 0) & (s < 0)
        dst = tl.where(got, tl.sum(tl.where(match, pr[None, :], 0), axis=1), dst)
        how = tl.where(got, 3, how)
        fetched = tl.load(pre_ids + rp, mask=rp < M, other=-1).to(tl.int32)
    tl.store(entry + rp, e.to(tl.int32), mask=valid)
    tl.store(entry + W + rp, dst, mask=valid)
    tl.store(entry + 2 * W + rp, how, mask=valid)
    tl.store(entry + 3 * W + rp, fetched, mask=rp < W)


@triton.jit
def _prefetch_kernel(ids, table, pre_ids, pre_rows, pre_copy, layer, E, T, K, M, row0,
                     BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    # q runs over the guessed pairs in choice order: every token's first choice (q < T), then every second, ...
    pdl_wait(PDL)
    q = tl.arange(0, BLOCK_P)
    valid = q < T * K
    e = tl.load(ids + (q % T) * K + q // T, mask=valid, other=-1).to(tl.int64)
    s = tl.load(table + layer * E + e, mask=valid, other=0)
    miss = valid & (s < 0)
    earlier = (e[:, None] == e[None, :]) & (q[None, :] < q[:, None]) & miss[None, :]  # [BP, BP]: a miss before q
    take = miss & (tl.max(earlier.to(tl.int32), axis=1) == 0)                           # names the same expert
    rank = tl.cumsum(take.to(tl.int32), axis=0) - 1
    rm = tl.arange(0, BLOCK_M)
    at = take[None, :] & (rank[None, :] == rm[:, None])                                # [BM, BP]: the r-th taken
    found = tl.max(at.to(tl.int32), axis=1) > 0
    tl.store(pre_ids + rm, tl.where(found, tl.sum(tl.where(at, e[None, :], 0), axis=1), -1), mask=rm < M)
    tl.store(pre_rows + rm, row0 + rm, mask=rm < M)
    tl.store(pre_copy + rm, found.to(tl.int32), mask=rm < M)


@triton.jit
def _copy_kernel(pool, slot_stride, host_base, host_stride, ids, pair_slot, pair_copy, words,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # pdl_wait in the other order: the MoE kernel after it launches only once everything before the copy has
    # completed, so its programs of pairs the copy does not write may skip their wait (`_gate_up_kernel`'s EARLY)
    pdl_wait_only(PDL)
    pdl_release(PDL)
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


def _check(pool, layout, topk_ids, host_base, host_stride, staging0, rows: int | None = None) -> int:
    P = topk_ids.numel()
    rows = P if rows is None else rows
    extent = layout.extent
    if host_base < 0 or host_base % 16 or host_stride % 16 or host_stride < extent:
        raise ValueError(f"gather needs a 16-byte aligned mapped bank address (0: none) and stride >= {extent}")
    if not 0 < P <= 64:
        raise ValueError(f"gather plans 1..64 pairs per call, got {P}")
    if staging0 < 0 or staging0 + rows > pool.shape[0]:
        raise ValueError(f"staging rows {staging0}..{staging0 + rows - 1} are outside the pool of {pool.shape[0]} "
                         "rows")
    return -(-extent // 8)


class Prefetch:
    """The device buffers of one prefetch (`prefetch_missing` writes them, the next plan reads them): ids int64
    [MAX_PREFETCH] (-1: none), rows and copy flags int32 [2, 16] (16: each row 16-byte aligned, as a record's rows,
    so the copy kernel is the gather's own); m <= MAX_PREFETCH rows from `row0` on."""

    def __init__(self, device, m: int, row0: int) -> None:
        if not 0 < m <= MAX_PREFETCH:
            raise ValueError(f"prefetch takes 1..{MAX_PREFETCH} records per call, got {m}")
        self.m, self.row0 = m, row0
        self.ids = torch.full((MAX_PREFETCH,), -1, dtype=torch.int64, device=device)
        self.rows_copy = torch.zeros(2, 16, dtype=torch.int32, device=device)


def prefetch_missing(pool: torch.Tensor, layout: RecordLayout, guess_ids: torch.Tensor, table: torch.Tensor,
                     layer: int, host_base: int, host_stride: int, pre: Prefetch, *, between=None) -> None:
    """Copy the records of up to `pre.m` guessed experts of `layer` without a slot (guess_ids [T, k], a router's
    top-k) into rows pre.row0 .. pre.row0 + m - 1, recording which in `pre` (the module docstring's Prefetch).
    `between()` runs after the choice is written and before the copy (`prefetch.py` marks the ids ready there)."""
    words = _check(pool, layout, guess_ids, host_base, host_stride, pre.row0, pre.m)
    if host_base == 0:
        raise ValueError("prefetch needs a mapped bank")
    T, k = guess_ids.shape
    rows, copy = pre.rows_copy[0], pre.rows_copy[1]
    _prefetch_kernel[(1,)](guess_ids, table, pre.ids, rows, copy, layer, table.shape[1], T, k, pre.m, pre.row0,
                           BLOCK_M=MAX_PREFETCH, BLOCK_P=64, num_warps=1, **pdl_args(pool.device))
    if between is not None:
        between()
    _copy_kernel[(pre.m, triton.cdiv(words, COPY_CHUNK))](
        pool, layout.stride, host_base, host_stride, pre.ids, rows, copy, words,
        CHUNK=COPY_CHUNK, BLOCK=COPY_BLOCK, num_warps=4, **pdl_args(pool.device))


def prefetch_reference(guess_ids: torch.Tensor, table: torch.Tensor, layer: int, m: int) -> list[int]:
    """`_prefetch_kernel`'s choice in Python: the first m distinct experts without a slot, in choice order."""
    T, k = guess_ids.shape
    out: list[int] = []
    for e in guess_ids.t().reshape(-1).tolist():
        if len(out) < m and int(table[layer, e]) < 0 and e not in out:
            out.append(e)
    return out


def gather_missing(pool: torch.Tensor, layout: RecordLayout, topk_ids: torch.Tensor, table: torch.Tensor, layer: int,
                   host_base: int, host_stride: int, staging0: int, *, between=None,
                   entry: torch.Tensor | None = None, pre: Prefetch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan and copy one call's misses (module docstring) -> (pair_slot, pair_copy), int32 [P] each: rows 1 and 2 of
    the call's record `entry` (int32 [4, W >= P] on the device, made if not given; row 0 gets the expert ids, row 3
    the prefetched ones). `pre`: the prefetch made for this call (`prefetch_missing`, completed before this runs).

    pool u8 [rows, stride]; topk_ids [T, k]; table int32 [L, E]; host_base: the device address of this layer's mapped
    bank (expert e at host_base + e * host_stride). Rows staging0 .. staging0 + P - 1 must be free for this call's
    kernels. `between(pair_slot, pair_copy)` launches work after the plan and before the copies (the CPU lane's post,
    which takes misses off the copy list). host_base 0: the bank is not mapped, nothing is copied, and `between` must
    take every miss."""
    words = _check(pool, layout, topk_ids, host_base, host_stride, staging0)
    P = topk_ids.numel()
    ids = topk_ids.reshape(-1).contiguous()
    if entry is None:
        entry = torch.empty(4, P, dtype=torch.int32, device=pool.device)
    pair_slot, pair_copy = entry[1, :P], entry[2, :P]
    _plan_kernel[(1,)](ids, table, entry, ids if pre is None else pre.ids, entry if pre is None else pre.rows_copy,
                       layer, table.shape[1], P, entry.stride(0), staging0, 0 if pre is None else pre.m,
                       HAS_PRE=pre is not None, BLOCK_M=MAX_PREFETCH, BLOCK_P=64, num_warps=1, **pdl_args(pool.device))
    if between is not None:
        between(pair_slot, pair_copy)
    if host_base == 0:  # no mapping: `between` took every staged miss (the CPU lane's lane-only layers)
        return pair_slot, pair_copy
    _copy_kernel[(P, triton.cdiv(words, COPY_CHUNK))](
        pool, layout.stride, host_base, host_stride, ids, pair_slot, pair_copy, words,
        CHUNK=COPY_CHUNK, BLOCK=COPY_BLOCK, num_warps=4, **pdl_args(pool.device))
    return pair_slot, pair_copy


def plan_reference(topk_ids: torch.Tensor, table: torch.Tensor, layer: int, staging0: int,
                   prefetched: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring in PyTorch -> (pair_slot, pair_copy); `prefetched`: expert -> its row."""
    ids = topk_ids.reshape(-1).long()
    slot = table[layer].long()[ids]
    staged = staging0 + torch.arange(ids.numel())
    pair_slot, how = torch.where(slot >= 0, slot, staged), (slot < 0).to(torch.int32)
    for p, e in enumerate(ids.tolist()):
        if slot[p] < 0 and prefetched and e in prefetched:
            pair_slot[p], how[p] = prefetched[e], 3
    return pair_slot.to(torch.int32), how
