"""tools/profile_startup.py on the CPU: each run a fresh process that builds and warms up the engine as `ft serve`
does; its phases add up within the process's wall time, the engine's own start-up report comes along, and the
profile names the warm-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "profile_startup.py"


def test_each_run_reports_its_phases(ftw_for, tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(TOOL), "--ftw", str(ftw_for("qwen3_moe", "none")), "--out", str(out),
                    "--device", "cpu", "--runs", "2", "--top", "5"], check=True, capture_output=True, timeout=300)
    runs = json.loads((out / "startup.json").read_text())["runs"]
    assert [r["run"] for r in runs] == [1, 2]
    for r in runs:
        assert 0 < r["import_s"] + r["engine_s"] + r["warm_up_s"] <= r["process_s"]
        assert r["startup"]["load_s"] <= r["engine_s"] and len(r["startup"]["warm_up_steps_s"]) >= 2
        assert "warm_up: cumulative" in (out / f"run-{r['run']}" / "profile.txt").read_text()
