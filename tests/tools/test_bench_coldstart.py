"""tools/bench_coldstart.py's cold-cache helpers: evicting an FTW's files from the page cache makes the next read
come from storage (the process's read_bytes grows by the file's size), and a second read does not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_coldstart as cold  # noqa: E402

SIZE = 32 << 20


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "experts").mkdir()
    (tmp_path / "experts" / "bank.bin").write_bytes(os.urandom(SIZE))
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def _read_all(path: Path) -> int:
    before = cold._read_bytes(os.getpid())
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return cold._read_bytes(os.getpid()) - before


def test_evicted_files_are_read_from_storage_again(tree):
    if cold._read_bytes(os.getpid()) is None:
        pytest.skip("no /proc/PID/io here")
    bank = tree / "experts" / "bank.bin"
    assert cold._evict(tree) == SIZE + 2  # every regular file, by size
    assert _read_all(bank) >= SIZE * 3 // 4  # from storage (readahead may round the count)
    assert _read_all(bank) == 0  # now cached


def test_cold_read_measures_the_largest_file_and_leaves_it_intact(tree):
    data = (tree / "experts" / "bank.bin").read_bytes()
    assert cold.cold_read_gbs(tree) > 0
    assert (tree / "experts" / "bank.bin").read_bytes() == data
