"""The cold-cache helpers of tools/bench_coldstart.py (and bench_compile_lib.py): evicting an FTW's files from the page
cache makes the next read come from storage (the process's read_bytes, what the benchmark reports at ready, grows by
the file's size), and a second read does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_coldstart as cold  # noqa: E402
from bench_compile_lib import evict  # noqa: E402

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


def _fs_type(path: Path) -> str:
    """The type of the filesystem `path` is on (the longest mount point above it in /proc/self/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mount, fs = line.split()[1:3]
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fs
    return kind


def test_evicted_files_are_read_from_storage_again(tree):
    if cold._read_bytes(os.getpid()) is None:
        pytest.skip("no /proc/PID/io here")
    if _fs_type(tree) in ("tmpfs", "ramfs"):
        pytest.skip("the test directory is in memory: nothing to evict to")
    bank = tree / "experts" / "bank.bin"
    assert cold.ftw_files(tree) == [tree / "config.json", bank]
    os.sync()  # freshly written pages are dirty: they must reach the disk before they can be dropped
    evict(cold.ftw_files(tree))
    assert _read_all(bank) >= SIZE * 3 // 4  # from storage (readahead may round the count)
    assert _read_all(bank) == 0  # now cached


def test_the_reads_of_a_live_child_count(tree):
    """The server's read-ahead runs in a child process: its reads are the server's too."""
    if cold._read_bytes(os.getpid()) is None or _fs_type(tree) in ("tmpfs", "ramfs"):
        pytest.skip("no /proc/PID/io here, or nothing to evict to")
    bank = tree / "experts" / "bank.bin"
    os.sync()
    evict([bank])
    before = cold._read_bytes(os.getpid())
    code = "import sys; open(sys.argv[1], 'rb').read(); print('read', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code, str(bank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "read"
        assert cold._read_bytes(os.getpid()) - before >= SIZE * 3 // 4
    finally:
        child.stdin.close()
        child.wait(30)


def test_cold_read_measures_the_largest_file_and_leaves_it_intact(tree):
    data = (tree / "experts" / "bank.bin").read_bytes()
    assert cold.cold_read_gbs(tree) > 0
    assert (tree / "experts" / "bank.bin").read_bytes() == data


def test_the_engine_stats_take_the_page_locking_from_beside_the_engine(monkeypatch):
    """/v1/stats puts the expert cache's stats (its page-locking among them) beside "engine", not inside it."""
    body = {"engine": {"startup": {"load_s": 1.0}, "kernels": {"compiled_since_start": 0}},
            "moe": {"pin": {"pinned_bytes": 5, "seconds": 1.5}}}
    monkeypatch.setattr(cold, "_get", lambda url: (200, body))
    got = cold._engine_stats("http://127.0.0.1:1")
    assert got == {"kernels": {"compiled_since_start": 0}, "startup": {"load_s": 1.0},
                   "pin": {"pinned_bytes": 5, "seconds": 1.5}}
