"""Prefill calls of `GpuExperts` (many tokens): hits from the cache, misses streamed once, never admitted.

Misses go through two prefill buffers of `prefill_slots` slots each (pool rows num_slots.. num_slots + 2P), double
buffered: group g+1 uploads while group g computes. Decode-hot slots survive because nothing is admitted.
Every kernel call of one prefill call uses the tile sizes of the whole call and writes its (token, expert) rows into
one [T*k, H] buffer summed over k once at the end: each pair is computed as a resident model's single call computes
it, whatever was streamed, so offloaded and resident prefill give bit-identical outputs (and greedy tokens).
"""

from __future__ import annotations

import numpy as np
import torch


def prefill_call(ex, layer: int, x: torch.Tensor, ids: np.ndarray, uniq: np.ndarray,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    """ex: a GpuExperts; ids int [T*k] host routing; uniq its unique experts -> fp32 [T, H]."""
    slots = ex.cache.lookup(layer, uniq)
    hit = slots >= 0
    ex.cache.touch(slots[hit])
    ex.counters["prefill_calls"] += 1
    misses = uniq[~hit].tolist()
    P = ex.opts.prefill_slots
    groups = [misses[i:i + P] for i in range(0, len(misses), P)]

    def upload(g: int) -> None:
        if ex._prefill_done[g % 2] is not None:  # a kernel may still read this buffer
            ex.uploader.after_compute(ex._prefill_done[g % 2])
        base = ex.num_slots + (g % 2) * P
        for j, e in enumerate(groups[g]):
            ex.uploader.upload(base + j, ex.banks[layer].record(int(e)))

    T, k = topk_weights.shape
    H = x.shape[1]
    blocks = None
    if ex.device.type == "cuda" or ex.interpret:  # the Triton kernels (imported only where they run)
        from .kernels.nvfp4_triton import pick_blocks

        blocks = pick_blocks(len(ids) / max(1, len(uniq)), H, ex.layout.inter)  # the whole call's, as moe_nvfp4 picks
    pairs = torch.zeros(T * k, H, dtype=torch.float32, device=ex.device)
    acc = []  # reduced partial sums of the reference path (CPU emulation without Triton), which has no pair_out

    def part(slot_of: dict) -> None:
        y = ex._gpu_moe(x, ids, slot_of, topk_weights, fence=False, blocks=blocks, pair_out=pairs)
        if y is not None:
            acc.append(y)

    earlier = ex.uploader.fence()  # uploads issued before this call (e.g. prefetches into hit slots)
    if groups:
        upload(0)
    ex._wait(earlier)
    if hit.any():
        part(dict(zip(uniq[hit].tolist(), slots[hit].tolist())))
    for g, group in enumerate(groups):
        ready = ex.uploader.fence()
        if g + 1 < len(groups):
            upload(g + 1)  # overlaps with group g's kernel
        ex._wait(ready)
        base = ex.num_slots + (g % 2) * P
        part({e: base + j for j, e in enumerate(group)})
        ex._prefill_done[g % 2] = ex._record_compute()
    last = ex._record_compute()
    if last is not None:  # slots read here may be evicted by later decode uploads
        ex.uploader.after_compute(last)
    ex.counters["prefill_streamed"] += len(misses)
    ex.counters["bytes_h2d"] += len(misses) * ex.layout.stride
    return sum(acc[1:], acc[0]) if acc else pairs.view(T, k, H).sum(1)
