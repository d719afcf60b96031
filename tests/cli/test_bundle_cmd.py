"""`ft bundle` and `ft trust` end to end: keygen, a signed pack, trust, unpack (verified FTW), a tampered bundle."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ft.cli.main import app

runner = CliRunner()


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".ft-verified"}  # a machine-local note, not part of the FTW


def test_signed_bundle_round_trip_and_trust(ftw_for, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    ftw = ftw_for("qwen3_moe", "nvfp4")
    res = runner.invoke(app, ["trust", "keygen", str(tmp_path / "key")])
    assert res.exit_code == 0, res.output
    pub = (tmp_path / "key.pub").read_text().strip()
    res = runner.invoke(app, ["bundle", "pack", str(ftw), str(tmp_path / "m.ftb"), "--sign", str(tmp_path / "key")])
    assert res.exit_code == 0 and f"signed by {pub}" in res.output and "total" in res.output, res.output
    res = runner.invoke(app, ["bundle", "verify", str(tmp_path / "m.ftb")])
    assert res.exit_code == 0 and "does not trust" in res.output, res.output
    assert runner.invoke(app, ["trust", "add", pub]).exit_code == 0
    assert runner.invoke(app, ["trust", "list"]).output.split() == [pub]
    res = runner.invoke(app, ["bundle", "unpack", str(tmp_path / "m.ftb"), str(tmp_path / "out")])
    assert res.exit_code == 0 and "FTW verified" in res.output and f"trusted key {pub}" in res.output, res.output
    assert _files(tmp_path / "out") == _files(ftw)
    blob = bytearray((tmp_path / "m.ftb").read_bytes())
    blob[len(blob) // 3] ^= 0x40  # a flipped bit in some chunk
    (tmp_path / "bad.ftb").write_bytes(bytes(blob))
    res = runner.invoke(app, ["bundle", "verify", str(tmp_path / "bad.ftb")])
    assert res.exit_code == 1 and "FAIL" in res.output
    res = runner.invoke(app, ["trust", "add", "not-a-key"])
    assert res.exit_code == 1 and "64 hex" in res.output
