"""`ft checkpoint` refuses bad or unsupported input with one clear error naming the file or key (and what is
supported), before writing anything; a full disk removes the partial output."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ft.compiler import CheckpointError, compile_checkpoint
from ft.compiler.synth import synth


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth("qwen3_moe", "tiny", tmp_path_factory.mktemp("src") / "q3", dtype="fp32")


@pytest.fixture
def copy(tiny: Path, tmp_path: Path):
    def make(name: str = "ck") -> Path:
        return Path(shutil.copytree(tiny, tmp_path / name))
    return make


def edit_config(d: Path, fn) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def refused(src: Path, out: Path, match: str, **kw) -> None:
    with pytest.raises(CheckpointError, match=match):
        compile_checkpoint(src, out, progress=False, **kw)
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_missing_shard_is_named(copy, tmp_path: Path) -> None:
    d = copy()
    (d / "model-00002-of-00004.safetensors").unlink()
    refused(d, tmp_path / "o.ftw", r"model\.safetensors\.index\.json names shard\(s\) that are missing: "
                                   r"model-00002-of-00004\.safetensors")


@pytest.mark.parametrize("damage, match", [
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], "header length 1000000000000 does not fit"),
    (lambda b: b[:8] + b"{not json" + b[17:], "not valid JSON"),
    (lambda b: b[:4096], "data_offsets|does not fit"),
])
def test_corrupt_safetensors_header_is_named(copy, tmp_path: Path, damage, match) -> None:
    d = copy()
    f = d / "model-00003-of-00004.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    refused(d, tmp_path / "o.ftw", rf"model-00003-of-00004\.safetensors: .*({match})")


@pytest.mark.parametrize("arch, model_type, match", [
    ("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek_v3 is not supported yet; supported: .*GptOssForCausalLM"),
    ("LlamaForCausalLM", "llama",
     r"\['LlamaForCausalLM'\].* is not supported; supported: DeepseekV4ForCausalLM, Glm4MoeForCausalLM, "
     r"GlmMoeDsaForCausalLM, GptOssForCausalLM, MixtralForCausalLM"),
])
def test_unsupported_architecture(copy, tmp_path: Path, arch: str, model_type: str, match: str) -> None:
    d = edit_config(copy(), lambda c: c.update(architectures=[arch], model_type=model_type))
    refused(d, tmp_path / "o.ftw", f"config.json: .*{match}")


@pytest.mark.parametrize("qc", [
    {"quant_method": "gptq", "bits": 4}, {"quant_method": "awq"}, {"quant_method": "compressed-tensors"},
    {"quant_method": "fbgemm_fp8"},
    {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"},
])
def test_unsupported_quant_method(copy, tmp_path: Path, qc: dict) -> None:
    d = edit_config(copy(), lambda c: c.update(quantization_config=qc))
    refused(d, tmp_path / "o.ftw", r"config\.json quantization_config: .* is not supported; supported: .*modelopt.*"
                                   r"NVFP4, W4A16_NVFP4, FP8")


def test_mxfp4_declared_outside_gpt_oss_is_refused(copy, tmp_path: Path) -> None:
    d = edit_config(copy(), lambda c: c.update(quantization_config={"quant_method": "mxfp4"}))
    refused(d, tmp_path / "o.ftw", r"quant_method 'mxfp4' is supported for gpt_oss checkpoints only, not model_type "
                                   r"'qwen3_moe'")


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported; supported: default"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; supported: silu"),
    ({"num_key_value_heads": 4}, r"k_proj\.weight: logical shape \[32, 64\] does not match the config's \[64, 64\]"),
    ({"num_hidden_layers": 3}, r"tensor 'model\.layers\.2\..*' not found"),
])
def test_config_variants_refused(copy, tmp_path: Path, change: dict, match: str) -> None:
    refused(edit_config(copy(), lambda c: c.update(change)), tmp_path / "o.ftw", match)


def test_unaccounted_tensor_is_refused(copy, tmp_path: Path) -> None:
    d = copy()
    f = d / "model-00004-of-00004.safetensors"
    t = load_file(f)
    t["model.layers.0.self_attn.o_proj.bias"] = t[next(iter(t))].flatten()[:64].clone()
    save_file(t, f)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.o_proj.bias"] = f.name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(d, tmp_path / "o.ftw",
            r"tensors the config does not account for: model\.layers\.0\.self_attn\.o_proj\.bias")


@pytest.mark.parametrize("name, match", [("config.json", r"config\.json: missing"),
                                         ("tokenizer.json", "tokenizer.json is missing")])
def test_missing_metadata_file(copy, tmp_path: Path, name: str, match: str) -> None:
    d = copy()
    (d / name).unlink()
    refused(d, tmp_path / "o.ftw", match)


def test_bad_paths_and_options(copy, tmp_path: Path) -> None:
    d = copy()
    refused(tmp_path / "nope", tmp_path / "o.ftw", "no such directory, and not a Hugging Face repo id")
    refused(d, tmp_path / "o.ftw", r"--dtype 'int8' is not supported; supported: auto, bf16, fp16, fp32", dtype="int8")
    with pytest.raises(CheckpointError, match="would replace the input checkpoint"):
        compile_checkpoint(d, d, force=True, progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    with pytest.raises(CheckpointError, match="exists and is not empty; pass --force"):
        compile_checkpoint(d, tmp_path / "busy", progress=False)
    assert (tmp_path / "busy" / "x").read_text() == "keep me"


def test_full_disk_gives_clear_error_and_removes_temp(copy, tmp_path: Path, monkeypatch) -> None:
    from ft.formats.writer import FtwWriter

    calls = {"n": 0}
    real = FtwWriter.add_tensor

    def add_tensor(self, name, t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, t)

    monkeypatch.setattr(FtwWriter, "add_tensor", add_tensor)
    refused(copy(), tmp_path / "o.ftw", "no space left on device while writing .*o.ftw")


def test_not_enough_free_space_is_refused_up_front(copy, tmp_path: Path, monkeypatch) -> None:
    import ft.compiler.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)
    refused(copy(), tmp_path / "o.ftw", r"not enough free space for .*o\.ftw: up to [0-9.]+ MB needed, 0\.0 MB free")


def test_quantization_contradicting_its_config_is_refused(tmp_path: Path) -> None:
    src = synth("qwen3_5_moe", "tiny", tmp_path / "q35", dtype="bf16", quant="nvfp4")
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == "MIXED_PRECISION" and "lm_head" in qc["quantized_layers"]
    d = edit_config(src, lambda c: c["quantization_config"]["quantized_layers"].pop("lm_head"))
    refused(d, tmp_path / "o.ftw", r"lm_head: stored as nvfp4, but the checkpoint's quantization config allows "
                                   r"\['plain'\] for it")


def test_sliding_window_layer_types_refused(copy, tmp_path: Path) -> None:
    d = edit_config(copy(), lambda c: c.update(layer_types=["sliding_attention", "full_attention"]))
    refused(d, tmp_path / "o.ftw", "layer_types=.* is not supported .*implemented layer types: full_attention, "
                                   "linear_attention\\)")
