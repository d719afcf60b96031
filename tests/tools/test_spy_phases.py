"""tools/spy_phases.py cuts a py-spy chrome trace into time windows: each thread's time per window, attributed to the
innermost project frame and the leaf frame under it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import spy_phases  # noqa: E402


def _ev(ph: str, name: str, ts_s: float, tid: int = 1, file: str = "") -> dict:
    return {"ph": ph, "name": name, "ts": int(ts_s * 1e6), "tid": tid, "pid": 7, "cat": "py-spy",
            "args": {"filename": file, "line": 3}}


def test_windows_split_each_threads_time_by_frame(tmp_path):
    # thread 1: load() from 0 to 4 s (reading 1-4 s), then warm_up() 4-10 s waiting in a CUDA sync;
    # thread 2 appears at 2 s and pins until 10 s
    ev = [_ev("B", "thread (1): MainThread", 0), _ev("B", "load", 0, file="/x/ft/runtime/engine.py"),
          _ev("B", "pread", 1, file="/usr/lib/os.py"), _ev("E", "pread", 4), _ev("E", "load", 4),
          _ev("B", "warm_up", 4, file="/x/ft/runtime/engine.py"), _ev("B", "synchronize", 4, file="/t/cuda.py"),
          _ev("E", "synchronize", 10), _ev("E", "warm_up", 10), _ev("E", "thread (1): MainThread", 10),
          _ev("B", "thread (2): ft-pin", 2, tid=2), _ev("B", "pin_banks", 2, tid=2, file="/x/ft/runtime/gpu/p.py"),
          _ev("E", "pin_banks", 10, tid=2), _ev("E", "thread (2): ft-pin", 10, tid=2)]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(ev))
    text = spy_phases.report(trace, [4.0], top=5, min_s=0.5)
    first, second = text.split("== 4.0-10.0 s ==")
    assert "MainThread: 4.00 s" in first and "ft-pin: 2.00 s" in first
    assert "3.00 s  load (engine.py:3) -> pread (os.py:3)" in first
    assert "1.00 s  load (engine.py:3)" in first
    assert "6.00 s  warm_up (engine.py:3) -> synchronize (cuda.py:3)" in second
    assert "ft-pin: 6.00 s" in second
