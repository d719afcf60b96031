"""`ft checkpoint` variants: both Qwen3.5 expert layouts, dense layers, routing flags, tied embeddings, shards,
determinism."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft.compiler import compile_checkpoint
from ft.compiler.synth import synth
from ft.formats.reader import STAMP_NAME
from ft.formats import FtwReader


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("variants")


def data_and_records(ftw: Path) -> tuple[dict[str, bytes], list, list]:
    """Everything but provenance/metadata: data files' bytes, tensor records, bank records."""
    r = FtwReader(ftw)
    files = {f.name: (ftw / f.name).read_bytes() for f in r.records.files}
    m = r.manifest
    return files, m["tensors"], m["expert_banks"]


def test_qwen3_5_fused_and_per_expert_layouts_compile_identically(work: Path) -> None:
    fused = synth("qwen3_5_moe", "tiny", work / "fused", dtype="fp32", expert_layout="fused")
    per = synth("qwen3_5_moe", "tiny", work / "per", dtype="fp32", expert_layout="per_expert")
    assert (fused / "model.safetensors.index.json").read_text() != (per / "model.safetensors.index.json").read_text()
    a = compile_checkpoint(fused, work / "fused.ftw", progress=False)
    b = compile_checkpoint(per, work / "per.ftw", progress=False)
    assert data_and_records(a) == data_and_records(b)
    ra, rb = FtwReader(a), FtwReader(b)
    assert ra.config == rb.config and ra.quant == rb.quant
    assert ra.provenance["files"] != rb.provenance["files"]  # provenance tells the sources apart


def test_dense_layers_from_mlp_only_layers_and_sparse_step(work: Path) -> None:
    src = synth("qwen3_moe", "tiny", work / "dense", dtype="fp32",
                overrides={"num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2})
    r = FtwReader(compile_checkpoint(src, work / "dense.ftw", progress=False))
    # layer i is MoE iff i not in mlp_only_layers and (i + 1) % 2 == 0
    assert r.config.mlp_types == ("dense", "moe", "dense", "moe")
    assert r.bank_names() == ["layers.1.mlp.experts", "layers.3.mlp.experts"]
    H, Id = r.config.hidden_size, r.config.intermediate_size
    assert r.tensor("layers.0.mlp.gate_up_proj.weight").shape == (2 * Id, H)
    assert r.tensor("layers.2.mlp.down_proj.weight").shape == (H, Id)
    assert not r.has_tensor("layers.0.mlp.gate.weight")


def test_qwen3_next_dense_layer(work: Path) -> None:
    src = synth("qwen3_next", "tiny", work / "next-dense", dtype="fp32", overrides={"mlp_only_layers": [1]})
    r = FtwReader(compile_checkpoint(src, work / "next-dense.ftw", progress=False))
    assert r.config.mlp_types == ("moe", "dense", "moe", "moe")
    assert r.has_tensor("layers.1.mlp.gate_up_proj.weight") and not r.has_bank("layers.1.mlp.experts")


def test_norm_topk_prob_false_is_carried(work: Path) -> None:
    src = synth("qwen3_moe", "tiny", work / "topk", dtype="fp32", overrides={"norm_topk_prob": False})
    assert FtwReader(compile_checkpoint(src, work / "topk.ftw", progress=False)).config.norm_topk_prob is False


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a checkpoint with its tensors passed through `edit(dict) -> dict`, as one model.safetensors."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file(edit(tensors), dst / "model.safetensors")
    return dst


def test_tied_embeddings_follow_transformers(work: Path) -> None:
    src = synth("qwen2_moe", "tiny", work / "tied", dtype="fp32", overrides={"tie_word_embeddings": True})
    embed = "model.embed_tokens.weight"
    cases = {
        "absent": lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"},
        "equal": lambda t: {**t, "lm_head.weight": t[embed].clone()},
        "different": lambda t: {**t, "lm_head.weight": t[embed] + 1},  # transformers does not tie these
    }
    for case, edit in cases.items():
        r = FtwReader(compile_checkpoint(rewrite(src, work / f"tied-{case}", edit), work / f"tied-{case}.ftw",
                                         progress=False))
        assert r.config.tie_word_embeddings is (case != "different"), case
        assert r.has_tensor("lm_head.weight") is (case == "different"), case
        assert r.metadata["skipped"] == ({"lm_head.": 1} if case == "equal" else {}), case


def test_many_shards_compile_like_one(work: Path) -> None:
    few = synth("mixtral", "tiny", work / "few", dtype="fp32", max_shard_size="100MB")
    many = synth("mixtral", "tiny", work / "many", dtype="fp32", max_shard_size="20KB")
    assert len(list(many.glob("*.safetensors"))) > 10 and len(list(few.glob("*.safetensors"))) == 1
    a = compile_checkpoint(few, work / "few.ftw", progress=False)
    b = compile_checkpoint(many, work / "many.ftw", progress=False)
    assert data_and_records(a) == data_and_records(b)


@pytest.fixture(scope="module")
def next_nvfp4(work: Path) -> Path:
    return synth("qwen3_next", "tiny", work / "det", dtype="bf16", quant="nvfp4")


def test_compiling_twice_is_byte_identical(work: Path, next_nvfp4: Path) -> None:
    src = next_nvfp4
    a = compile_checkpoint(src, work / "det-a.ftw", progress=False)
    b = compile_checkpoint(src, work / "det-b.ftw", progress=False)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in set(names) - {STAMP_NAME}:  # the stamp is this machine's note on these files (inodes), not the FTW
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_force_replaces_and_fp16_output(work: Path) -> None:
    src = synth("qwen3_moe", "tiny", work / "f16", dtype="fp32")
    out = compile_checkpoint(src, work / "f16.ftw", progress=False)
    out = compile_checkpoint(src, out, dtype="fp16", force=True, progress=False)
    r = FtwReader(out)
    assert r.quant["experts"] == "fp16" and r.tensor("embed_tokens.weight").dtype == torch.float16
    assert r.tensor("norm.weight").dtype == torch.float32


def test_legacy_hf_quant_config_alone(work: Path, next_nvfp4: Path) -> None:
    """ModelOpt's hf_quant_config.json without config.json's quantization_config is enough."""
    d = Path(shutil.copytree(next_nvfp4, work / "legacy"))
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    r = FtwReader(compile_checkpoint(d, work / "legacy.ftw", progress=False))
    assert r.quant["source"] == json.loads((d / "hf_quant_config.json").read_text())
    assert r.quant["experts"] == "nvfp4" and "layers.3.self_attn.qkv_proj" in r.quant["linears"]
