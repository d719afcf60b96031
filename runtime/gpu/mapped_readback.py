"""The host's side of mode mapped (`mapped_path.py`): what it does with one call's entry once it has come back.

An entry is int32 [3, P] for P = T * k routed pairs: the expert ids, the pool row each pair's kernel read (a slot,
a staging row >= num_slots, or -1 for a record read in place from host memory) and whether its record was copied
from host memory for this call (1: a miss). Per entry, in call order:
  * counters (hits / misses over the call's distinct experts, bytes read from host memory), per-layer counts, the
    routing trace and frequency counts (`ExpertCache.observe`), recency of the slots hit;
  * fill mode: every miss the device copied into a candidate slot is mirrored in the host table (`adopt`). The device
    table already holds it, so the table is marked synced (no upload) unless the host had changes of its own pending,
    which only happens after `MappedDecode.release` has read everything back;
  * otherwise: `admit_uploads` (up to `admit_max` per call, filtered by routing frequency; see `mapped_path.py`).
"""

from __future__ import annotations

import numpy as np


def read_back(md, layer: int, T: int, entry) -> None:
    ex, cache = md.ex, md.ex.cache
    P = T * ex.k
    ids = entry[0, :P].numpy().astype(np.int64)
    rows, copied = entry[1, :P].numpy(), entry[2, :P].numpy()
    cache.observe(layer, ids, T)
    uniq, first = np.unique(ids, return_index=True)
    miss = copied[first] != 0
    hits, misses = int((~miss).sum()), int(miss.sum())
    c = ex.counters
    c["hits"] += hits
    c["misses"] += misses
    c["bytes_mapped"] += misses * ex.layout.payload_bytes
    ex.per_layer[:2, layer] += (hits, misses)
    if len(ex.trace) < ex.opts.trace_limit:
        ex.trace.append((layer, uniq))
    if md.fill:
        filled = first[miss & (rows[first] >= 0) & (rows[first] < ex.num_slots)]
        if len(filled):
            clean = not md.table.dirty
            for p in filled.tolist():
                cache.adopt(layer, int(ids[p]), int(rows[p]))
            if clean:
                md.table.mark_synced()
            c["filled"] += len(filled)
            ex.per_layer[2, layer] += len(filled)
    slots = cache.lookup(layer, uniq)
    cache.touch(slots[slots >= 0])
    if not md.fill:
        admit_uploads(md, layer, uniq[slots < 0])


def admit_uploads(md, layer: int, missed: np.ndarray) -> None:
    """fill=False: upload up to `admit_max` missed experts, most frequently routed first, into victim slots whose
    owner is routed `admit_margin` x less often (empty slots always); their entries stay hidden until they land."""
    ex, cache = md.ex, md.ex.cache
    n = min(len(missed), ex.opts.admit_max)
    if n == 0 or cache.S == 0:
        return
    freq = cache.frequency(layer * ex.E + missed)
    order = np.argsort(-freq, kind="stable")[:n]
    victims = cache.victims(n)
    owners = cache.owner[victims]
    # candidates most frequent first, victims easiest first: admit up to the first that does not pay
    pays = (owners < 0) | (freq[order[:len(victims)]] > ex.opts.admit_margin * cache.frequency(np.maximum(owners, 0)))
    keep = len(pays) if pays.all() else int(np.argmin(pays))
    if keep == 0:
        return
    experts = missed[order[:keep]]
    ex.uploader.after_compute(ex._record_compute())  # the evicted experts may still be read by queued kernels
    slots, _ = cache.admit_many(layer, experts, victims[:len(experts)])
    admitted = experts[slots >= 0]
    md.table.hide(layer, admitted)
    for e, s in zip(admitted.tolist(), slots[slots >= 0].tolist()):
        ex.uploader.upload(s, ex.banks[layer].record(e))
    ex.counters["fetched"] += len(admitted)
    ex.counters["bytes_h2d"] += len(admitted) * ex.layout.stride
    ex.per_layer[2, layer] += len(admitted)
    md.landing.append((ex.uploader.fence(), layer, admitted))
