"""The start-up file list: what a start used is recorded (module files whole, mapped files by the pages mapped in),
read back, read ahead first by the next start, and a bad list is ignored."""

from __future__ import annotations

import json
import mmap
import os
import sys
from pathlib import Path

import pytest

from ft.formats import prefetch, startup_files

pytestmark = pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux /proc")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _ranges_of(ranges, path: Path) -> list[tuple[int, int]]:
    return [(a, n) for p, a, n in ranges if p == path]


def test_mapped_files_are_recorded_by_the_pages_this_process_touched(tmp_path):
    data = tmp_path / "lib" / "blob.bin"
    data.parent.mkdir()
    size, far = 64 << 20, 40 << 20
    data.write_bytes(b"\1" * size)
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m.madvise(mmap.MADV_RANDOM)  # no fault-around (a large folio still maps in whole: up to 2 MiB here)
        _ = m[5], m[far + 5]
        out = startup_files.record(path=tmp_path / "list.json")
        excluded = startup_files.record(exclude=tmp_path / "lib", path=tmp_path / "excluded.json")
        (tmp_path / "snapshot").mkdir()  # a Hub snapshot: its files are links to blobs elsewhere
        (tmp_path / "snapshot" / "data-00000.ftd").symlink_to(data)
        linked = startup_files.record(exclude=tmp_path / "snapshot", path=tmp_path / "linked.json")
    ranges = startup_files.load(out)
    mine = _ranges_of(ranges, data)
    for touched in (5, far + 5):
        assert any(a <= touched < a + n for a, n in mine), (touched, mine)
    assert len(mine) == 2 and sum(n for _, n in mine) <= 8 << 20, mine  # not the 36 MiB between them
    assert _ranges_of(startup_files.load(excluded), data) == [] == _ranges_of(startup_files.load(linked), data)
    # an imported module: its files, whole (the bytecode the import read, if any, and the source)
    for f in (startup_files.__cached__, startup_files.__file__):
        if os.path.isfile(f):
            this = Path(os.path.abspath(f))
            assert (0, this.stat().st_size) in _ranges_of(ranges, this)
    libs = [p for p, _, _ in ranges if ".so" in p.name]
    assert libs, "the interpreter's shared libraries are mapped files"


def test_a_list_that_does_not_parse_is_no_list(tmp_path):
    path = tmp_path / "list.json"
    good = {"version": startup_files.VERSION, "files": [["/usr/lib/x.so", [[0, 4096], [8192, 4096]]]]}
    path.write_text(json.dumps(good))
    assert startup_files.load(path) == [(Path("/usr/lib/x.so"), 0, 4096), (Path("/usr/lib/x.so"), 8192, 4096)]
    for bad in ("{", json.dumps({**good, "version": 0}), json.dumps({"files": good["files"]}),
                json.dumps({**good, "files": [["relative.so", [[0, 1]]]]}),
                json.dumps({**good, "files": [["/x.so", [[-1, 1]]]]}),
                json.dumps({**good, "files": [["/x.so", [[0, 0]]]]}), json.dumps([1, 2])):
        path.write_text(bad)
        assert startup_files.load(path) == [], bad
    assert startup_files.load(tmp_path / "missing.json") == []


def test_the_list_is_one_per_interpreter_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    path = startup_files.list_path()
    assert path.parent == tmp_path / "startup"
    monkeypatch.setattr(sys, "executable", "/other/python")
    assert startup_files.list_path() != path


def test_the_read_ahead_reads_the_list_first_and_skips_what_is_gone(tmp_path, monkeypatch):
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\0" * (4 * PAGE))
    listed = [(tmp_path / "gone.so", 0, PAGE), (lib, PAGE, 2 * PAGE)]
    monkeypatch.setattr(startup_files, "load", lambda: listed)
    calls = []
    monkeypatch.setattr(prefetch, "will_need", lambda fd, off, n, **kw: calls.append((os.readlink(
        f"/proc/self/fd/{fd}"), off, n)))
    ftw = tmp_path / "m.ftw"
    ftw.mkdir()
    dense = [(ftw / "data-00000.ftd", 0, 100)]
    (ftw / "data-00000.ftd").write_bytes(b"\0" * 100)
    monkeypatch.setattr(prefetch, "read_ahead_ranges", lambda _: (dense, []))
    prefetch._read_ahead(ftw)
    assert calls == [(str(lib), PAGE, 2 * PAGE), (str(ftw / "data-00000.ftd"), 0, 100)]


def test_without_pagemap_the_modules_are_still_recorded(tmp_path, monkeypatch):
    def no_pagemap(wanted):
        raise PermissionError("pagemap")

    monkeypatch.setattr(startup_files, "_mapped_pages", no_pagemap)
    ranges = startup_files.load(startup_files.record(path=tmp_path / "list.json"))
    assert ranges and not any(".so" in p.name for p, _, _ in ranges)
    assert all(p.suffix in (".py", ".pyc") for p, _, _ in ranges)


def test_recording_asks_its_pause_before_each_file_and_stops_when_told(tmp_path):
    """A server records only while idle: `pause` is asked throughout (before each module and mapped file), and a
    pause that says stop (the server is shutting down) leaves no list behind."""
    asked = []
    out = startup_files.record(path=tmp_path / "list.json", pause=lambda: asked.append(1) or True)
    assert out == tmp_path / "list.json" and startup_files.load(out)
    assert len(asked) > 10
    calls = iter(range(1_000_000))
    assert startup_files.record(path=tmp_path / "stopped.json", pause=lambda: next(calls) < 5) is None
    assert not (tmp_path / "stopped.json").exists()
