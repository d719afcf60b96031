"""EngineSettings: every value checked once, at construction, each problem naming its flag; normalised values; and the
`ft serve` / `ft generate` flags generated from its fields."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from typer.testing import CliRunner

from ft.cli.main import app
from ft.runtime.settings import EngineSettings, flag


@pytest.mark.parametrize("kwargs,message", [
    ({"kv_reserve_tokens": 0}, "--kv-reserve-tokens must be >= 1"),
    ({"max_running_requests": 0}, "--max-running-requests must be >= 1"),
    ({"memory_ratio": 0.0}, "--memory-ratio must be in (0, 1]"),
    ({"memory_ratio": 1.5}, "--memory-ratio must be in (0, 1]"),
    ({"dense_weights": "fp4"}, "--dense-weights 'fp4'"),
    ({"vram_budget": "8 potatoes"}, "--vram-budget: cannot read"),
    ({"vram_budget": 0}, "--vram-budget: a byte count must be positive"),
    ({"device": "tpu"}, "--device 'tpu'"),
    ({"prefix_cache_entries": -1}, "--prefix-cache-entries must be >= 0"),
    ({"plan": "../gpu"}, "--plan '../gpu': a plan name is a plain file name"),
])
def test_each_bad_value_names_its_flag(kwargs, message):
    with pytest.raises(ValueError) as e:
        EngineSettings(**kwargs)
    assert message in str(e.value)


def test_all_problems_in_one_error():
    with pytest.raises(ValueError) as e:
        EngineSettings(kv_reserve_tokens=0, memory_ratio=2.0, dense_weights="x")
    assert all(f in str(e.value) for f in ("--kv-reserve-tokens", "--memory-ratio", "--dense-weights"))


def test_values_are_normalised():
    s = EngineSettings(vram_budget="8GiB", device="auto")
    assert s.vram_budget == 8 << 30 and isinstance(s.vram_budget, int)
    assert s.device == ("cuda" if torch.cuda.is_available() else "cpu") and s.cuda == torch.cuda.is_available()
    assert EngineSettings(vram_budget=12e9).vram_budget == 12_000_000_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        EngineSettings(device="cuda")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_setting_is_a_flag_of_serve_and_generate(command):
    help_text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    for f in fields(EngineSettings):
        assert flag(f.name) in help_text, f.name
    assert "--enforce-eager" in help_text


def test_generate_refuses_a_bad_setting_before_loading(tmp_path):
    res = CliRunner().invoke(app, ["generate", "--ftw", str(tmp_path), "--token-ids", "1", "--memory-ratio", "3"])
    assert res.exit_code == 1 and "--memory-ratio must be in (0, 1]" in res.output
