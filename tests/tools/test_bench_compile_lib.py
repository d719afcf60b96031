"""tools/bench_compile_lib.py's disk counters: the block device holding a file counts the bytes read from it, and the
timeline the compile-stages benchmark keeps samples them while its child runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_compile_lib import disk_counters, disk_timeline, evict  # noqa: E402

SIZE = 32 << 20


def test_the_disk_counts_what_is_read_from_it(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(SIZE))
    before = disk_counters(f)
    if before is None:
        pytest.skip("the test directory is not on a block device")
    os.sync()
    evict([f])
    before = disk_counters(f)
    with open(f, "rb", buffering=0) as fh:
        while fh.read(1 << 20):
            pass
    after = disk_counters(f)
    assert after[0] - before[0] >= SIZE * 3 // 4 and after[1] >= before[1] and after[2] >= before[2]


def test_the_timeline_samples_until_the_run_ends(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(b"x")
    if disk_counters(f) is None:
        pytest.skip("the test directory is not on a block device")
    turns = iter([True, True, True, False])
    rows = disk_timeline(f, lambda: next(turns), step=0.01)
    assert len(rows) == 3 and [len(r) for r in rows] == [4, 4, 4]
    assert rows[0][0] < rows[1][0] < rows[2][0]
    assert all(r[1] >= 0 and r[2] >= 0 and 0 <= r[3] <= 1 for r in rows)
