"""tools/plot_gpu_full.py: which measurement each bar shows (the latest default run of each row, ours and the peer's),
and an SVG that parses."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import plot_gpu_full as plot  # noqa: E402


def _run(date, command, models):
    return {"date": date, "command": command, "models": models}


def _budget(gib, tok_s, variant=None, ratio=None):
    warm = {"tok_s": tok_s, **({"vs_llama_cpp": ratio} if ratio else {})}
    return {"budget_gib": gib, "variant": variant or {}, "decode_warm": warm}


def test_each_row_shows_its_latest_default_run_beside_its_peer():
    runs = [
        _run("2026-12-01 10:00 UTC", "gpu_run.sh --budgets 8", {
            "qwen3moe-35b-geom": {"decode": [{"batch": 1, "context": 32, "tok_s": 500.0, "vs_llama_cpp": 1.25,
                                              "bound_ms": 0.5}, {"batch": 1, "context": 8192, "tok_s": 390.0}],
                                  "budgets": [_budget(8, 100.0, ratio=100 / 84.5)]}}),
        _run("2026-12-02 10:00 UTC", "gpu_run.sh --budgets 8 --variants x", {
            "qwen3moe-35b-geom": {"budgets": [_budget(8, 120.0, ratio=120 / 84.5),
                                              _budget(8, 999.0, variant={"cpu_lane": False})]},
            "qwen3.6-35b-a3b": {"budgets": [_budget(8, 118.0), {"budget_gib": 12, "decode_warm": {}}]}}),
        _run("2026-12-03 10:00 UTC", "gpu_run.sh --routing skewed --budgets 8", {
            "qwen3moe-35b-geom": {"budgets": [_budget(8, 170.0, ratio=2.0)]}}),
        {**_run("2026-12-04 10:00 UTC", "gpu_run.sh --routing skewed --budgets 8", {  # measured removed code
            "qwen3moe-35b-geom": {"budgets": [_budget(8, 130.0, ratio=1.5)]}}), "superseded": "removed since"},
        {**_run("2026-12-05 10:00 UTC", "gpu_run.sh --routing skewed --budgets 8", {  # another GPU than the peer's
            "qwen3moe-35b-geom": {"budgets": [_budget(8, 140.0, ratio=1.6)]}}), "gpu": "NVIDIA H100 80GB HBM3"},
    ]
    got = {(r.model, r.placement, r.routing): r for r in plot.rows(runs)}
    assert set(got) == {("qwen3moe-35b-geom", "resident", "uniform"), ("qwen3moe-35b-geom", "8 GiB", "uniform"),
                        ("qwen3.6-35b-a3b", "8 GiB", "uniform"), ("qwen3moe-35b-geom", "8 GiB", "skewed")}
    resident = got[("qwen3moe-35b-geom", "resident", "uniform")]
    assert (resident.tok_s, resident.peer, resident.bound_tok_s) == (500.0, ("llama.cpp", 400.0), 2000.0)
    uniform = got[("qwen3moe-35b-geom", "8 GiB", "uniform")]  # the later run; its variant row left out
    assert uniform.tok_s == 120.0 and uniform.date == "2026-12-02" and uniform.peer[1] == 84.5
    skewed = got[("qwen3moe-35b-geom", "8 GiB", "skewed")]  # not the superseded run's
    assert skewed.peer == ("llama.cpp", 85.0) and skewed.tok_s == 170.0  # nor the H100's
    assert plot.rows(runs, gpu="NVIDIA H100 80GB HBM3")[-1].tok_s == 140.0
    assert got[("qwen3.6-35b-a3b", "8 GiB", "uniform")].peer == ("FreeToken", 39.3)  # the peer the JSON lacks
    page = ET.fromstring(plot.svg(list(got.values())))
    texts = " ".join(t.text or "" for t in page.iter() if t.tag.endswith("text"))
    assert "ft 120.0" in texts and "llama.cpp 84.5" in texts and "bound 2,000.0" in texts
