"""A host-planned MoE call of `GpuExperts` (every call the sync-free paths cannot take: before the banks are
page-locked and verified, decode batches over MAX_DEVICE_PAIRS pairs, mid-size prefill chunks, the CPU emulation):
the routing comes to the host (one sync per call), then

 1. the slot table splits the routed experts into hits and misses;
 2. of the M misses, F (min-wait under fixed + per-expert cost lines of both paths, `split.py`) are admitted into
    slots (evicting by the cache policy) and uploaded on the copy stream; the other M - F go first to the CPU
    kernel's native worker thread (`CpuMoe.submit`), which reads the mmapped records in place;
 3. the GPU kernel runs over hits + fetched experts after the copy fence; the CPU partial sum is added on arrival.
    Both partial sums cover disjoint (token, expert) pairs, so their sum is the full mixture.
Prefill calls (T >= prefill_tokens) go to `prefill_stream.prefill_call` once the routing is on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from .device_path import device_kernel, uses_device_kernel
from .prefill_stream import prefill_call


def host_call(ex, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One host-planned call of `ex` (a GpuExperts) -> [T, H] in x's dtype (module docstring)."""
    T, k = topk_ids.shape
    ids = topk_ids.to("cpu").numpy().reshape(-1)
    ex._observe_timing()
    ex.cache.tick()
    ex.cache.observe(layer, ids, T)
    uniq = np.unique(ids)
    c = ex.counters
    c["calls"] += 1
    c["tokens"] += T
    c["pairs"] += T * k
    if T >= ex.opts.prefill_tokens:
        return prefill_call(ex, layer, x, ids, uniq, topk_weights).to(x.dtype)
    if len(ex.trace) < ex.opts.trace_limit:
        ex.trace.append((layer, uniq))
    slots = ex.cache.lookup(layer, uniq)
    hit = slots >= 0
    ex.cache.touch(slots[hit])
    misses = uniq[~hit]
    c["hits"] += int(hit.sum())
    c["misses"] += len(misses)
    fetch, on_cpu = _split(ex, layer, misses)
    ex.per_layer[:, layer] += (int(hit.sum()), len(misses), len(fetch), len(on_cpu))
    if len(on_cpu) and ex.mapped is not None and ex.mapped.lane is not None:
        ex.mapped.lane.rest(True)  # its idle threads off the cores our CPU share runs on, until the next mapped call
    future = _submit_cpu(ex, layer, on_cpu, ids, x, topk_weights) if len(on_cpu) else None
    slot_of = dict(zip(uniq[hit].tolist(), slots[hit].tolist()))
    for e, s in zip(fetch.tolist(), ex.cache.admit_many(layer, fetch)[0].tolist()):  # _split: all fit
        ex.uploader.upload(s, ex.banks[layer].record(e))
        slot_of[e] = s
    c["fetched"] += len(fetch)
    c["bytes_h2d"] += len(fetch) * ex.layout.stride
    if slot_of and uses_device_kernel(ex, T):  # hits + this call's fetches by the table row (CPU ones: no slot)
        ex._wait(ex.uploader.fence())
        y = device_kernel(ex, layer, x, topk_ids, topk_weights, exact=future is not None)
        ex.uploader.after_compute(ex._record_compute())
    else:
        y = ex._gpu_moe(x, ids, slot_of, topk_weights)
    if future is not None:
        y_cpu, seconds = future.result()
        c["cpu_seconds"] += seconds
        ex.split.observe_cpu(len(on_cpu), seconds)
        y = y + y_cpu.to(ex.device, non_blocking=True)
    return y.to(x.dtype)


def _split(ex, layer: int, misses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if ex.opts.mode == "resident" or ex.num_slots == 0:
        return misses[:0], misses
    # most frequently routed misses first: they are the likeliest to be hit again
    order = np.argsort(-ex.cache.counts[layer, misses], kind="stable")
    misses = misses[order]
    cap = ex.num_slots - int((ex.cache.protect_until >= ex.cache.clock).sum())
    # no native CPU kernel (no C compiler: the CPU side is the PyTorch reference, far slower than the link): fetch
    # what fits
    nf = min(len(misses), cap) if ex.cpu.backend == "torch" else ex.split.count(len(misses), cap=cap)
    return misses[:nf], misses[nf:]


def _submit_cpu(ex, layer, experts, ids, x, topk_weights):
    records = [ex.banks[layer].record(int(e)) for e in experts]
    groups = [np.nonzero(ids == e)[0] for e in experts]
    pair_tok = np.arange(ids.size) // topk_weights.shape[1]
    pair_w = topk_weights.reshape(-1).float().cpu().numpy()
    x_cpu = x.to("cpu")
    ex.counters["cpu_experts"] += len(experts)
    ex.counters["bytes_cpu"] += len(experts) * ex.layout.payload_bytes
    return ex.cpu.submit(records, groups, pair_tok, pair_w, x_cpu, pinned=ex.device.type == "cuda")
