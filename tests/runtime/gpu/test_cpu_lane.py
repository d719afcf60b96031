"""The CPU lane (`cpu/lane.py` + `cpu/lane.c`): a decode call's misses split between the GPU's staged copies and the
CPU's spinning team, through the mailbox, summed into one result equal to the reference over all pairs. Without
CUDA the post / wait kernels run under Triton's interpreter on CPU tensors while the lane's threads answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.cpu.lane import CpuLane  # noqa: E402
from ft.runtime.gpu.cpu.kernel import load_library  # noqa: E402
from ft.runtime.gpu.kernels.gather import gather_missing  # noqa: E402
from ft.runtime.gpu.kernels.moe_reference import moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402

from .gpu_fixtures import random_mxfp4_records, random_records, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler for the CPU expert kernel")

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TOL = 2e-3 if CUDA else 1e-5
E, L, H, I = 16, 3, 64, 32


@pytest.fixture(scope="module")
def bank():
    layout = RecordLayout.packed(H, I)
    recs = random_records(layout, E, 11)
    return layout, recs, (recs.clone().pin_memory() if CUDA else recs.clone())


def _lane(layout, host, k, **bw):
    banks = {1: (host.data_ptr(), host.stride(0), E), 2: (host.data_ptr(), host.stride(0), E)}
    # 1e7 B/s: a miss costs far more than the CPU's fixed cost per call
    return CpuLane(layout, banks, L, k, DEV, threads=2, **({"b_gpu": 1e7, "b_cpu": 1e7} | bw))


def _call(lane, layout, host, ids, w, x, *, resident=(), out_dtype=torch.float32, after_post=None):
    """One mapped decode call of layer 1 with the lane: plan, post, (`after_post()`), GPU share, wait + add (stored
    as out_dtype)."""
    T, k = ids.shape
    pool = torch.zeros(len(resident) + T * k, layout.stride, dtype=torch.uint8, device=DEV)
    table = torch.full((L, E), -1, dtype=torch.int32, device=DEV)
    for slot, e in enumerate(resident):
        table[1, e] = slot
        pool[slot] = host[e].to(DEV)
    S = len(resident)
    slot, copy = gather_missing(pool, layout, ids.to(DEV), table, 1, host.data_ptr(), host.stride(0), S)
    lane.post(1, x.to(DEV), ids.to(DEV), w.to(DEV), slot, copy, S)
    if after_post is not None:
        after_post()
    pairs = torch.arange(T * k, dtype=torch.int32, device=DEV).view(T, k)
    y = moe_nvfp4_device(pool, layout, x.to(DEV), pairs, slot, w.to(DEV)).float().contiguous()
    y = lane.finish(y, out_dtype)
    assert y.dtype == out_dtype
    if CUDA:
        torch.cuda.synchronize()
    lane.check()
    return y.cpu(), slot.cpu(), copy.cpu()


@pytest.mark.parametrize("T,k,resident", [(1, 4, ()), (2, 4, (3, 5)), (3, 2, (0,))])
def test_split_call_equals_reference_over_all_pairs(bank, T, k, resident):
    layout, recs, host = bank
    lane = _lane(layout, host, k)
    g = torch.Generator().manual_seed(T * 10 + k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    try:
        for _ in range(2):  # the second call reuses the mailbox with the next sequence number
            y, slot, copy = _call(lane, layout, host, ids, w, x, resident=resident)
            assert rel_err(y, moe_ref(recs, layout, x, ids, w)) < TOL
        staged = int((copy != 0).sum())
        on_cpu = int((copy == 2).sum())
        # equal costs per miss, plus the CPU's fixed cost: the CPU takes the smaller half
        assert on_cpu == staged // 2 and staged >= 2
        assert bool((slot[copy == 2] == -1).all())
        assert all(int(ids.reshape(-1)[p]) not in resident for p in torch.nonzero(copy == 2).flatten().tolist())
        assert lane.counters()["jobs"] == (2 if on_cpu else 0)
    finally:
        lane.close()


@pytest.mark.parametrize("bw,expect", [({"b_cpu": 0.0}, "none"), ({"b_gpu": 1e3, "b_cpu": 1e9}, "all")])
def test_split_follows_the_bandwidths(bank, bw, expect):
    layout, recs, host = bank
    lane = _lane(layout, host, 4, **bw)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    w = torch.rand(2, 4, generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    try:
        y, _, copy = _call(lane, layout, host, ids, w, x)
        assert int((copy == 2).sum()) == (0 if expect == "none" else 8)
        assert rel_err(y, moe_ref(recs, layout, x, ids, w)) < TOL
    finally:
        lane.close()


def test_the_wait_stores_the_sum_in_the_compute_dtype(bank):
    """finish(y, bf16): the GPU's fp32 sum plus the CPU's, rounded once on the store (the interpreter's store
    truncates: within one bf16 step of the fp32 result)."""
    layout, recs, host = bank
    lane = _lane(layout, host, 4)
    g = torch.Generator().manual_seed(3)
    ids, w = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(2)]), torch.rand(2, 4, generator=g)
    x = torch.randn(2, H, generator=g).to(torch.bfloat16)
    try:
        y32, _, copy = _call(lane, layout, host, ids, w, x)
        y16, _, copy16 = _call(lane, layout, host, ids, w, x, out_dtype=torch.bfloat16)
        assert int((copy == 2).sum()) > 0 and torch.equal(copy, copy16)  # the CPU took a share both times
        assert ((y16.float() - y32).abs() <= y32.abs() * 2 ** -7 + 1e-30).all()
    finally:
        lane.close()




@pytest.mark.parametrize("act", ["clamped_swiglu", "silu"])
def test_an_mxfp4_split_call_equals_reference_over_all_pairs(act):
    """gpt-oss records (E8M0 scales per 32, biases; its clamped SwiGLU, or silu): the lane takes its share of the
    misses like for NVFP4, and GPU + CPU shares sum to the reference."""
    layout = RecordLayout.packed(H, I, "mxfp4", act=act)
    recs = random_mxfp4_records(layout, E, 12)
    host = recs.clone().pin_memory() if CUDA else recs.clone()
    lane = _lane(layout, host, 4)
    g = torch.Generator().manual_seed(13)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(2)])
    w = torch.rand(2, 4, generator=g)
    x = (torch.randn(2, H, generator=g) * 2).to(torch.bfloat16)
    try:
        y, slot, copy = _call(lane, layout, host, ids, w, x, resident=(int(ids[0, 0]),))
        assert rel_err(y, moe_ref(recs, layout, x, ids, w)) < TOL
        assert int((copy == 2).sum()) == int((copy != 0).sum()) // 2 >= 3
        assert lane.counters()["jobs"] == 1 and lane.counters()["refused"] == 0
    finally:
        lane.close()


def test_a_scheme_without_a_cpu_decode_is_refused(bank):
    """RecordLayout refuses unknown scheme names itself; this stands for one the GPU kernels gain before the CPU's."""
    import dataclasses

    layout, recs, host = bank
    other = dataclasses.replace(layout)
    object.__setattr__(other, "scheme", "mxfp8")
    with pytest.raises(ValueError, match="reads nvfp4, mxfp4 records, not 'mxfp8'"):
        _lane(other, host, 4)


def test_a_post_for_a_layer_without_a_bank_is_refused(bank):
    layout, recs, host = bank
    lane = _lane(layout, host, 4, b_gpu=1e3)
    try:
        ids = torch.tensor([[1, 2, 3, 4]], device=DEV)
        x = torch.randn(1, H).to(torch.bfloat16).to(DEV)
        slot = torch.arange(4, dtype=torch.int32, device=DEV)
        copy = torch.ones(4, dtype=torch.int32, device=DEV)
        lane.post(0, x, ids, torch.ones(1, 4, device=DEV), slot, copy, 0)  # layer 0: no bank in this lane
        y = lane.finish(torch.zeros(1, H, device=DEV))
        if CUDA:
            torch.cuda.synchronize()
        assert float(y.abs().max()) == 0.0
        with pytest.raises(RuntimeError, match="refused a malformed post"):
            lane.check()
        assert lane.counters()["refused"] == 1
    finally:
        lane.close()


def test_refit_fits_the_cost_line_of_the_lanes_jobs(bank):
    """Jobs of 1 and 3 experts taking 50 and 110 us: fixed 20 us (+ the signalling) and 30 us per expert."""
    from ft.runtime.gpu.cpu.lane import SIGNAL_S, STATS

    layout, recs, host = bank
    lane = _lane(layout, host, 4)
    try:
        jobs = [(1, 50_000)] * 40 + [(3, 110_000)] * 40
        napped = [(2, 900_000)] * 30  # found the team napping: counted, left out of the fit
        lane.counters = lambda: _totals(jobs, napped)
        lane.refit()
        assert lane.t_cpu == pytest.approx(30e-6) and lane.t_fixed == pytest.approx(20e-6 + SIGNAL_S)
        assert lane.split.cpu().tolist()[1:3] == pytest.approx([30e-6, 20e-6 + SIGNAL_S])
        assert set(lane.counters()) == set(STATS)
    finally:
        lane.close()


def _totals(fitted, napped=()):
    both = [*fitted, *napped]
    return {"jobs": len(both), "pairs": sum(e for e, _ in both), "experts": sum(e for e, _ in both),
            "busy_ns": sum(ns for _, ns in both), "refused": 0, "fit_jobs": len(fitted),
            "fit_experts": sum(e for e, _ in fitted), "fit_ns": sum(ns for _, ns in fitted),
            "fit_experts_sq": sum(e * e for e, _ in fitted), "fit_experts_ns": sum(e * ns for e, ns in fitted),
            "outliers": 0}


def test_jobs_slower_than_the_fitted_line_stay_out_of_the_next_fit(bank, monkeypatch):
    """After a fit, the lane leaves out of its sums any job slower than OUTLIER times the fitted line (a preempted
    thread would otherwise drag least squares: run 63 priced the CPU at 324 us an expert while its jobs averaged 65);
    a starved reset lifts the cap, so a host that really got slower is fitted again."""
    from ft.runtime.gpu.cpu import lane as mod

    layout, recs, host = bank
    lane = _lane(layout, host, 4)
    g = torch.Generator().manual_seed(5)
    ids, w, x = torch.randperm(E, generator=g)[:4].view(1, 4), torch.rand(1, 4, generator=g), torch.randn(1, H)

    def jobs(n):
        before = lane.counters()
        for _ in range(n):
            _call(lane, layout, host, ids, w, x.to(torch.bfloat16))
        return {k: v - before[k] for k, v in lane.counters().items()}

    clock = [1000.0]
    monkeypatch.setattr(mod, "monotonic", lambda: clock[0])
    try:
        assert jobs(3)["outliers"] == 0  # no fit yet: no cap
        real = lane.counters
        lane.counters = lambda: _totals([(1, 200)] * 40 + [(3, 400)] * 40)  # a fit of 100 ns an expert, 100 fixed
        lane.refit()
        assert lane.t_cpu == pytest.approx(100e-9)
        lane.counters = real
        lane._seen[:] = np.array(list(real().values()), np.float64)
        got = jobs(3)  # real jobs take microseconds: over 4 x (100 + 100 n) ns
        assert got["outliers"] == got["jobs"] == 3 and got["fit_jobs"] == 0
        clock[0] += mod.STARVED_S + 1
        lane.refit()  # too few fitted jobs for STARVED_S: starting costs, cap lifted
        assert jobs(3)["outliers"] == 0
    finally:
        lane.close()


def test_a_split_that_starves_the_lane_goes_back_to_its_starting_costs(bank, monkeypatch):
    """A bad fit (e.g. from jobs slowed by something else) prices the CPU out: it then gets too few jobs to correct
    the fit, so after STARVED_S without enough jobs for a fit the split returns to the costs it started from."""
    from ft.runtime.gpu.cpu import lane as mod

    layout, recs, host = bank
    lane = _lane(layout, host, 4)
    clock = [1000.0]
    monkeypatch.setattr(mod, "monotonic", lambda: clock[0])
    try:
        start = (lane.t_cpu, lane.t_fixed)
        lane._last_fit = clock[0]
        lane.counters = lambda: _totals([(1, 2_000_000)] * 40 + [(3, 2_100_000)] * 40)
        lane.refit()
        assert lane.t_fixed > 1e-3  # priced out
        clock[0] += mod.STARVED_S / 2
        lane.refit()  # no new job yet, not long enough
        assert lane.t_fixed > 1e-3
        bad = [(1, 2_000_000)] * 40 + [(3, 2_100_000)] * 40
        lane.counters = lambda: _totals(bad + [(1, 2_000_000)] * 5)  # a trickle: 5 jobs, too few for a fit
        clock[0] += mod.STARVED_S
        lane.refit()
        assert (lane.t_cpu, lane.t_fixed) == start
        assert lane.split.cpu().tolist()[1:3] == pytest.approx(list(start))
    finally:
        lane.close()


def test_jobs_after_an_idle_stretch_are_left_out_of_the_fit(bank):
    """The lane's threads nap after SPIN_NS idle; the first job after that includes waking them up."""
    import time

    layout, recs, host = bank
    lane = _lane(layout, host, 4)
    try:
        time.sleep(0.1)  # the team naps
        ids, w = torch.tensor([[0, 1, 2, 3]]), torch.full((1, 4), 0.25)
        _call(lane, layout, host, ids, w, torch.randn(1, H).bfloat16().float())
        c = lane.counters()
        assert c["jobs"] >= 1 and c["fit_jobs"] < c["jobs"]
    finally:
        lane.close()


def test_the_lane_reads_page_locked_banks_through_their_locked_view(monkeypatch):
    """`lane_for` hands the lane the uploader's page-locked view of a registered bank (pages already mapped: no page
    fault per 4 KiB on first read), and the reader's own mapping for a bank left unregistered."""
    import types

    from ft.runtime.gpu.cpu import lane as lane_mod

    got = {}

    class Recorder:
        def __init__(self, layout, banks, *args, **kwargs):
            got.update(banks)

    layout = RecordLayout.packed(H, I)
    own = {0: (1000, 10 * layout.stride), 1: (5000, 10 * layout.stride)}  # the reader's mapping of each bank
    bank_of = {0: "b0", 1: "b1"}
    ex = types.SimpleNamespace(
        opts=types.SimpleNamespace(cpu_lane=True, b_pcie=1e9, b_cpu=1e9, cpu_threads=2), device=torch.device("cpu"),
        interpret=True, profile={}, layout=layout, L=L, k=2, E=10,
        banks={i: types.SimpleNamespace(name=n, stride=layout.stride) for i, n in bank_of.items()},
        uploader=types.SimpleNamespace(locked_address=lambda ptr, n: 777_000 if ptr == 1000 else None))
    monkeypatch.setattr(lane_mod, "CpuLane", Recorder)
    monkeypatch.setattr(lane_mod, "bank_range", lambda bank: own[int(bank.name[1])])
    md = types.SimpleNamespace(ex=ex, base={0: 123}, lane_only={1})
    lane_mod.lane_for(md)
    assert got == {0: (777_000, layout.stride, 10), 1: (5000, layout.stride, 10)}


def test_a_resting_lane_answers_its_posts_and_leaves_the_cores_to_the_host(bank):
    """While the host runs its own CPU share (host-planned calls), the lane's idle threads nap instead of spinning; a
    job posted meanwhile is still answered, equal to the reference, and left out of the fit (its time includes waking
    the team up)."""
    import time

    layout, recs, host = bank
    lane = _lane(layout, host, 4)
    ids, w = torch.tensor([[0, 1, 2, 3]]), torch.full((1, 4), 0.25)
    x = torch.randn(1, H).bfloat16().float()

    def cpu_seconds_while_idle() -> float:  # this process's CPU time (all threads) while the main thread sleeps
        t = time.process_time()
        time.sleep(0.01)
        return time.process_time() - t

    resting = []

    def rest_now() -> None:  # right after a post: without the flag the team spins for 20 ms once the job is done
        jobs = lane.counters()["jobs"]
        lane.rest(True)
        deadline = time.monotonic() + 5
        while lane.counters()["jobs"] == jobs and time.monotonic() < deadline:  # the job's own CPU time is not idle
            time.sleep(0.0005)
        time.sleep(0.002)  # a turn of the idle loop sees the flag
        resting.append(cpu_seconds_while_idle())

    try:
        want, _, _ = _call(lane, layout, host, ids, w, x, after_post=rest_now)
        # the 2 threads spinning would take ~10 ms of CPU each in the 10 ms (measured: 8-26 ms in all without the
        # flag); resting, they wake every 500 us for microseconds (0.1 ms in all)
        assert resting[0] < 0.0025
        before = lane.counters()
        got, _, _ = _call(lane, layout, host, ids, w, x)
        after = lane.counters()
        assert torch.equal(got, want)
        assert after["jobs"] == before["jobs"] + 1 and after["fit_jobs"] == before["fit_jobs"]
        lane.rest(False)
        assert not lane.resting
    finally:
        lane.close()
