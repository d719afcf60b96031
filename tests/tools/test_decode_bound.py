"""tools/decode_bound.py: the bound of a budget row from its own Belady replay and the run's HBM rate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import decode_bound  # noqa: E402


def _row(hit_rate: float, tok_s: float | None = 100.0) -> dict:
    # 2 MoE layers, top-4: 8 records a token of 1 MB; 1 GB of dense weights
    return {"budget_gib": 8.0, "plan": {"dense": 1e9}, "trace": {"moe_layers": [0, 1]},
            "moe": {"pairs": 400, "tokens": 100, "record_bytes": 1e6}, "belady": {"hit_rate": hit_rate},
            "decode_warm": {"tok_s": tok_s}}


def test_bound_reads_the_resident_part_at_hbm_rate_and_the_misses_over_the_link():
    # 6 hits: 1.006 GB at 1,000 GB/s = 1.006 ms; 2 misses: 2 MB at 10 GB/s = 0.2 ms
    assert decode_bound.bound_tok_s(_row(0.75), hbm_gbs=1000.0, miss_gbs=10.0) == pytest.approx(1 / 1.206e-3)
    # every record a hit: HBM only; none: the link carries all 8 MB
    assert decode_bound.bound_tok_s(_row(1.0), 1000.0, 10.0) == pytest.approx(1 / 1.008e-3)
    assert decode_bound.bound_tok_s(_row(0.0), 1000.0, 10.0) == pytest.approx(1 / 1.8e-3)


def test_rows_give_the_ratio_and_leave_rows_without_a_replay_unbounded():
    run = {"hbm_read_gbs": 1000.0, "models": {"m": {"budgets": [_row(0.75), {"budget_gib": 12.0, "error": "OOM"}]}}}
    measured, failed = decode_bound.rows(run, miss_gbs=10.0)
    assert measured["of_bound"] == pytest.approx(100.0 * 1.206e-3)
    assert failed["bound_tok_s"] is None and failed["of_bound"] is None and failed["tok_s"] is None


def test_geom_rows_are_divided_by_llama_cpp_at_the_placement_that_fits_their_budget():
    entry = {"run": 68, "benches": [
        {"n_cpu_moe": 24, "tests": [{"test": "tg128", "avg_ts": 50.0}, {"test": "pp4096", "avg_ts": 1000.0}]},
        {"n_cpu_moe": 14, "tests": [{"test": "tg128", "avg_ts": 80.0}]}]}
    llama = decode_bound.llama_rates(entry)
    assert llama == {24: {"tg128": 50.0, "pp4096": 1000.0}, 14: {"tg128": 80.0}}
    twelve = {**_row(0.75, tok_s=120.0), "budget_gib": 12.0}
    run = {"hbm_read_gbs": 1000.0, "models": {
        "qwen3moe-35b-geom": {"budgets": [{**_row(0.75), "prefill": {"tok_s": 1500.0}}, twelve]},
        "other": {"budgets": [_row(0.75)]}}}
    eight, twelve, other = decode_bound.rows(run, miss_gbs=10.0, llama=llama)
    assert eight["vs_llama"] == pytest.approx(2.0) and eight["prefill_vs_llama"] == pytest.approx(1.5)
    assert twelve["vs_llama"] == pytest.approx(1.5) and twelve["prefill_vs_llama"] is None  # no pp4096 at -ncmoe 14
    assert other["vs_llama"] is None  # llama.cpp ran geom's geometry only


def test_same_peak_takes_the_fewest_cpu_layers_whose_measured_peak_fits_the_budget():
    entry = {"run": 75, "benches": [
        {"n_cpu_moe": 24, "peak_gpu_mem_mib": 9149, "tests": [{"test": "tg128", "avg_ts": 120.0}]},
        {"n_cpu_moe": 27, "peak_gpu_mem_mib": 7850, "tests": [{"test": "tg128", "avg_ts": 110.0}]},
        {"n_cpu_moe": 30, "peak_gpu_mem_mib": 6550, "tests": [{"test": "tg128", "avg_ts": 100.0}]},
        {"n_cpu_moe": 27, "peak_gpu_mem_mib": 10296, "tests": [{"test": "pp4096", "avg_ts": 8000.0}]}]}
    llama = decode_bound.llama_rates(entry)
    assert llama[27] == {"tg128": 110.0, "peak:tg128": 7850.0, "pp4096": 8000.0, "peak:pp4096": 10296.0}
    assert decode_bound.same_peak(llama, 8.0, "tg128") == (27, 110.0)  # 24 needs 8.9 GiB
    assert decode_bound.same_peak(llama, 8.0, "pp4096") is None  # its prefill buffers never fit 8 GiB here
    assert decode_bound.same_peak(llama, 6.0, "tg128") is None
    row = {**_row(0.75, tok_s=220.0), "prefill": {"tok_s": 12000.0}}
    r, = decode_bound.rows({"hbm_read_gbs": 1000.0, "models": {"qwen3moe-35b-geom": {"budgets": [row]}}}, 10.0, llama)
    assert r["vs_llama"] == pytest.approx(220 / 120) and r["vs_llama_same_peak"] == pytest.approx(2.0)
    assert r["llama_same_peak"] == (27, 110.0) and r["prefill_vs_llama_same_peak"] is None
