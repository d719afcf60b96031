"""The compile's final check runs on the finished temp dir before the rename: a failure leaves nothing at the output
path (nor a temp dir), whatever the mode; "sample" (default) and "full" both pass on a good compile and produce
identical bytes; an unknown mode is refused before anything is read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ft.compiler.checkpoint as checkpoint
from ft.compiler import CheckpointError, compile_checkpoint
from ft.compiler.synth import synth
from ft.formats import FtwReader

CLI = [sys.executable, "-c", "from ft.cli.main import main; main()"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return synth("qwen3_moe", "tiny", tmp_path_factory.mktemp("verify") / "src", dtype="fp32")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != ".ft-verified"}


def test_modes_pass_and_agree(src: Path, tmp_path: Path) -> None:
    a = compile_checkpoint(src, tmp_path / "a.ftw", progress=False)
    b = compile_checkpoint(src, tmp_path / "b.ftw", progress=False, verify="full")
    assert FtwReader(a).verify() == [] and _files(a) == _files(b)


@pytest.mark.parametrize("mode", ["sample", "full"])
def test_failed_check_keeps_nothing(src: Path, tmp_path: Path, monkeypatch, mode: str) -> None:
    seen: list[Path] = []
    real_check = checkpoint.check

    def corrupt_then_check(r, plan, progress=None):
        # flip a byte of the last region of the last data file: both plans read it
        seen.append(r.path)
        last = max(plan)
        start = plan[last][-1][0]
        with open(r.path / r.records.files[last].name, "r+b") as f:
            f.seek(start)
            b = f.read(1)
            f.seek(start)
            f.write(bytes([b[0] ^ 0xFF]))
        return real_check(r, plan, progress)

    monkeypatch.setattr(checkpoint, "check", corrupt_then_check)
    out = tmp_path / "out.ftw"
    with pytest.raises(CheckpointError, match="verification failed after writing .*nothing was kept"):
        compile_checkpoint(src, out, progress=False, verify=mode)
    assert seen and seen[0].name.startswith(".out.ftw.tmp-")  # checked before the rename
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_unknown_mode_is_refused(src: Path, tmp_path: Path) -> None:
    res = subprocess.run([*CLI, "checkpoint", "--model", str(src), "--out", str(tmp_path / "x.ftw"), "--no-progress",
                          "--verify", "some"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "--verify 'some' is not supported; supported: sample, full" in res.stderr
    assert not (tmp_path / "x.ftw").exists()
