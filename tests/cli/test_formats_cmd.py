"""`ft verify` and `ft inspect` on a small hand-built FTW."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ft.cli.main import app
from ft.formats import FtwWriter
from ftw_testlib import moe_config

runner = CliRunner()


@pytest.fixture()
def ftw(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    w = FtwWriter(tmp_path / "m.ftw")
    w.add_tensor("embed_tokens.weight", torch.randn(64, 32, generator=g))
    w.add_tensor("lm_head.weight", torch.randn(64, 32, generator=g))
    bank = w.add_expert_bank("layers.0.mlp.experts", "fp32", 4,
                             {"gate_up": (torch.float32, (32, 32)), "down": (torch.float32, (32, 16))})
    for e in range(4):
        bank.write_expert(e, {"gate_up": torch.randn(32, 32, generator=g), "down": torch.randn(32, 16, generator=g)})
    w.add_asset("tokenizer.json", b"{}")
    return w.finish(config=moe_config(), quant={"linears": {}, "experts": "fp32", "source": None}, tokenizer={},
                    generation={}, provenance={"source": "unit-test"})


def test_version() -> None:
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("ft ")


def test_verify_accepts_sound_ftw(ftw: Path) -> None:
    res = runner.invoke(app, ["verify", str(ftw)])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output


def test_verify_reports_each_corrupt_region(ftw: Path) -> None:
    data = ftw / "data-00000.ftd"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF  # inside embed_tokens.weight
    raw[-4096 * 1 - 5] ^= 0x01  # inside the last expert record's padding or data
    data.write_bytes(bytes(raw))
    res = runner.invoke(app, ["verify", str(ftw)])
    assert res.exit_code == 1
    fails = [line for line in res.output.splitlines() if line.startswith("FAIL")]
    assert any("V20" in f and "embed_tokens.weight" in f for f in fails), res.output
    assert len(fails) == 2, res.output


def test_verify_refuses_structurally_broken_ftw(ftw: Path) -> None:
    (ftw / "model.ftw").write_bytes(b"GGUF" + bytes(60))
    res = runner.invoke(app, ["verify", str(ftw)])
    assert res.exit_code == 1
    assert "V3 bad magic" in res.output


def test_inspect_json(ftw: Path) -> None:
    res = runner.invoke(app, ["inspect", str(ftw), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["family"] == "qwen3_moe"
    assert s["parameters"]["experts"] == 4 * (32 * 32 + 32 * 16)
    assert s["parameters"]["dense"] == 2 * 64 * 32
    assert s["parameters"]["active_per_token"] == 2 * 64 * 32 + 2 * (32 * 32 + 32 * 16)
    assert s["bytes"]["experts"] == 4 * 8192
    assert s["formats"]["expert_banks"] == {"fp32": 1}


def test_inspect_human(ftw: Path) -> None:
    res = runner.invoke(app, ["inspect", str(ftw)])
    assert res.exit_code == 0, res.output
    assert "qwen3_moe" in res.output and "top-2" in res.output
