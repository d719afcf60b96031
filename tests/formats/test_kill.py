"""A writer killed with SIGKILL leaves nothing a reader accepts at the output path; a rerun cleans up and completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ftw_testlib import finish

from ft.formats import FtwError, FtwReader, FtwWriter
from ft.formats import errors as E

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

# Writes 200 tensors (4 data files at shard_bytes=64 KiB), sleeping between them; announces progress on stdout.
WRITER = """
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from ftw_testlib import finish
from ft.formats import FtwWriter
w = FtwWriter(sys.argv[1], shard_bytes=64 << 10)
for i in range(200):
    w.add_tensor(f"t{i}", torch.full((1024,), float(i)))
    if i == 5:
        print("writing", flush=True)
    time.sleep(float(sys.argv[3]))
print("finishing", flush=True)
finish(w)
print("done", flush=True)
"""


def start_writer(out: Path, sleep_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(Path(__file__).parent), str(sleep_s)],
                            stdout=subprocess.PIPE, text=True)


def kill_after(proc: subprocess.Popen, line: str, delay_s: float) -> None:
    assert proc.stdout is not None
    while (got := proc.stdout.readline()) and got.strip() != line:
        pass
    assert got.strip() == line, "writer exited early"
    time.sleep(delay_s)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()  # reap it: a zombie would still look alive to the stale-dir cleanup


def rerun(out: Path) -> None:
    w = FtwWriter(out, force=True)
    for i in range(3):
        w.add_tensor(f"t{i}", torch.full((1024,), float(i)))
    finish(w)


def test_kill_mid_write_leaves_no_ftw_and_rerun_completes(tmp_path: Path) -> None:
    out = tmp_path / "m"
    proc = start_writer(out, sleep_s=0.02)
    kill_after(proc, "writing", 0.1)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    with pytest.raises(E.FtwNotFoundError):
        FtwReader(out)
    temp = tmp_path / f".m.tmp-{proc.pid}"
    assert temp.is_dir() and any(temp.glob("data-*.ftd"))  # it really died mid-write
    with pytest.raises(FtwError):  # the half-written temp dir has no index: not an FTW either
        FtwReader(temp)

    rerun(out)
    assert not temp.exists()  # the stale temp dir of the dead writer was removed
    r = FtwReader(out)
    assert r.tensor_names() == ["t0", "t1", "t2"] and r.verify() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_kill_during_finish_leaves_nothing_or_a_sound_ftw(tmp_path: Path) -> None:
    out = tmp_path / "m"
    proc = start_writer(out, sleep_s=0.0)
    kill_after(proc, "finishing", 0.005)  # lands in finish(): fsyncs, index, renames -- or just after
    if out.exists():  # the rename happened: everything must be there and sound
        r = FtwReader(out)
        assert len(r.tensor_names()) == 200 and r.verify() == []
    else:
        with pytest.raises(E.FtwNotFoundError):
            FtwReader(out)
    rerun(out)
    assert FtwReader(out).verify() == [] and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
