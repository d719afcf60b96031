"""Mode mapped (`mapped_path.py`): decode calls read misses from the bank in place and refill the cache a step later.
On the CPU the scheduler runs with the reference (or the Triton kernels under the interpreter) as its GPU side; the
hidden-entry ordering of the device slot table is checked directly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.gpu.device_path import MAX_DEVICE_PAIRS
from ft.runtime.gpu.expert_cache import ExpertCache
from ft.runtime.gpu.mapped_path import uses_mapped
from ft.runtime.gpu.kernels.moe_reference import moe_ref
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.prefill_stream import prefill_call
from ft.runtime.gpu.record_layout import RecordLayout
from ft.runtime.gpu.store import MAPPED_SLICES, GpuExperts

from .gpu_fixtures import rel_err, tiny_moe_ftw

E, K, H, I = 8, 2, 64, 32
INTERP = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
PIECE = MAX_DEVICE_PAIRS // K  # tokens of one mapped call
BEYOND_SLICES = MAPPED_SLICES * PIECE + 1  # tokens of the shortest call the sliced mapped path leaves to others
NO_PIPELINE = 10 ** 6  # OffloadConfig.prefill_tokens that keeps every call here off the prefill pipeline


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return FtwReader(tiny_moe_ftw(tmp_path_factory.mktemp("mapped") / "m.ftw", experts=E, top_k=K, hidden=H, inter=I))


def _calls(reader, tokens, seed, hot=None):
    """(layer, x, ids, weights) per call; `hot`: an expert every token of layer 0 routes to."""
    g = torch.Generator().manual_seed(seed)
    for i, T in enumerate(tokens):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        if hot is not None and i % 3 == 0:
            ids[:, 0] = torch.where(ids[:, 1] == hot, ids[:, 0], torch.full_like(ids[:, 0], hot))
        yield i % 3, torch.randn(T, H, generator=g).to(torch.bfloat16), ids, torch.rand(T, K, generator=g) + 0.1


def _full(reader, layer, x, ids, w):
    bank = reader.bank(f"layers.{layer}.mlp.experts")
    recs = torch.stack([bank.record(e) for e in range(E)])
    return moe_ref(recs, RecordLayout.from_bank(bank, H, I), x, ids, w)


@pytest.mark.parametrize("interpret", [False, True])
def test_mapped_decode_computes_every_pair_and_refills_the_cache(reader, interpret):
    if interpret and not INTERP:
        pytest.skip("needs Triton's interpreter on a machine without CUDA")
    opts = OffloadConfig(num_slots=3, admit_max=1, trace_limit=100)
    ex = GpuExperts(reader, opts, device="cpu", device_plan=True, interpret=interpret)
    tokens = (1, 1, 2, 1, 1, 3, 1, 1, 2, 1, 1, 1) * 2
    for layer, x, ids, w in _calls(reader, tokens, seed=5, hot=6):
        y = ex(layer, x, ids, w)
        # every routed pair counts, resident or not
        assert rel_err(y.float(), _full(reader, layer, x, ids, w)) < 1e-2
    s = ex.stats()
    assert s["calls"] == len(tokens) and s["bytes_mapped"] > 0 and s["cpu_experts"] == 0
    assert s["hits"] + s["misses"] == sum(len(np.unique(u)) for _, u in ex.trace)
    assert 0 < s["fetched"] <= s["calls"]  # admit_max=1 per call
    ex.mapped.release()
    for slot, flat in enumerate(ex.cache.owner.tolist()):  # every slot holds the record its owner names
        if flat >= 0:
            rec = reader.bank(f"layers.{flat // E}.mlp.experts").record(flat % E)
            assert torch.equal(ex.pool[slot, :rec.numel()].cpu(), rec)
    assert s["hits"] > 0  # the hot expert was admitted and then read from its slot
    assert ex.cache.slot_of[0, 6] >= 0
    ex.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_cpu_lane_takes_the_misses_when_the_link_is_slow(reader):
    """A link costed at 1 MB/s: every staged miss goes to the CPU lane, the results still cover every pair, and the
    counters say which path served what."""
    opts = OffloadConfig(mode="mapped", num_slots=3, admit_max=1, b_pcie=1e6, cpu_threads=2)
    ex = GpuExperts(reader, opts, device="cpu", device_plan=True, interpret=True)
    try:
        for layer, x, ids, w in _calls(reader, (1, 2, 1, 3, 1, 1), seed=9):
            assert rel_err(ex(layer, x, ids, w).float(), _full(reader, layer, x, ids, w)) < 1e-2
        s = ex.stats()
        assert s["cpu_experts"] > 0 and s["bytes_cpu"] == s["cpu_experts"] * ex.layout.payload_bytes
        assert s["bytes_mapped"] == (s["misses"] - s["cpu_experts"]) * ex.layout.payload_bytes
        assert s["cpu_lane"]["jobs"] > 0 and s["cpu_lane"]["refused"] == 0
        assert sum(s["per_layer"]["cpu_experts"]) == s["cpu_experts"]
    finally:
        ex.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_banks_beyond_the_host_memory_allowance_are_computed_by_the_cpu_lane(reader):
    """A verified bank that was not page-locked (host RAM short) has no mapping for the GPU: its layer stays on the
    sync-free path, with every staged miss computed by the CPU lane, and nothing read over the link for it."""
    opts = OffloadConfig(mode="mapped", num_slots=3, admit_max=0, cpu_threads=2, prefill_slots=4)
    ex = GpuExperts(reader, opts, device="cpu", device_plan=True, interpret=True)
    ex.allocate()
    unmapped = reader.bank("layers.1.mlp.experts").stacked("gate_up").data_ptr()
    host_mapped = ex.uploader.mapped_address
    ex.uploader.mapped_address = lambda ptr, n: None if ptr <= unmapped < ptr + n else host_mapped(ptr, n)
    try:
        assert [ex.mapped.ready(i) for i in range(3)] == [True, True, True]
        assert ex.mapped.base.keys() == {0, 2} and ex.mapped.lane_only == {1}
        for layer, x, ids, w in _calls(reader, (1, 2, 1, 3, 1, 1, 2, 1, 1), seed=11):
            assert uses_mapped(ex, layer, x.shape[0])
            assert rel_err(ex(layer, x, ids, w).float(), _full(reader, layer, x, ids, w)) < 1e-2
        s = ex.stats()
        per = s["per_layer"]
        assert per["misses"][1] > 0 and per["cpu_experts"][1] == per["misses"][1]  # all of layer 1's on the CPU
        assert s["cpu_lane"]["refused"] == 0 and s["cpu_lane"]["jobs"] > 0
        assert not uses_mapped(ex, 1, 5)  # more pairs than staging rows (8): no record is read in place for it
        assert uses_mapped(ex, 0, 5)
    finally:
        ex.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_the_lane_rests_while_a_host_planned_call_computes_on_the_cpu(reader):
    """A host-planned call (more pairs than the mapped path takes) that gives misses to the CPU rests the lane, so its
    idle threads leave the cores to that CPU work; the next mapped call wakes it before it may post."""
    opts = OffloadConfig(mode="mapped", num_slots=3, admit_max=0, b_pcie=1e6, cpu_threads=2, prefill_tokens=NO_PIPELINE)
    ex = GpuExperts(reader, opts, device="cpu", device_plan=True, interpret=True)
    try:
        calls = list(_calls(reader, (1, BEYOND_SLICES, 1), seed=13))
        layer, x, ids, w = calls[0]
        ex(layer, x, ids, w)  # mapped: makes the lane
        lane = ex.mapped.lane
        assert lane is not None and not lane.resting
        layer, x, ids, w = calls[1]
        assert not uses_mapped(ex, layer, x.shape[0])
        assert rel_err(ex(layer, x, ids, w).float(), _full(reader, layer, x, ids, w)) < 1e-2
        assert ex.stats()["cpu_experts"] > 0 and lane.resting
        layer, x, ids, w = calls[2]
        assert rel_err(ex(layer, x, ids, w).float(), _full(reader, layer, x, ids, w)) < 1e-2
        assert not lane.resting
    finally:
        ex.close()


@pytest.mark.parametrize("interpret", [False, True])
def test_a_short_prefill_runs_as_mapped_calls_in_turn(reader, interpret):
    """A call past one mapped call's pairs but within MAPPED_SLICES of them (a short prompt; here the prefill pipeline,
    which takes long calls, is off) is cut into mapped calls of PIECE tokens: no host-planned call, every pair
    computed, each piece counted like a decode call."""
    if interpret and not INTERP:
        pytest.skip("needs Triton's interpreter on a machine without CUDA")
    opts = OffloadConfig(mode="mapped", num_slots=3, admit_max=1, trace_limit=100, prefill_tokens=NO_PIPELINE)
    ex = GpuExperts(reader, opts, device="cpu", device_plan=True, interpret=interpret)
    try:
        tokens = (1, PIECE + 3) if interpret else (1, PIECE + 3, MAPPED_SLICES * PIECE)  # the interpreter is slow
        for layer, x, ids, w in _calls(reader, tokens, seed=17):
            assert rel_err(ex(layer, x, ids, w).float(), _full(reader, layer, x, ids, w)) < 1e-2
        s = ex.stats()
        assert s["calls"] == sum(-(-t // PIECE) for t in tokens) and s["tokens"] == sum(tokens)
        assert s["prefill_calls"] == 0 and s["cpu_experts"] == 0
    finally:
        ex.close()


def test_mapped_falls_back_to_the_host_path_for_prefill_and_publishes_hidden_entries(reader):
    ex = GpuExperts(reader, OffloadConfig(mode="mapped", num_slots=4, prefill_tokens=NO_PIPELINE), device="cpu",
                    device_plan=True)
    big = BEYOND_SLICES
    table = None
    for layer, x, ids, w in _calls(reader, (1, 1, 1, big, 1), seed=9, hot=2):
        y = ex(layer, x, ids, w)
        table = ex.cache.device_table(ex.device)
        assert rel_err(y.float(), _full(reader, layer, x, ids, w)) < 1e-2
        if x.shape[0] == big:  # host-planned: everything read back and published before it looked at the table
            assert not ex.mapped.records and not table.hidden.any()
    assert ex.stats()["prefill_calls"] + ex.stats()["fetched"] > 0
    ex.close()


def test_admission_needs_a_more_frequent_candidate(reader):
    """A full cache under uniform routing does not churn: a miss evicts a resident expert only when routed more
    often (by OffloadConfig.admit_margin)."""
    ex = GpuExperts(reader, OffloadConfig(mode="mapped", num_slots=2, admit_max=2),
                    device="cpu", device_plan=True)
    ids = torch.tensor([[0, 1]])
    x, w = torch.randn(1, H).to(torch.bfloat16), torch.ones(1, K)
    for _ in range(6):  # experts 0 and 1 of layer 0 fill both slots and become frequent
        ex(0, x, ids, w)
    ex.mapped.poll()
    assert sorted(ex.cache.owner.tolist()) == [0, 1]
    ex(0, x, torch.tensor([[2, 3]]), w)  # two rare experts: not worth evicting the frequent ones
    ex.mapped.poll()
    assert sorted(ex.cache.owner.tolist()) == [0, 1]
    for _ in range(20):  # now expert 3 becomes the most frequent one
        ex(0, x, torch.tensor([[3, 0]]), w)
    ex.mapped.poll()
    assert ex.cache.slot_of[0, 3] >= 0 and ex.cache.slot_of[0, 0] >= 0
    ex.close()


def test_hidden_entries_stay_off_the_device_table_until_shown():
    c = ExpertCache(2, 4, 3)
    t = c.device_table("cpu")
    c.tick()
    slots, _ = c.admit_many(1, np.array([2, 3]))
    t.hide(1, [2])
    row = t.row(1).numpy()
    assert row[2] == -1 and row[3] == slots[1]  # 2 is resident on the host, not yet on the device
    assert not t.dirty
    t.show(1, [2])
    assert t.dirty and t.row(1).numpy()[2] == slots[0]
    t.hide(0, [1])
    t.show()
    assert not t.hidden.any()


@pytest.mark.skipif(not (INTERP or torch.cuda.is_available()), reason="needs the Triton kernels (CUDA or interpreter)")
def test_streamed_prefill_equals_resident_prefill_bit_for_bit(tmp_path):
    """Prefill that streams misses through the prefill buffers computes every pair with the tiles and the k-order of a
    resident model's one call: offloaded and resident prefill cannot drift apart (greedy tokens stay identical).
    Top-4 routing: a token's pairs land in the hits and in several streamed groups, whose partial sums would add in
    another order than the k-sum of one call."""
    reader = FtwReader(tiny_moe_ftw(tmp_path / "k4.ftw", experts=E, top_k=4, hidden=H, inter=I))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=dev, device_plan=True, interpret=dev == "cpu")
    res = GpuExperts(reader, OffloadConfig(mode="resident"), **kw)
    off = GpuExperts(reader, OffloadConfig(num_slots=2, prefill_slots=2), **kw)
    off.allocate()
    off.cache.tick()
    off.cache.admit_many(0, np.array([1, 5]))  # two experts of layer 0 are hits; every other one is streamed
    off.uploader.upload(int(off.cache.slot_of[0, 1]), reader.bank("layers.0.mlp.experts").record(1))
    off.uploader.upload(int(off.cache.slot_of[0, 5]), reader.bank("layers.0.mlp.experts").record(5))
    res.allocate()
    g = torch.Generator().manual_seed(13)
    for layer, T in ((0, 24), (1, 16), (0, 20)):
        ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)])
        x, w = torch.randn(T, H, generator=g).to(torch.bfloat16), torch.rand(T, 4, generator=g) + 0.1
        x, w = x.to(dev), w.to(dev)
        flat = ids.reshape(-1).numpy()
        # fp32 sums before the caller's cast to bf16, which would hide most summation-order differences
        a, b = (prefill_call(ex, layer, x, flat, np.unique(flat), w) for ex in (res, off))
        assert torch.equal(a, b)
        assert rel_err(a.cpu(), _full(reader, layer, x.cpu(), ids, w.cpu())) < 1e-2
    assert off.stats()["prefill_streamed"] >= 6  # 8 experts, at most 2 resident: several groups were streamed
    res.close()
    off.close()


def test_banks_not_pinned_or_not_verified_take_the_host_path(reader):
    """Only banks the pinner registered and verified are read in place; the others' calls are host-planned."""
    import threading
    from types import SimpleNamespace

    ex = GpuExperts(reader, OffloadConfig(mode="mapped", num_slots=3, b_pcie=1e9, b_cpu=1e9,
                                          cpu_fixed_s=0.0, adapt=False), device="cpu", device_plan=True)
    ex.allocate()
    running = SimpleNamespace(done=threading.Event(), info={}, stop=lambda: None)
    ex.pinner = running  # still pinning: nothing is read in place yet
    assert not ex.uses_device_plan(0, 1) and ex.mapped is not None and not ex.mapped.ready(0)
    running.done.set()
    running.info = {"pinned_bytes": 1, "verified_banks": ["layers.1.mlp.experts"]}
    assert [ex.mapped.ready(i) for i in range(3)] == [False, True, False]
    for layer, x, ids, w in _calls(reader, (1, 1, 1, 1, 1, 1), seed=3):
        y = ex(layer, x, ids, w)
        assert rel_err(y.float(), _full(reader, layer, x, ids, w)) < 1e-2
    s = ex.stats()
    assert s["bytes_mapped"] > 0  # layer 1 read in place
    assert s["per_layer"]["fetched"][0] + s["per_layer"]["cpu_experts"][0] > 0  # layer 0: fetches and CPU
    assert s["per_layer"]["cpu_experts"][1] == 0
    ex.pinner = None
    ex.close()


def test_ring_entries_are_not_reused_before_they_are_read_back(reader):
    """Routing read-back lags behind the GPU; with graph blocks queued in between, the oldest record is not always
    the ring entry a call is about to reuse. Every call's routing must reach the trace unchanged, in order."""
    from ft.runtime.gpu import mapped_path

    class Pending:  # an event that completes only when waited for: the GPU is far behind the host
        def query(self):
            return False

        def synchronize(self):
            pass

    ex = GpuExperts(reader, OffloadConfig(num_slots=3, trace_limit=1000), device="cpu", device_plan=True)
    ex.allocate()
    ex._record_compute = Pending
    md = ex.mapped
    routed = []
    g = torch.Generator().manual_seed(4)
    for i in range(mapped_path.RING + 9):
        ids = torch.randperm(E, generator=g)[:K][None]
        ex(1, torch.randn(1, H, generator=g).to(torch.bfloat16), ids, torch.ones(1, K))
        routed.append(sorted(ids[0].tolist()))
        if i % 7 == 3:  # a graph step's block record (layer 0) lands between ring entries
            md.graph_layers = [0]
            md.graph_buf[0, :, :K] = torch.tensor([[0, 1], [-1, -1], [1, 1]], dtype=torch.int32)[:, :K]
            md.record_step(1)
    ex.settle()
    assert [u.tolist() for layer, u in ex.trace if layer == 1] == routed
    ex.close()
