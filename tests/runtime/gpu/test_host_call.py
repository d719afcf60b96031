"""Host-planned calls on the CPU emulation path: the "GPU" pool is a CPU tensor computed by the reference, the CPU
side is the real CPU kernel; outputs must equal the full mixture, the counters must add up, and the split follows
its cost lines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.gpu.kernels.moe_reference import moe_ref
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.record_layout import RecordLayout
from ft.runtime.gpu.split import AffineCost, SplitEstimator, fetch_count, optimal_share
from ft.runtime.gpu.store import GpuExperts

from .gpu_fixtures import rel_err, tiny_moe_ftw

E, K, H = 8, 2, 64


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return FtwReader(tiny_moe_ftw(tmp_path_factory.mktemp("hyb") / "m.ftw", experts=E, top_k=K, hidden=H))


def _full_ref(reader, layer, x, ids, w):
    bank = reader.bank(f"layers.{layer}.mlp.experts")
    layout = RecordLayout.from_bank(bank, H, 32)
    recs = torch.stack([bank.record(e) for e in range(E)])
    return moe_ref(recs, layout, x, ids, w)


def _calls(n, T, seed, skew=None):
    g = torch.Generator().manual_seed(seed)
    p = torch.ones(E) if skew is None else skew
    for i in range(n):
        layer = i % 3
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.multinomial(p, K, generator=g) for _ in range(T)])
        w = torch.rand(T, K, generator=g)
        yield layer, x, ids, w


# the split's starting bandwidths: both paths alike, the CPU hopeless (every miss fetched while slots last), the
# link hopeless (every miss on the CPU)
SPLITS = {"both": (1e9, 1e9), "fetch": (1e9, 1.0), "cpu": (1.0, 1e9)}


@pytest.mark.parametrize("split", SPLITS)
def test_host_planned_output_is_the_full_mixture(reader, split):
    b_pcie, b_cpu = SPLITS[split]
    ex = GpuExperts(reader, OffloadConfig(num_slots=5, b_pcie=b_pcie, b_cpu=b_cpu, cpu_fixed_s=0.0),
                    device="cpu")
    for layer, x, ids, w in _calls(12, 2, seed=1):
        y = ex(layer, x, ids, w)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert rel_err(y.float(), _full_ref(reader, layer, x, ids, w)) < 1e-2  # bf16 output rounding
    s = ex.stats()
    assert s["fetched"] + s["cpu_experts"] == s["misses"]
    assert s["hits"] + s["misses"] == sum(len(np.unique(i.numpy())) for _, _, i, _ in _calls(12, 2, seed=1))
    if split == "fetch":
        assert s["cpu_experts"] == 0 and s["fetched"] > 0
    if split == "cpu":
        assert s["fetched"] == 0 and s["hits"] == 0
    if split == "both":
        assert s["fetched"] > 0 and s["cpu_experts"] > 0
    assert s["bytes_h2d"] == s["fetched"] * ex.layout.stride
    ex.close()


def test_partial_sums_merge_exactly(reader):
    # fp32 view: the sum of disjoint partial sums equals the one-device sum up to fp32 rounding
    ex = GpuExperts(reader, OffloadConfig(num_slots=3, b_pcie=1e8, b_cpu=1e8, cpu_fixed_s=0.0), device="cpu")
    x = torch.randn(3, H).to(torch.float32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 4]])
    w = torch.rand(3, K)
    ex.allocate()
    y = ex(0, x.to(torch.bfloat16), ids, w)  # 5 misses: split between "GPU" and CPU
    assert 0 < ex.stats()["fetched"] < 5
    ref = _full_ref(reader, 0, x.to(torch.bfloat16), ids, w)
    assert rel_err(y.float(), ref) < 5e-3
    ex.close()


def test_prefill_streams_without_evicting(reader):
    ex = GpuExperts(reader, OffloadConfig(num_slots=4, prefill_tokens=8, prefill_slots=2, b_cpu=1.0), device="cpu")
    layer, x, ids, w = next(_calls(1, 2, seed=3))
    ex(layer, x, ids, w)  # decode fills some slots
    before = ex.cache.owner.copy()
    for layer, x, ids, w in _calls(3, 16, seed=4):
        y = ex(layer, x, ids, w)
        assert rel_err(y.float(), _full_ref(reader, layer, x, ids, w)) < 1e-2
    assert np.array_equal(ex.cache.owner, before)
    s = ex.stats()
    assert s["prefill_calls"] == 3 and s["prefill_streamed"] > 2  # more misses than one buffer: double-buffered
    ex.close()


def test_resident_placement(reader):
    rs = GpuExperts(reader, OffloadConfig(mode="resident"), device="cpu")
    for layer, x, ids, w in _calls(6, 1, seed=5):
        assert rel_err(rs(layer, x, ids, w).float(), _full_ref(reader, layer, x, ids, w)) < 1e-2
    r = rs.stats()
    assert r["misses"] == 0 and r["num_slots"] == 3 * E
    rs.close()


def test_split_math():
    assert optimal_share(50.0, 50.0) == 0.5
    assert optimal_share(0.0, 0.0) == 0.0
    assert fetch_count(10, 1.0, 1.0) == 5
    # q = 1/3: F in {3, 4}; waits max(3, 7*0.5)=3.5 vs max(4, 3)=4 -> 3
    assert fetch_count(10, 1.0, 0.5) == 3
    assert fetch_count(10, 1.0, 1.0, cap=2) == 2
    assert fetch_count(0, 1.0, 1.0) == 0
    est = SplitEstimator.from_bandwidths(1000, 1000.0, 3000.0, alpha=0.5, cpu_fixed_s=0.0)
    assert est.share == pytest.approx(0.25)
    est.observe_cpu(8, 8 * 3.0)  # the CPU turned out 9x slower per expert than the profile said
    assert est.share > 0.25
    fixed = SplitEstimator.from_bandwidths(1000, 1000.0, 3000.0, fixed=True)
    fixed.observe_cpu(8, 24.0)
    assert fixed.share == pytest.approx(0.25)


def test_affine_split_keeps_small_steps_off_a_cpu_with_fixed_cost():
    # per expert the CPU is 3x faster, but each CPU call costs 5 fetches' worth of fixed time
    est = SplitEstimator.from_bandwidths(1000, 1000.0, 3000.0, fetch_fixed_s=0.0, cpu_fixed_s=5.0)
    assert est.count(4) == 4  # max(4, 0) beats any split (the CPU side alone would take > 5)
    assert 0 < est.count(64) < 64  # enough misses: the CPU takes a share again
    assert fetch_count(64, 1.0, 1 / 3, fixed_cpu=5.0) == est.count(64)


def test_affine_fit_recovers_fixed_and_per_expert_cost():
    cost = AffineCost(fixed=0.0, per=1.0, decay=0.9)
    for n in [1, 2, 4, 8, 3, 6] * 20:
        cost.observe(n, 0.5 + 0.1 * n)  # true line: 0.5 s + 0.1 s per expert
    assert cost.fixed == pytest.approx(0.5, rel=0.05) and cost.per == pytest.approx(0.1, rel=0.05)
    cost.observe(3, float("nan"))  # ignored
    assert cost(0) == 0.0 and cost(2) == pytest.approx(0.7, rel=0.05)


def test_bad_options_refused(reader):
    with pytest.raises(ValueError, match="unknown offload mode"):
        OffloadConfig(mode="magic", num_slots=1)
    for gone in ("hybrid", "offload", "cpu", "static"):  # the modes that did not earn their keep
        with pytest.raises(ValueError, match="unknown offload mode"):
            OffloadConfig(mode=gone, num_slots=1)
    with pytest.raises(ValueError, match="needs vram_budget or num_slots"):
        GpuExperts(reader, OffloadConfig(), device="cpu").allocate()
