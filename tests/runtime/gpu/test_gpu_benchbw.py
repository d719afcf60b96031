"""`ft bench bw` without a GPU says so and exits 1; profiles round-trip through the cache dir."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ft.cli.main import app
from ft.runtime.gpu.benchbw import profile_path, save_profile


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_bw_without_cuda_exits_1():
    res = CliRunner().invoke(app, ["bench", "bw"])
    assert res.exit_code == 1
    assert "needs a CUDA GPU" in res.output


def test_profile_lands_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prof = {"version": 1, "gpu": {"uuid": "GPU-x", "name": "Test GPU"}, "b_pcie": 1e9, "b_cpu": 2e9}
    path = save_profile(prof)
    assert path == profile_path("GPU-x") == tmp_path / "ft" / "bench" / "GPU-x.json"
    assert json.loads(path.read_text()) == prof
