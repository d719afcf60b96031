"""`ft checkpoint` as a process: kill -9 mid-compile leaves nothing that verifies and a rerun completes; a hub repo id
resolves through the huggingface_hub cache in offline mode (through the CLI)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ft.compiler import compile_checkpoint
from ft.compiler.synth import synth
from ft.formats import FtwError, FtwReader

CLI = [sys.executable, "-c", "from ft.cli.main import main; main()"]


def test_kill_9_mid_compile_then_rerun(tmp_path: Path) -> None:
    # ~100 MB of fp32 experts: the compile is still streaming (or fsyncing, before the rename) when the first
    # data bytes appear in its temp dir
    src = synth("qwen3_moe", "tiny", tmp_path / "src", dtype="fp32",
                overrides={"hidden_size": 256, "num_experts": 32, "moe_intermediate_size": 256,
                           "num_hidden_layers": 4})
    out = tmp_path / "out.ftw"
    proc = subprocess.Popen([*CLI, "checkpoint", "--model", str(src), "--out", str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    tmp = None
    while time.monotonic() < deadline and proc.poll() is None:
        tmp = next(tmp_path.glob(".out.ftw.tmp-*"), None)
        data = tmp / "data-00000.ftd" if tmp else None
        if data is not None and data.is_file() and data.stat().st_size > 0:
            break
        time.sleep(0.002)
    assert proc.poll() is None, f"compile ended before it could be killed: {proc.stderr.read().decode()[-500:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert tmp is not None and tmp.is_dir()  # the stale half-written temp dir ...
    with pytest.raises(FtwError):  # ... has no index, so nothing there verifies
        FtwReader(tmp)
    compile_checkpoint(src, out, progress=False)
    assert FtwReader(out).verify() == []
    assert not list(tmp_path.glob(".out.ftw.tmp-*"))  # the rerun removed the stale temp dir


def test_repo_id_offline_from_hf_cache(tmp_path: Path) -> None:
    src = synth("mixtral", "tiny", tmp_path / "src", dtype="fp32")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-mixtral"
    shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out.ftw"
    res = subprocess.run([*CLI, "checkpoint", "--model", "someorg/tiny-mixtral", "--out", str(out), "--no-progress"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    r = FtwReader(out)
    assert r.provenance["source"] == "someorg/tiny-mixtral" and r.provenance["revision"] == commit
    assert str(tmp_path) not in str(r.manifest)  # no absolute paths recorded
    assert r.config.family == "mixtral"

    res = subprocess.run([*CLI, "checkpoint", "--model", "someorg/absent", "--out", str(tmp_path / "x.ftw")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "someorg/absent: cannot fetch from the Hugging Face hub" in res.stderr
    assert "Traceback" not in res.stderr
