"""tools/bench_startup_imports.py runs each mode in a fresh process (the page cache is left alone here) and records
the imports' seconds and the read-ahead's end, with the list it recorded first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_startup_imports as bench  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux /proc")


def test_each_mode_is_timed_and_recorded(ftw_for, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "drop_cache", lambda paths: "left as found")
    monkeypatch.setattr(sys, "argv", ["bench_startup_imports.py", "--ftw", str(ftw_for("qwen3_moe")), "--out",
                                      str(tmp_path), "--reps", "1", "--modes", "none,list", "--in-flight", "8"])
    bench.main()
    [result] = json.loads((tmp_path / "startup_imports.json").read_text())
    assert [r["mode"] for r in result["runs"]] == ["none", "list"]
    assert result["list_bytes"] > 1 << 20 and result["in_flight_mib"] == "8"  # torch's libraries, at least
    for r in result["runs"]:
        assert 0 < r["imports_s"] <= r["read_ahead_s"]
