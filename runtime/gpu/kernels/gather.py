"""Mode mapped's miss path on the device: plan where each missing record goes, then copy it from mapped host memory.

One decode call of one MoE layer, P = T * k routed pairs (P <= 64), with no host involvement (CUDA-graph safe):

1. `_plan_kernel` (one program): a pair whose expert has a slot in the device table reads it (a hit); a miss goes to
   staging row `staging0 + p` (read once, not admitted: admission is the host's, a step later). It writes the call's
   record (int32 [3, W]: row 0 the expert ids, row 1 `pair_slot`, the row each pair's kernel reads, row 2
   `pair_copy`, 1 = its record must be copied there; the CPU lane may turn a miss into 2 = computed on the CPU, not
   copied: `cpu/lane.py`), which is also what the host reads back a step later (`mapped_readback.py`).
2. `_copy_kernel`, grid (P, chunks): copies the records of the pairs with `pair_copy` 1, 32 KiB per program in 4 KiB
   loads, so enough independent reads are in flight to fill the link (run M: 50.2 GB/s against 54 for copy-engine
   H2D; the GEMV kernel reading records in place reached 30).

Both launch with PDL (`pdl.py`), as the decode step's other kernels: without it each would wait for its predecessor
to drain before launching, and hold its successor back the same way. Then the resident kernel runs over `pair_slot`
(`moe_nvfp4_device` with topk_ids = arange(P) and `copied` = `pair_copy`): the copy lets it launch once everything
before the copy has completed, and its gate_up programs of pairs not being copied (hits, the CPU's) run during the
copy; only those of copied pairs wait for it. Every miss crosses the bus once. `plan_reference` is the PyTorch
reference of step 1 (the CPU emulation runs it; tests compare the kernel with it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..record_layout import RecordLayout
from .pdl import pdl_args, pdl_release, pdl_wait, pdl_wait_only

COPY_CHUNK, COPY_BLOCK = 4096, 512  # 8-byte words per program (32 KiB) and per load (4 KiB)


@triton.jit
def _plan_kernel(ids, table, entry, layer, E, P, W, staging0, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rp = tl.arange(0, BLOCK_P)
    valid = rp < P
    row = table + layer * E  # no .to() on scalar arguments: Triton turns an argument equal to 1 into a constant
    e = tl.load(ids + rp, mask=valid, other=0).to(tl.int64)
    s = tl.load(row + e, mask=valid, other=-1)
    tl.store(entry + rp, e.to(tl.int32), mask=valid)
    tl.store(entry + W + rp, tl.where(s >= 0, s, staging0 + rp), mask=valid)
    tl.store(entry + 2 * W + rp, (s < 0).to(tl.int32), mask=valid)


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


def _check(pool, layout, topk_ids, host_base, host_stride, staging0) -> int:
    P = topk_ids.numel()
    extent = layout.extent
    if host_base < 0 or host_base % 16 or host_stride % 16 or host_stride < extent:
        raise ValueError(f"gather needs a 16-byte aligned mapped bank address (0: none) and stride >= {extent}")
    if not 0 < P <= 64:
        raise ValueError(f"gather plans 1..64 pairs per call, got {P}")
    if staging0 < 0 or staging0 + P > pool.shape[0]:
        raise ValueError(f"staging rows {staging0}..{staging0 + P - 1} are outside the pool of {pool.shape[0]} rows")
    return -(-extent // 8)


def gather_missing(pool: torch.Tensor, layout: RecordLayout, topk_ids: torch.Tensor, table: torch.Tensor, layer: int,
                   host_base: int, host_stride: int, staging0: int, *, between=None,
                   entry: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan and copy one call's misses (module docstring) -> (pair_slot, pair_copy), int32 [P] each: rows 1 and 2 of
    the call's record `entry` (int32 [3, W >= P] on the device, made if not given; row 0 gets the expert ids).

    pool u8 [rows, stride]; topk_ids [T, k]; table int32 [L, E]; host_base: the device address of this layer's mapped
    bank (expert e at host_base + e * host_stride). Rows staging0 .. staging0 + P - 1 must be free for this call's
    kernels. `between(pair_slot, pair_copy)` launches work after the plan and before the copies (the CPU lane's post,
    which takes misses off the copy list). host_base 0: the bank is not mapped, nothing is copied, and `between` must
    take every miss."""
    words = _check(pool, layout, topk_ids, host_base, host_stride, staging0)
    P = topk_ids.numel()
    ids = topk_ids.reshape(-1).contiguous()
    if entry is None:
        entry = torch.empty(3, P, dtype=torch.int32, device=pool.device)
    pair_slot, pair_copy = entry[1, :P], entry[2, :P]
    _plan_kernel[(1,)](ids, table, entry, layer, table.shape[1], P, entry.stride(0), staging0, BLOCK_P=64,
                       num_warps=1, **pdl_args(pool.device))
    if between is not None:
        between(pair_slot, pair_copy)
    if host_base == 0:  # no mapping: `between` took every staged miss (the CPU lane's lane-only layers)
        return pair_slot, pair_copy
    _copy_kernel[(P, triton.cdiv(words, COPY_CHUNK))](
        pool, layout.stride, host_base, host_stride, ids, pair_slot, pair_copy, words,
        CHUNK=COPY_CHUNK, BLOCK=COPY_BLOCK, num_warps=4, **pdl_args(pool.device))
    return pair_slot, pair_copy


def plan_reference(topk_ids: torch.Tensor, table: torch.Tensor, layer: int,
                   staging0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring in PyTorch -> (pair_slot, pair_copy)."""
    ids = topk_ids.reshape(-1).long()
    slot = table[layer].long()[ids]
    staged = staging0 + torch.arange(ids.numel())
    return torch.where(slot >= 0, slot, staged).to(torch.int32), (slot < 0).to(torch.int32)
