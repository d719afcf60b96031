"""Routing traces, Belady's optimum and policy replay: how many misses a cache of S slots *must* take.

A trace is a list of steps; each step is one MoE layer call: (layer, unique experts it routed to). Belady's MIN evicts
the resident expert whose next use is farthest in the future. With `bypass=True` (the hybrid path: a miss may be
computed on the CPU without ever entering VRAM), an expert whose own next use is farther than every resident's is not
admitted at all; this is the optimum for caches that may bypass. Misses counted this way are the lower bound the
decode benchmark divides by the host bandwidth.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import numpy as np

from ft.runtime.gpu.expert_cache import ExpertCache
from ft.runtime.gpu.mapped_readback import choose_admissions

Trace = list[tuple[int, np.ndarray]]
_NEVER = 1 << 62


def flatten(trace: Trace, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N] flat layer*E+expert, step index [N]) in access order."""
    ids, step = [], []
    for i, (layer, experts) in enumerate(trace):
        e = np.unique(np.asarray(experts, np.int64))
        ids.append(layer * num_experts + e)
        step.append(np.full(e.shape, i, np.int64))
    if not ids:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(ids), np.concatenate(step)


def next_use(ids: np.ndarray) -> np.ndarray:
    """For each access, the index of the next access of the same id (or a huge sentinel)."""
    nxt = np.full(ids.shape[0], _NEVER, np.int64)
    seen: dict[int, int] = {}
    for i in range(ids.shape[0] - 1, -1, -1):
        v = int(ids[i])
        nxt[i] = seen.get(v, _NEVER)
        seen[v] = i
    return nxt


def belady(trace: Trace, num_experts: int, num_slots: int, *, bypass: bool = True, count_from: int = 0) -> dict:
    """Simulate MIN; returns {accesses, hits, misses, admitted}, counting only steps >= `count_from` (earlier steps
    warm the cache, as a benchmark's warm-up does)."""
    ids, steps = flatten(trace, num_experts)
    nxt = next_use(ids)
    resident: dict[int, int] = {}  # id -> its current next-use index
    heap: list[tuple[int, int]] = []  # (-next_use, id), stale entries skipped lazily
    hits = misses = admitted = 0
    for i in range(ids.shape[0]):
        v, nu = int(ids[i]), int(nxt[i])
        counted = steps[i] >= count_from
        if v in resident:
            hits += counted
            resident[v] = nu
            heapq.heappush(heap, (-nu, v))
            continue
        misses += counted
        if num_slots == 0:
            continue
        if len(resident) < num_slots:
            resident[v] = nu
            heapq.heappush(heap, (-nu, v))
            admitted += 1
            continue
        while heap and (heap[0][1] not in resident or resident[heap[0][1]] != -heap[0][0]):
            heapq.heappop(heap)
        far = -heap[0][0]
        if bypass and (nu >= far or nu == _NEVER):
            continue
        _, victim = heapq.heappop(heap)
        del resident[victim]
        resident[v] = nu
        heapq.heappush(heap, (-nu, v))
        admitted += 1
    return {"accesses": int(hits + misses), "hits": int(hits), "misses": int(misses), "admitted": admitted}


def replay(trace: Trace, num_layers: int, num_experts: int, num_slots: int, *, policy: str = "lru",
           priors: np.ndarray | None = None, admit_all: bool = True) -> dict:
    """Replay `ExpertCache` on a trace (every miss admitted, as a pure fetch-on-miss cache does)."""
    cache = ExpertCache(num_layers, num_experts, num_slots, policy=policy, priors=priors)
    hits = misses = 0
    for layer, experts in trace:
        cache.tick()
        e = np.unique(np.asarray(experts, np.int64))
        cache.observe(layer, e, 1)
        slots = cache.lookup(layer, e)
        hits += int((slots >= 0).sum())
        misses += int((slots < 0).sum())
        cache.touch(slots)
        if admit_all:
            cache.admit_many(layer, e[slots < 0])
    return {"accesses": hits + misses, "hits": hits, "misses": misses}


def static_oracle(trace: Trace, num_experts: int, num_slots: int, *, count_from: int = 0) -> dict:
    """The best fixed set of `num_slots` experts for the counted steps, chosen knowing their routing counts: with
    routing drawn independently step after step from fixed popularities (the independent reference model, which
    synthetic checkpoints' routing follows), holding the most popular experts is the optimal online policy; chosen
    with the counted steps' own counts, this set also fits their sampling noise, so it lies above what an online
    cache reaches (`static_from_history`); Belady, who also knows the order of the draws, lies above both."""
    ids, steps = flatten(trace[count_from:], num_experts)
    counts = np.bincount(ids, minlength=1) if len(ids) else np.zeros(1, np.int64)
    hits = int(np.sort(counts)[::-1][:num_slots].sum())
    return {"accesses": int(len(ids)), "hits": hits, "misses": int(len(ids)) - hits, "admitted": num_slots}


def static_from_history(trace: Trace, num_experts: int, num_slots: int, *, count_from: int) -> dict:
    """The fixed set of `num_slots` experts routed most in the steps before `count_from`, scored on the steps from
    it: what an online cache that keeps the experts routed most so far can reach on independently drawn routing
    (`static_oracle` picks its set with the counted steps' own counts: on uniform routing it beats slots / experts,
    which no online policy can)."""
    seen, _ = flatten(trace[:count_from], num_experts)
    ids, _ = flatten(trace[count_from:], num_experts)
    size = int(max(seen.max(initial=0), ids.max(initial=0))) + 1
    held = np.argsort(-np.bincount(seen, minlength=size), kind="stable")[:num_slots]
    hits = int(np.isin(ids, held).sum())
    return {"accesses": int(len(ids)), "hits": hits, "misses": int(len(ids)) - hits, "admitted": num_slots}


def replay_mapped(trace: Trace, num_layers: int, num_experts: int, num_slots: int, *, admit_max: int = 2,
                  admit_margin: float = 2.0, priors: np.ndarray | None = None, count_from: int = 0) -> dict:
    """Replay mode mapped's cache on a trace: each call counts its hits and misses against the slots, then the
    engine's own admission decision (`mapped_readback.choose_admissions`) picks which misses enter VRAM. Admitted
    experts count as resident from the next call on (the engine's uploads land a step later: slightly optimistic).
    Counts steps >= `count_from`, as `belady` does."""
    cache = ExpertCache(num_layers, num_experts, num_slots, priors=priors)
    hits = misses = admitted = 0
    for i, (layer, experts) in enumerate(trace):
        cache.clock += 1
        e = np.unique(np.asarray(experts, np.int64))
        cache.observe(layer, e, 1)
        slots = cache.lookup(layer, e)
        if i >= count_from:
            hits += int((slots >= 0).sum())
            misses += int((slots < 0).sum())
        cache.touch(slots[slots >= 0])
        chosen, into = choose_admissions(cache, layer * num_experts + e[slots < 0], num_experts, admit_max,
                                         admit_margin)
        if len(chosen):
            cache.admit_many(layer, chosen % num_experts, into)
            admitted += len(chosen)
    return {"accesses": hits + misses, "hits": hits, "misses": misses, "admitted": admitted}


def save_trace(path: Path, trace: Trace) -> None:
    """JSON lines: {"layer": l, "experts": [...]} per step (plain data; no pickle)."""
    with open(path, "w") as f:
        for layer, experts in trace:
            f.write(json.dumps({"layer": int(layer), "experts": [int(x) for x in np.unique(experts)]}) + "\n")


def load_trace(path: Path) -> Trace:
    out: Trace = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                d = json.loads(line)
                out.append((int(d["layer"]), np.asarray(d["experts"], np.int64)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a routing-trace line ({exc})") from None
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Belady's MIN and mode mapped's admission replayed on a saved routing "
                                             "trace (tools/gpu_full.py writes one per budget row, with its sizes)")
    ap.add_argument("trace", type=Path)
    ap.add_argument("--layers", type=int, required=True, help="the model's layer count (MoE layer ids index it)")
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--from", dest="count_from", type=int, default=0, help="first counted step (the row's window)")
    ap.add_argument("--admit-max", type=int, default=2)
    ap.add_argument("--admit-margin", type=float, default=2.0)
    a = ap.parse_args()
    trace = load_trace(a.trace)
    opt = belady(trace, a.experts, a.slots, bypass=True, count_from=a.count_from)
    static = static_oracle(trace, a.experts, a.slots, count_from=a.count_from)
    history = static_from_history(trace, a.experts, a.slots, count_from=a.count_from)
    ours = replay_mapped(trace, a.layers, a.experts, a.slots, admit_max=a.admit_max, admit_margin=a.admit_margin,
                         count_from=a.count_from)
    for name, r in (("belady", opt), ("static", static), ("history", history), ("mapped", ours)):
        print(f"{name:7s} hit rate {r['hits'] / max(1, r['accesses']):.3f}  ({r['hits']} of {r['accesses']}, "
              f"{r['admitted']} admitted)")


if __name__ == "__main__":
    main()
