"""The host's side of mode mapped (`mapped_path.py`): what it does with calls' entries once they have come back.

An entry is int32 [3, >= P] for P = T * k routed pairs: the expert ids, the pool row each pair's kernel read (a slot,
a staging row >= num_slots, or -1 for a record read in place from host memory or computed on the CPU) and how a
miss was served (1: its record was copied from host memory for this call; 2: the CPU lane computed it). One
`read_back` takes the entries of one eager call or of a whole graph replay (every MoE layer of the step) and handles
them in one vectorized pass over flat expert ids (layer * E + expert): this runs once per decode step on the thread
that must queue the next one, so its cost is paid per step, not per layer.
  * counters (hits / misses over each call's distinct experts, bytes read from host memory by the GPU and by the
    CPU lane), per-layer counts, the routing trace and frequency counts, recency of the slots hit;
  * `admit_uploads` over the step's missed experts.
"""

from __future__ import annotations

import numpy as np


def read_back(md, layers: list[int], T: int, entries: np.ndarray) -> None:
    """entries int32 [len(layers), 3, >= T * k]: one entry per layer call (distinct layers)."""
    ex, cache = md.ex, md.ex.cache
    E, P = ex.E, T * ex.k
    lay = np.asarray(layers, np.int64)
    flat = lay[:, None] * E + entries[:, 0, :P].astype(np.int64)
    cache.observe_flat(flat.ravel(), lay, T)
    uniq, first = np.unique(flat, return_index=True)  # sorted: by layer, then expert
    how = entries[:, 2, :P].ravel()[first]
    miss, on_cpu = how != 0, how == 2
    layer_of = uniq // E
    c = ex.counters
    c["hits"] += int((~miss).sum())
    c["misses"] += int(miss.sum())
    c["cpu_experts"] += int(on_cpu.sum())
    c["bytes_mapped"] += int((how == 1).sum()) * ex.layout.payload_bytes
    c["bytes_cpu"] += int(on_cpu.sum()) * ex.layout.payload_bytes
    for row, mask in ((0, ~miss), (1, miss), (3, on_cpu)):
        np.add.at(ex.per_layer[row], layer_of[mask], 1)
    if len(ex.trace) < ex.opts.trace_limit:
        starts = np.flatnonzero(np.r_[True, layer_of[1:] != layer_of[:-1]])
        for part in np.split(uniq, starts[1:]):
            ex.trace.append((int(part[0] // E), part % E))
    slots = cache.slot_of.ravel()[uniq]
    cache.touch(slots[slots >= 0])
    admit_uploads(md, uniq[slots < 0])


def choose_admissions(cache, missed: np.ndarray, E: int, admit_max: int, admit_margin: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(flat ids to admit, their slots) among missed experts (flat ids): at most `admit_max` per layer, most frequently
    routed first, into victim slots whose owner is routed `admit_margin` x less often (empty slots always). One
    victims() choice for all (O(S) numpy work once per read-back). Decides only: `admit_uploads` acts on it, and
    tools/belady.py replays it on saved routing traces."""
    none = np.empty(0, np.int64)
    if admit_max == 0 or cache.S == 0 or len(missed) == 0:
        return none, none
    freq = cache.frequency(missed)
    layer_of = missed // E
    by_layer = np.lexsort((-freq, layer_of))  # per layer, most frequent first
    lo = layer_of[by_layer]
    rank = np.arange(len(lo)) - np.searchsorted(lo, lo)
    cand = by_layer[rank < admit_max]
    cand = cand[np.argsort(-freq[cand], kind="stable")]
    victims = cache.victims(len(cand))
    owners = cache.owner[victims]
    # candidates most frequent first, victims easiest first: admit up to the first that does not pay
    pays = (owners < 0) | (freq[cand[:len(victims)]] > admit_margin * cache.frequency(np.maximum(owners, 0)))
    keep = len(pays) if pays.all() else int(np.argmin(pays))
    return missed[cand[:keep]], victims[:keep]


def admit_uploads(md, missed: np.ndarray) -> None:
    """Upload the missed experts (flat ids) `choose_admissions` picks; their table entries stay hidden until they
    land."""
    ex, cache = md.ex, md.ex.cache
    E = ex.E
    chosen, into = choose_admissions(cache, missed, E, ex.opts.admit_max, ex.opts.admit_margin)
    if len(chosen) == 0:
        return
    ex.uploader.after_compute(ex._record_compute())  # the evicted experts may still be read by queued kernels
    admitted_by_layer = []
    for layer in np.unique(chosen // E).tolist():
        mine = chosen // E == layer
        experts = chosen[mine] % E
        slots, _ = cache.admit_many(layer, experts, into[mine])
        admitted = experts[slots >= 0]
        md.table.hide(layer, admitted)
        for e, s in zip(admitted.tolist(), slots[slots >= 0].tolist()):
            ex.uploader.upload(s, ex.banks[layer].record(e))
        ex.per_layer[2, layer] += len(admitted)
        admitted_by_layer.append((layer, admitted))
    n = sum(len(a) for _, a in admitted_by_layer)
    ex.counters["fetched"] += n
    ex.counters["bytes_h2d"] += n * ex.layout.stride
    fence = ex.uploader.fence()
    for layer, admitted in admitted_by_layer:
        md.landing.append((fence, layer, admitted))
