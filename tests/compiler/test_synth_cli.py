"""`ft synth` command line: bad input is refused with one clear line naming what exists, output is atomic, --force
replaces, and a run writes a complete checkpoint."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ft.cli.main import app
from ft.compiler.synth import SynthError, synth

runner = CliRunner()


@pytest.mark.parametrize("args,code,needle", [
    (["--arch", "llama", "--preset", "tiny"], 2, "supported: qwen3_moe, qwen2_moe, mixtral, qwen3_next, qwen3_5_moe"),
    (["--arch", "qwen3_moe", "--preset", "huge"], 2, "presets: tiny (qwen3_moe"),
    (["--arch", "mixtral", "--preset", "demo"], 2, "demo (qwen3_5_moe)"),
    (["--arch", "qwen3_moe", "--preset", "qwen3.6-35b-a3b"], 2, "does not exist for arch 'qwen3_moe'"),
    (["--arch", "qwen3_moe", "--preset", "tiny", "--quant", "int4"], 2, "supported: none, nvfp4"),
    (["--arch", "qwen3_moe", "--preset", "tiny", "--routing", "zipf"], 2, "supported: uniform, skewed"),
    (["--arch", "qwen3_moe", "--preset", "tiny", "--dtype", "fp8"], 2, "supported: bf16, fp32"),
    (["--arch", "qwen3_moe", "--preset", "tiny", "--expert-layout", "fused"], 2, "only for qwen3_5_moe"),
    (["--arch", "qwen3_5_moe", "--preset", "tiny", "--quant", "nvfp4", "--expert-layout", "fused"], 2,
     "NVFP4 and FP8 releases store experts per expert"),
    (["--arch", "qwen3_moe", "--preset", "qwen3-30b-a3b", "--quant", "fp8"], 2,
     "quant 'fp8' is written for the in-memory presets only (tiny, small, demo), not 'qwen3-30b-a3b'"),
    (["--arch", "qwen3_moe", "--preset", "tiny", "--override", "num_expertz=4"], 2, "['num_expertz'] are not"),
    (["--arch", "qwen3_moe", "--preset", "tiny", "--quant", "nvfp4", "--override", "moe_intermediate_size=40"], 1,
     "in_features % 16 == 0"),
])
def test_bad_input_is_one_clear_line(tmp_path, args, code, needle):
    res = runner.invoke(app, ["synth", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == code, res.output
    assert needle in " ".join(res.output.split())
    assert not (tmp_path / "o").exists() and not (tmp_path / "o-twin").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = runner.invoke(app, ["synth", "--arch", "qwen2_moe", "--preset", "tiny", "--out", str(out)])
    assert res.exit_code == 2 and "not empty" in res.output and (out / "keep.txt").exists()
    res = runner.invoke(app, ["synth", "--arch", "qwen2_moe", "--preset", "tiny", "--out", str(out), "--force",
                              "--seed", "3", "--layers", "1", "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output and not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert synth("qwen2_moe", "tiny", empty, num_layers=1) == empty  # an empty directory is fine
    with pytest.raises(SynthError, match="--force"):
        synth("qwen2_moe", "tiny", empty)


def test_nvfp4_twin_also_guarded(tmp_path):
    (tmp_path / "q-twin").mkdir()
    (tmp_path / "q-twin" / "x").write_text("x")
    with pytest.raises(SynthError, match="q-twin exists and is not empty"):
        synth("qwen3_moe", "tiny", tmp_path / "q", quant="nvfp4")
    assert not (tmp_path / "q").exists()


def test_no_twin_writes_the_quantized_checkpoint_alone(tmp_path):
    res = runner.invoke(app, ["synth", "--arch", "qwen3_moe", "--preset", "tiny", "--quant", "nvfp4", "--layers", "1",
                              "--no-twin", "--out", str(tmp_path / "q")])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output and "-twin" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no twin, no temporary directory left behind
    synth("qwen3_moe", "tiny", tmp_path / "ref", quant="nvfp4", num_layers=1)
    assert (tmp_path / "ref-twin").is_dir()
    names = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert "hf_quant_config.json" in names and sorted(p.name for p in (tmp_path / "q").iterdir()) == names
    for f in names:  # the same quantized checkpoint, byte for byte, with or without its twin
        assert (tmp_path / "q" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
