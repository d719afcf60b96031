"""`ft kernels build` and `ft checkpoint --kernels`: bad arguments are refused with one line, before any work (the
real build: tests/compiler/test_kernels_build.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from ft.cli.main import app

runner = CliRunner()


def test_bad_archs_and_groups_are_refused_before_anything_is_built(ftw_for, hf_for, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    ftw = ftw_for("qwen3_moe", "nvfp4")
    res = runner.invoke(app, ["kernels", "build", "--ftw", str(ftw), "--arch", "90,hopper"])
    assert res.exit_code == 1 and "'hopper' is not a CUDA architecture" in res.output, res.output
    res = runner.invoke(app, ["kernels", "build", "--ftw", str(ftw), "--arch", "90", "--groups", "fused,nope"])
    assert res.exit_code == 1 and "unknown kernel groups ['nope']" in res.output, res.output
    res = runner.invoke(app, ["kernels", "build", "--ftw", str(tmp_path / "missing"), "--arch", "90"])
    assert res.exit_code == 1 and "V1 missing file" in res.output, res.output
    assert not (tmp_path / "home").exists()  # nothing trusted, nothing written
    res = runner.invoke(app, ["checkpoint", "--model", str(hf_for("qwen3_moe")), "--out", str(tmp_path / "out"),
                              "--kernels", "sm9x"])
    assert res.exit_code == 1 and "'sm9x' is not a CUDA architecture" in res.output, res.output
    assert not (tmp_path / "out").exists()  # refused before the compile
