"""ft.formats.prefetch: what a start asks the kernel to read ahead (the dense tensors, then the expert banks up to
the page-locking's allowance), that it stays inside the FTW, and that the commands that call it import no torch
before it runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ft.formats import FtwReader, slots
from ft.formats import prefetch as pf


@pytest.fixture()
def ftw(ftw_for, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ftw_for("qwen3_moe", "nvfp4"), tmp_path / "m"))


def _covers(ranges, path: Path, offset: int, nbytes: int) -> bool:
    return any(p == path and o <= offset and offset + nbytes <= o + n for p, o, n in ranges)


def test_the_dense_tensors_come_first_then_every_bank_in_layer_order(ftw: Path) -> None:
    slots.put_entry(ftw, "plans", "gpu.json", json.dumps({"resident": [[1, 3]]}).encode())  # a plan changes nothing
    r = FtwReader(ftw)
    got, banks = pf.read_ahead_ranges(ftw, gap=0)
    data = lambda i: ftw / r.records.files[i].name  # noqa: E731
    assert all(_covers(got, data(t.file), t.offset, t.nbytes) for t in r.records.tensors.values())
    assert [o for _, o, _ in got] == sorted(o for _, o, _ in got)  # file order
    for bank in r.records.banks.values():
        assert not any(p == data(bank.file) and o < bank.offset + bank.nbytes and bank.offset < o + n
                       for p, o, n in got)
    assert len(pf.read_ahead_ranges(ftw)[0]) < len(got)  # tensors a little apart are read as one range
    by_layer = sorted(r.records.banks.values(), key=lambda b: int(b.name.split(".")[1]))  # model.layers.N.mlp...
    assert banks == [(data(b.file), b.offset, b.nbytes) for b in by_layer] and len(banks) > 1


def _joined(asked: list) -> list:
    """Consecutive WILLNEED calls on one file joined into ranges (path, offset, nbytes)."""
    out: list = []
    for path, off, n, _ in asked:
        if out and out[-1][0] == path and out[-1][1] + out[-1][2] == off:
            out[-1] = (path, out[-1][1], out[-1][2] + n)
        else:
            out.append((path, off, n))
    return out


def test_read_ahead_asks_the_kernel_for_those_ranges_and_nothing_outside(ftw: Path, monkeypatch) -> None:
    if pf.WILLNEED is None:
        pytest.skip("no posix_fadvise here")
    monkeypatch.setattr(pf.startup_files, "load", lambda: [])  # this machine's start-up list: its own test
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: asked.append((os.readlink(
        f"/proc/self/fd/{fd}"), off, n, advice)))
    monkeypatch.setattr(pf, "bank_allowance", lambda: 1 << 40)
    monkeypatch.setattr(pf, "advice_step", lambda fd: 4096)  # the kernel's per-call limit, made small
    pf.start_prefetch(ftw, process=False).join()  # patched calls: in this process
    dense, banks = pf.read_ahead_ranges(ftw)
    assert _joined(asked) == [(str(p.resolve()), o, n) for p, o, n in dense + banks] and asked
    assert {a for *_, a in asked} == {pf.WILLNEED} and max(n for _, _, n, _ in asked) == 4096
    assert len(asked) > len(dense + banks)  # ranges over one step were asked for step by step
    first_bank = banks[0][2]
    monkeypatch.setattr(pf, "MAX_BYTES", 100)  # both caps hold: 100 bytes of dense, then banks up to the allowance
    monkeypatch.setattr(pf, "bank_allowance", lambda: first_bank + 7)
    asked.clear()
    pf.start_prefetch(ftw, process=False).join()  # patched calls: in this process
    assert [n for _, _, n in _joined(asked)] == [100, first_bank, 7]


def _read_bytes() -> int:
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("read_bytes:")))


def test_the_read_ahead_runs_in_a_child_that_dies_with_its_parent(ftw: Path, tmp_path: Path) -> None:
    """A forked child reads ahead (the imports beside it hold this process's GIL for seconds) and is reaped by the
    returned thread; when the process exits first, the child is killed with it."""
    if pf.WILLNEED is None or not hasattr(os, "fork"):
        pytest.skip("no posix_fadvise or fork here")
    marks = tmp_path / "marks"
    code = f"""
import os, sys, time
from pathlib import Path
from ft.formats import prefetch as pf
def read_ahead(ftw):
    Path({str(marks)!r}).write_text(str(os.getpid()))
    time.sleep(float(sys.argv[1]))
pf._read_ahead = read_ahead
t = pf.start_prefetch({str(ftw)!r})
t.join(float(sys.argv[2]))
print(os.getpid(), t.is_alive())
"""
    out = subprocess.run([sys.executable, "-c", code, "0", "30"], capture_output=True, text=True, timeout=60)
    parent, reaped = out.stdout.split()
    assert int(marks.read_text()) != int(parent) and reaped == "False"  # it ran in another process, now reaped
    proc = subprocess.run([sys.executable, "-c", code, "60", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split()[1] == "True"  # the parent left while the child still ran
    child = int(marks.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.05)
    assert not _running(child)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_will_need_brings_the_whole_range_into_the_page_cache(tmp_path: Path) -> None:
    """One WILLNEED call reads at most the device's readahead (8 MiB on this project's machines), silently; the
    step-by-step calls read all of it: afterwards reading the file costs no storage reads."""
    if pf.WILLNEED is None or not Path("/proc/self/io").exists():
        pytest.skip("no posix_fadvise or /proc/self/io here")
    path = tmp_path / "bank.bin"
    path.write_bytes(os.urandom(48 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        probe = _read_bytes()
        os.pread(fd, 1, 24 << 20)
        if _read_bytes() == probe:
            pytest.skip("this filesystem reports no storage reads (in memory)")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert pf.MIN_STEP <= pf.advice_step(fd) <= pf.MAX_STEP
        pf.will_need(fd, 0, 48 << 20)
        before = _read_bytes()
        n = 0
        while n < 48 << 20:
            n += len(os.pread(fd, 1 << 20, n))
        assert _read_bytes() - before < 4 << 20  # all of it was already read (or queued) by will_need
    finally:
        os.close(fd)


def test_the_bank_allowance_is_half_of_the_available_memory() -> None:
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo here")
    avail = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemAvailable:")) * 1024
    assert abs(pf.bank_allowance() - avail // 2) < 256 << 20  # MemAvailable moves a little between the two reads


def test_a_hostile_or_broken_ftw_is_not_read_ahead(ftw: Path, tmp_path: Path) -> None:
    data = next(ftw.glob("data-*.ftd"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)  # a data file that is a link out of the FTW
    assert pf.read_ahead_ranges(ftw) == ([], [])
    (ftw / "model.ftw").write_bytes(b"not an index")
    assert pf.read_ahead_ranges(ftw) == ([], [])
    assert pf.start_prefetch(tmp_path / "missing") is None


def test_the_commands_start_it_before_importing_torch() -> None:
    code = "import sys, ft.cli.main, ft.formats.prefetch; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_will_need_keeps_at_most_in_flight_bytes_asked_for_and_unread(monkeypatch) -> None:
    """With `in_flight`, each step asked for beyond that many bytes first waits for the oldest step's last byte
    (a 1-byte read returns once the kernel has read that page)."""
    if pf.WILLNEED is None:
        pytest.skip("no posix_fadvise here")
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append(("ask", off, n)))
    monkeypatch.setattr(os, "pread", lambda fd, n, off: calls.append(("wait", off, n)) or b"x")
    pf.will_need(3, 100, 10_000, step=4096, in_flight=8192)  # 3 steps, 2 in flight
    assert calls == [("ask", 100, 4096), ("ask", 4196, 4096), ("ask", 8292, 1808), ("wait", 4195, 1)]
    calls.clear()
    pf.will_need(3, 0, 10_000, step=4096)  # unbounded: no waits
    assert [c[0] for c in calls] == ["ask"] * 3
