"""Prefill calls of `GpuExperts` (many tokens): hits from the cache, misses streamed once, never admitted.

Misses go through two prefill buffers of `prefill_slots` slots each (pool rows num_slots.. num_slots + 2P), double
buffered: group g+1 uploads while group g computes. Decode-hot slots survive because nothing is admitted. The
partial sums cover disjoint (token, expert) pairs, so they add up to the full mixture.
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

    earlier = ex.uploader.fence()  # uploads issued before this call (e.g. prefetches into hit slots)
    if groups:
        upload(0)
    ex._wait(earlier)
    slot_of = dict(zip(uniq[hit].tolist(), slots[hit].tolist()))
    y = ex._gpu_moe(x, ids, slot_of, topk_weights, fence=False) if slot_of else torch.zeros(
        x.shape[0], x.shape[1], dtype=torch.float32, device=ex.device)
    for g, group in enumerate(groups):
        ready = ex.uploader.fence()
        if g + 1 < len(groups):
            upload(g + 1)  # overlaps with group g's kernel
        ex._wait(ready)
        base = ex.num_slots + (g % 2) * P
        y = y + ex._gpu_moe(x, ids, {e: base + j for j, e in enumerate(group)}, topk_weights, fence=False)
        ex._prefill_done[g % 2] = ex._record_compute()
    last = ex._record_compute()
    if last is not None:  # slots read here may be evicted by later decode uploads
        ex.uploader.after_compute(last)
    ex.counters["prefill_streamed"] += len(misses)
    ex.counters["bytes_h2d"] += len(misses) * ex.layout.stride
    return y
