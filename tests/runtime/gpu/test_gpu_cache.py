"""Slot table, LRU / frequency-aware replacement, and Belady's optimum."""

from __future__ import annotations

import numpy as np
import pytest

from belady import belady, load_trace, replay, save_trace  # tools/belady.py (conftest puts tools/ on the path)
from ft.runtime.gpu.expert_cache import ExpertCache, plan_num_slots


def _check_consistent(c: ExpertCache) -> None:
    for s, owner in enumerate(c.owner):
        if owner >= 0:
            assert c.slot_of[owner // c.E, owner % c.E] == s
    assert (c.slot_of >= 0).sum() == (c.owner >= 0).sum()


def test_lru_evicts_least_recently_used():
    c = ExpertCache(1, 8, 3, policy="lru")
    for e in (0, 1, 2):
        c.tick()
        c.admit(0, e)
    c.tick()
    c.touch(c.lookup(0, np.array([0])))  # 1 is now the oldest
    c.tick()
    slot, old = c.admit(0, 5)
    assert old == 1 and c.lookup(0, np.array([1, 5])).tolist() == [-1, slot]
    _check_consistent(c)


def test_protected_slots_are_never_victims():
    c = ExpertCache(2, 4, 2, policy="lru")
    c.tick()
    c.admit(0, 0)
    c.admit(1, 3)
    assert c.admit(0, 1) == (-1, -1)  # both slots are in use by this very call
    c.tick()
    s, old = c.admit(0, 1)
    assert s >= 0 and old in (0, 7)
    _check_consistent(c)


def test_frequency_priors_keep_hot_experts_through_a_cold_burst():
    priors = np.zeros((1, 16))
    priors[0, 0] = 100.0
    priors[0, 1:] = 1.0
    freq = ExpertCache(1, 16, 2, policy="lru-freq", priors=priors)
    lru = ExpertCache(1, 16, 2, policy="lru")
    for c in (freq, lru):
        c.tick()
        c.admit(0, 0)
        for e in (5, 6, 7):  # cold experts one after another
            c.tick()
            c.admit(0, e)
    assert freq.lookup(0, np.array([0]))[0] >= 0
    assert lru.lookup(0, np.array([0]))[0] == -1


def test_uniform_frequencies_reduce_to_lru():
    rng = np.random.default_rng(0)
    trace = [(int(rng.integers(0, 3)), rng.choice(32, 4, replace=False)) for _ in range(300)]
    a = replay(trace, 3, 32, 20, policy="lru")
    b = replay(trace, 3, 32, 20, policy="lru-freq", priors=np.ones((3, 32)))
    # observe() makes counts drift, so allow a small difference; both must be valid replays
    assert a["accesses"] == b["accesses"] == sum(len(np.unique(e)) for _, e in trace)
    assert abs(a["misses"] - b["misses"]) <= 0.1 * a["misses"]


def _brute_force_min(trace, E, S):
    """Exact optimum with bypass over all cache states (tiny traces only)."""
    ids = [layer * E + int(x) for layer, ex in trace for x in np.unique(ex)]
    best = {frozenset(): 0}
    for v in ids:
        nxt = {}
        for state, cost in best.items():
            options = []
            if v in state:
                options.append((state, cost))
            else:
                options.append((state, cost + 1))  # bypass
                if len(state) < S:
                    options.append((state | {v}, cost + 1))
                for out in state:
                    options.append(((state - {out}) | {v}, cost + 1))
            for st, c in options:
                if c < nxt.get(st, 1 << 30):
                    nxt[st] = c
        best = nxt
    return min(best.values())


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_the_optimum_on_small_traces(seed):
    rng = np.random.default_rng(seed)
    trace = [(int(rng.integers(0, 2)), rng.choice(4, int(rng.integers(1, 3)), replace=False)) for _ in range(9)]
    for S in (1, 2, 3):
        assert belady(trace, 4, S)["misses"] == _brute_force_min(trace, 4, S)


def test_belady_never_worse_than_lru():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(64, 0.3), size=4)
    trace = [(layer, rng.choice(64, 8, replace=False, p=p[layer])) for _ in range(80) for layer in range(4)]
    for S in (0, 16, 64, 200, 256):
        opt, lru = belady(trace, 64, S), replay(trace, 4, 64, S, policy="lru")
        nob = belady(trace, 64, S, bypass=False)
        assert opt["misses"] <= nob["misses"] <= lru["misses"]
        assert opt["accesses"] == lru["accesses"]
    assert belady(trace, 64, 256)["misses"] == len({(l, int(e)) for l, ex in trace for e in ex})


def test_trace_roundtrip(tmp_path):
    trace = [(0, np.array([3, 1])), (1, np.array([2]))]
    save_trace(tmp_path / "t.jsonl", trace)
    back = load_trace(tmp_path / "t.jsonl")
    assert [(l, e.tolist()) for l, e in back] == [(0, [1, 3]), (1, [2])]
    (tmp_path / "bad.jsonl").write_text('{"layer": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")


def test_plan_num_slots_counts_everything_allocated():
    gib = 1 << 30
    assert plan_num_slots(8 * gib, 3 * gib, 1 << 21, reserve=gib, max_slots=10**6) == 2048
    assert plan_num_slots(2 * gib, 3 * gib, 1 << 21, reserve=0, max_slots=10) == 0
    assert plan_num_slots(80 * gib, 0, 1 << 21, reserve=0, max_slots=100) == 100


def test_bad_policy_and_priors_are_refused():
    with pytest.raises(ValueError, match="unknown cache policy"):
        ExpertCache(1, 4, 2, policy="fifo")
    with pytest.raises(ValueError, match="priors must be"):
        ExpertCache(2, 4, 2, priors=np.ones((3, 4)))




def test_belady_count_from_skips_warmup():
    trace = [(0, np.array([1, 2])), (0, np.array([1, 2])), (0, np.array([3]))]
    full = belady(trace, 4, 2)
    warm = belady(trace, 4, 2, count_from=1)
    assert full["misses"] == 3 and full["accesses"] == 5
    assert warm["misses"] == 1 and warm["hits"] == 2 and warm["accesses"] == 3


@pytest.mark.parametrize("policy", ["lru", "lru-freq"])
def test_admit_many_takes_the_slots_successive_admits_would(policy):
    rng = np.random.default_rng(3)
    L, E, S = 3, 16, 10
    priors = rng.random((L, E))
    one, many = (ExpertCache(L, E, S, policy=policy, priors=priors) for _ in range(2))
    for step in range(300):
        layer, ids = step % L, rng.integers(0, E, int(rng.integers(1, 14)))
        for c in (one, many):
            c.tick()
            c.observe(layer, ids, 1)
            c.touch(c.lookup(layer, np.unique(ids)))
        uniq = np.unique(ids)
        miss = rng.permutation(uniq[one.lookup(layer, uniq) < 0])
        want = [one.admit(layer, int(e)) for e in miss]
        slots, evicted = many.admit_many(layer, miss)
        assert list(zip(slots.tolist(), evicted.tolist())) == want
        assert np.array_equal(one.slot_of, many.slot_of) and one.version == many.version


def test_admit_many_stops_when_every_slot_is_protected():
    c = ExpertCache(1, 8, 3, policy="lru")
    c.tick()
    slots, evicted = c.admit_many(0, np.array([4, 5, 6, 7]))
    assert slots.tolist() == [0, 1, 2, -1] and evicted.tolist() == [-1, -1, -1, -1]
    assert c.slot_of[0, 7] == -1 and c.num_resident == 3
    with pytest.raises(ValueError, match=r"experts \[5\] are already resident"):
        c.admit_many(0, np.array([1, 5]))


def test_victims_chosen_once_serve_two_admits_of_one_tick():
    """Mode mapped's read-back scores once for the admissions of several layers: one victims() pass serves them."""
    rng = np.random.default_rng(5)
    L, E, S = 4, 16, 12
    seq, shared = (ExpertCache(L, E, S, priors=rng.random((L, E))) for _ in range(2))
    shared.counts, shared.tokens = seq.counts.copy(), seq.tokens.copy()
    for step in range(200):
        layer, nxt = step % L, (step + 1) % L
        ids = rng.integers(0, E, 6)
        for c in (seq, shared):
            c.tick()
            c.observe(layer, ids, 1)
            c.touch(c.lookup(layer, np.unique(ids)))
        uniq = np.unique(ids)
        miss = uniq[seq.lookup(layer, uniq) < 0]
        pred = rng.choice(E, 5, replace=False)
        a1 = seq.admit_many(layer, miss)
        a2 = seq.admit_many(nxt, pred[seq.slot_of[nxt, pred] < 0])
        chosen = shared.victims(len(miss) + 5)
        b1 = shared.admit_many(layer, miss, chosen)
        b2 = shared.admit_many(nxt, pred[shared.slot_of[nxt, pred] < 0], chosen[len(miss):])
        for x, y in ((a1, b1), (a2, b2)):
            assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
        assert np.array_equal(seq.slot_of, shared.slot_of)
