"""The speed model of `ft plan` (ft.runtime.plan.speed): its arithmetic on given inputs, the resident set's expected
hit rate, and its predictions against decode speeds MEASURED on an H200 and an H100 (benchmarks/gpu_full.md; the
comparison is also written out in benchmarks/plan_model.md)."""

from __future__ import annotations

import numpy as np
import pytest

from ft.formats.plan import PlanRates
from ft.runtime.plan import speed
from ft.runtime.plan.routing import hit_rates, preload_order, shares

# ---- measured on one H200 + 16-core host (benchmarks/gpu_full.md, runs 12, 28-34, 41-43), as the model's inputs ----
RECORD = 1_781_760  # qwen3moe-35b-geom and qwen3.6-35b-a3b: hidden 2048, moe_intermediate 512, NVFP4 record
GEOM = speed.Geometry(num_layers=40, moe_layers=40, top_k=8, num_experts=256, record_bytes=RECORD,
                      payload_bytes=RECORD, dense_bytes=2_217_394_176)  # dense: the engine's measurement
QWEN36 = speed.Geometry(40, 40, 8, 256, RECORD, RECORD, dense_bytes=3_921_912_832)
# HBM read rate of those runs (4.19-4.32 TB/s), the `ft bench bw` profile's record copies from page-locked memory
# (benchmarks/gpu.profile.json: 50.5 GB/s), the CPU lane's own fitted cost: runs 28-34 (11 threads: 15-26 us + 41-51
# us per expert), runs 42-43 (all cores but two, prefetching: 25-30 us + 32-34 us per expert)
H200 = PlanRates(hbm_read=4.25e12, h2d_pinned=55.2e9, h2d_expert_pinned=50.5e9, cpu_fixed_s=20e-6,
                 cpu_per_expert_s=46e-6, source="measured on an H200 (benchmarks/gpu_full.md, runs 28-34)")
H200_LANE14 = PlanRates(hbm_read=4.25e12, h2d_pinned=55.2e9, h2d_expert_pinned=50.5e9, cpu_fixed_s=27e-6,
                        cpu_per_expert_s=33e-6, source="measured on an H200 (benchmarks/gpu_full.md, runs 41-43)")
ALL = frozenset(range(40))
# an H100 + 16-core host with the current code (runs 103-110): dense linears kept quantized (the engine's dense
# bytes), HBM 3.08 TB/s, `ft bench bw`'s record copies 50.5 GB/s and CPU kernel 35.9 us per expert, the lane's
# starting fixed cost (14 us)
GEOM_Q = speed.Geometry(40, 40, 8, 256, RECORD, RECORD, dense_bytes=1_099_000_000)
QWEN36_Q = speed.Geometry(40, 40, 8, 256, RECORD, RECORD, dense_bytes=1_701_000_000)
H100 = PlanRates(hbm_read=3.076e12, h2d_pinned=55.0e9, h2d_expert_pinned=50.5e9, cpu_fixed_s=14e-6,
                 cpu_per_expert_s=35.9e-6, source="measured on an H100 (benchmarks/gpu_full.md, runs 103-110)")

# (row, geometry, the machine's rates then, measured hit rate, lane-only MoE layers, measured decode tok/s after 256
# tokens, all runs)
MEASURED = [
    ("geom uniform 8 GiB", GEOM, H200, 0.237, frozenset(), (115.9, 118.6, 114.5)),
    ("geom uniform 12 GiB", GEOM, H200, 0.473, frozenset(), (133.3, 139.4)),
    ("geom skewed 8 GiB", GEOM, H200, 0.550, frozenset(), (161.6, 157.1)),
    ("geom skewed 12 GiB", GEOM, H200, 0.745, frozenset(), (188.5, 192.1)),
    ("qwen3.6 uniform 8 GiB", QWEN36, H200, 0.146, frozenset(), (104.0,)),
    ("qwen3.6 uniform 12 GiB", QWEN36, H200, 0.397, frozenset(), (125.5,)),
    ("geom uniform 8 GiB, 12 GiB page-locked", GEOM, H200, 0.231, frozenset(range(28, 40)), (98.0,)),
    ("geom uniform 8 GiB, nothing page-locked", GEOM, H200, 0.233, ALL, (67.9,)),
    ("geom uniform 8 GiB, lane of 14", GEOM, H200_LANE14, 0.237, frozenset(), (132.9, 125.2)),
    ("geom uniform 12 GiB, lane of 14", GEOM, H200_LANE14, 0.475, frozenset(), (145.1, 153.3)),
    ("geom skewed 8 GiB, lane of 14", GEOM, H200_LANE14, 0.556, frozenset(), (179.4, 173.9)),
    ("H100 geom skewed 8 GiB (fit)", GEOM_Q, H100, 0.59, frozenset(), (189.5, 190.8, 196.0, 192.0, 196.4)),
    ("H100 geom skewed 12 GiB", GEOM_Q, H100, 0.77, frozenset(), (244.4, 255.3)),
    ("H100 qwen3.6 skewed 8 GiB", QWEN36_Q, H100, 0.46, frozenset(), (155.3,)),
]
RESIDENT = [("geom resident", GEOM, H200, 1.99e-3), ("qwen3.6 resident", QWEN36, H200, 2.69e-3),  # run 12, s a step
            ("H100 geom resident", GEOM_Q, H100, 1 / 526.2), ("H100 qwen3.6 resident", QWEN36_Q, H100, 1 / 401.5)]


@pytest.mark.parametrize("row,geom,rates,hit,lane_only,measured", MEASURED, ids=[m[0] for m in MEASURED])
def test_decode_prediction_is_within_20_percent_of_the_measured_speed(row, geom, rates, hit, lane_only, measured):
    got = speed.decode(geom, rates, [hit] * geom.moe_layers, offloaded=True, lane=True, lane_only=lane_only).tok_s
    for m in measured:
        assert abs(got / m - 1) <= 0.20, f"{row}: predicted {got:.1f} tok/s, measured {m}"


@pytest.mark.parametrize("row,geom,rates,step", RESIDENT, ids=[r[0] for r in RESIDENT])
def test_resident_step_is_within_20_percent(row, geom, rates, step):
    d = speed.decode(geom, rates, [1.0] * geom.moe_layers, offloaded=False, lane=True)
    assert d.terms.misses_s == d.terms.overhead_s == 0 and abs(d.terms.step_s / step - 1) <= 0.20


def test_uniform_resident_set_is_the_cached_share_and_close_to_the_measured_hit_rate():
    share = shares(None, 40, 256)
    for slots, measured in ((2266, (0.235, 0.239, 0.238)), (4606, (0.470, 0.475))):
        hits = hit_rates(share, preload_order(share), slots)
        assert max(hits) - min(hits) <= 1 / 256 + 1e-12  # round-robin over layers
        assert np.mean(hits) == pytest.approx(slots / 10240)
        assert all(0 <= m - np.mean(hits) <= 0.03 for m in measured)  # admissions add a little while serving


def test_prefill_bound_holds_for_the_measured_rows():
    # runs 28-31, uniform routing, 4096-token chunks: 7,974 / 5,634 experts without a slot at 8 / 12 GiB
    for slots, measured in ((2266, (13318, 14975)), (4606, (16608, 15889))):
        bound, line = speed.prefill(GEOM, H200, slots, 4096)
        assert all(0.7 * bound <= m <= bound for m in measured), (bound, measured)
        assert f"{10240 - slots} experts without a slot" in line
    assert speed.prefill(GEOM, H200, 10240, 4096)[0] is None  # resident: compute-bound, not predicted
    assert speed.prefill(GEOM, H200, 2266, 4096, lane_only=3)[0] is None


# ---- the arithmetic on small given inputs ---------------------------------------------------------------------
R = PlanRates(hbm_read=1e9, h2d_pinned=1e6, h2d_expert_pinned=1e6, cpu_fixed_s=1e-3, cpu_per_expert_s=2e-3,
              source="given")


def test_one_call_splits_misses_to_finish_both_paths_together():
    t_gpu = 3e-3  # seconds per copied record
    # 4 misses: F=2 -> max(6, 1 + 2*2 = 5) = 6 ms; F=1 -> max(3, 7) = 7; F=3 -> max(9, 3) = 9
    assert speed.call_cost(4, R, t_gpu, gpu=True, cpu=True) == (pytest.approx(6e-3), 2)
    assert speed.call_cost(4, R, t_gpu, gpu=True, cpu=False) == (pytest.approx(12e-3), 4)
    assert speed.call_cost(4, R, t_gpu, gpu=False, cpu=True) == (pytest.approx(9e-3), 0)
    assert speed.call_cost(0, R, t_gpu, gpu=True, cpu=True) == (0.0, 0)
    assert speed.call_cost(1, R, t_gpu, gpu=True, cpu=True) == (pytest.approx(3e-3), 1)  # a tie (3 ms each): the GPU


def test_a_layer_averages_the_calls_over_binomial_misses():
    t_gpu = 3e-3
    s, g, c = speed.layer_cost(0.5, 2, R, t_gpu, gpu=True, cpu=True)
    # misses 0 / 1 / 2 with probability 1/4, 1/2, 1/4: costs 0, 3 ms (GPU), 3 ms (one each: max(3, 3))
    one, f1 = speed.call_cost(1, R, t_gpu, gpu=True, cpu=True)
    two, f2 = speed.call_cost(2, R, t_gpu, gpu=True, cpu=True)
    assert s == pytest.approx(0.5 * one + 0.25 * two) and g == pytest.approx(0.5 * f1 + 0.25 * f2)
    assert g + c == pytest.approx(1.0)  # expected misses = k (1 - h)
    assert speed.layer_cost(1.0, 2, R, t_gpu, gpu=True, cpu=True) == (0.0, 0.0, 0.0)


def test_decode_step_adds_its_terms():
    geom = speed.Geometry(num_layers=3, moe_layers=2, top_k=2, num_experts=4, record_bytes=3000, payload_bytes=2000,
                          dense_bytes=10_000)
    d = speed.decode(geom, R, [0.5, 1.0], offloaded=True, lane=True)
    t = d.terms
    assert t.hbm_s == pytest.approx((10_000 + 2 * 2 * 2000) / 1e9)
    assert t.layers_s == pytest.approx(3 * speed.LAYER_S) and t.overhead_s == pytest.approx(2 * speed.MAPPED_LAYER_S)
    assert t.misses_s == pytest.approx(speed.layer_cost(0.5, 2, R, 3e-3, gpu=True, cpu=True)[0])
    assert t.step_s == pytest.approx(t.hbm_s + t.layers_s + t.misses_s + t.overhead_s) and d.tok_s == 1 / t.step_s
    assert d.gpu_misses + d.cpu_misses == pytest.approx(1.0)
    only_cpu = speed.decode(geom, R, [0.5, 1.0], offloaded=True, lane=True, lane_only=frozenset({0}))
    assert only_cpu.gpu_misses == 0 and only_cpu.terms.misses_s > t.misses_s
    no_lane = speed.decode(geom, R, [0.5, 1.0], offloaded=True, lane=False)
    assert no_lane.cpu_misses == 0 and no_lane.gpu_misses == pytest.approx(1.0)
    assert any("decode step" in line for line in d.lines)
    with pytest.raises(ValueError, match="1 hit rates for 2 MoE layers"):
        speed.decode(geom, R, [0.5], offloaded=True, lane=True)


def test_resident_set_takes_the_largest_shares_over_all_layers():
    counts = np.array([[8, 1, 1, 0], [3, 3, 2, 2]])
    share = shares(counts, 2, 4)
    order = preload_order(share)
    assert order[:3].tolist() == [[0, 0], [1, 0], [1, 1]]  # 0.8, then layer 1's 0.3 (by expert id)
    assert hit_rates(share, order, 3) == pytest.approx([0.8, 0.6])
    assert hit_rates(share, order, 8) == pytest.approx([1.0, 1.0]) and hit_rates(share, order, 0) == [0.0, 0.0]
    assert shares(np.zeros((2, 4)), 2, 4).tolist() == [[0.25] * 4] * 2  # a layer that counted nothing: uniform


def test_hit_rate_is_estimated_on_counts_the_choice_did_not_see():
    """Calibration counts from few tokens: the set with the largest counts holds far more of those same counts than
    of the routing to come. Uniform routing (512 tokens, top-8 of 256, 40 layers, 22 % of the experts cached): the
    in-sample share is ~0.30, what decode then sees ~0.22 (H200, bench_plan: 0.41 predicted, 0.23 measured); the
    held-out estimate says ~0.22. A skewed profile keeps its advantage."""
    from ft.runtime.plan.routing import held_out_hit_rates

    rng = np.random.default_rng(5)
    L, E, slots = 40, 256, 2266
    uniform = np.stack([rng.multinomial(512 * 8, np.full(E, 1 / E)) for _ in range(L)])
    share = shares(uniform, L, E)
    in_sample = float(np.mean(hit_rates(share, preload_order(share), slots)))
    held_out = float(np.mean(held_out_hit_rates(uniform, slots, E, L)))
    assert in_sample > 0.27 and abs(held_out - slots / (L * E)) < 0.02
    zipf = 1 / np.arange(1, E + 1) ** 1.1
    p = zipf / zipf.sum()
    skewed = np.stack([rng.multinomial(512 * 8, p) for _ in range(L)])
    truth = float(np.sort(p)[::-1][:slots // L].sum())  # the top experts' real mass, per layer
    assert abs(float(np.mean(held_out_hit_rates(skewed, slots, E, L))) - truth) < 0.05
