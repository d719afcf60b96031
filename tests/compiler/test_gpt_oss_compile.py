"""gpt_oss compilation: variants refused by name, --dtype / --dequant on MXFP4 experts, the full-size presets' tensor
tables, and the streaming writer of full-size presets (at tiny size)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ft.compiler import compile_checkpoint
from ft.compiler.synth import PRESETS, SynthError, synth, tensor_table
from ft.formats import FtwReader

from compile_lib import assert_refused, copy_checkpoint
from ft.formats.quant import mxfp4


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(attention_bias=False), r"attention_bias=False is not supported \(gpt_oss attention has"),
    (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"] * 2),
     "layer_types=.* is not supported .*implemented layer types: full_attention, linear_attention, sliding_attention"),
    (lambda c: c.update(layer_types=["full_attention", "linear_attention"] * 2),
     "layer_types must list 4 entries of sliding_attention / full_attention"),
    (lambda c: c.update(sliding_window=None), "sliding_attention layers need a positive sliding_window"),
    (lambda c: c.update(rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     "rope type 'longrope' is not supported; supported: default, yarn"),
    (lambda c: c["rope_scaling"].pop("original_max_position_embeddings"),
     "yarn rope needs a positive integer original_max_position_embeddings"),
    (lambda c: c.update(experts_per_token=3), "num_experts_per_tok 2 and experts_per_token 3 disagree"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda c: c.pop("quantization_config"), "MXFP4 experts, but config.json declares no quantization_config"),
    (lambda c: c.update(intermediate_size=32), r"gate_up_proj_blocks: shape \[8, 128, 2, 16\] does not match the "
                                               r"config's \[8, 64, 2, 16\]"),
])
def test_variants_areassert_refused(hf_for, tmp_path, change, match):
    assert_refused(copy_checkpoint(hf_for("gpt_oss", "mxfp4"), tmp_path / "ck", change), tmp_path / "o.ftw", match)


def test_plain_expert_shapes_are_checked(hf_for, tmp_path):
    d = copy_checkpoint(hf_for("gpt_oss"), tmp_path / "ck", lambda c: c.update(intermediate_size=32))
    assert_refused(d, tmp_path / "o.ftw",
                   r"gate_up_proj: shape \[8, 64, 128\] does not match the config's \[8, 64, 64\]")


def test_dtype_keeps_mxfp4_and_dequant_stores_the_exact_values(hf_for, tmp_path):
    src = hf_for("gpt_oss", "mxfp4")
    kept = FtwReader(compile_checkpoint(src, tmp_path / "bf16.ftw", dtype="bf16", progress=False))
    assert kept.quant["experts"] == "mxfp4"
    assert kept.tensor("layers.0.self_attn.qkv_proj.weight").dtype == torch.bfloat16
    deq = FtwReader(compile_checkpoint(src, tmp_path / "deq.ftw", dequant=True, progress=False))
    assert deq.quant["experts"] == "fp32"
    b, p = kept.bank("layers.3.mlp.experts"), deq.bank("layers.3.mlp.experts")
    for e in (0, 7):
        for comp in ("gate_up", "down"):
            want = mxfp4.dequantize(b.expert(e, comp), b.expert(e, f"{comp}_scale"))
            assert torch.equal(p.expert(e, comp), want)
        assert torch.equal(p.expert(e, "down_bias"), b.expert(e, "down_bias"))


def test_full_size_tables_match_the_release():
    """The gpt-oss-20b / 120b tables (meta device, no data) have the release's names, shapes and dtypes (§1.4)."""
    t20 = {t.name: (tuple(t.shape), t.dtype) for t in tensor_table("gpt_oss", "gpt-oss-20b", quant="mxfp4")}
    assert t20["model.layers.0.mlp.experts.gate_up_proj_blocks"] == ((32, 5760, 90, 16), torch.uint8)
    assert t20["model.layers.0.mlp.experts.gate_up_proj_scales"] == ((32, 5760, 90), torch.uint8)
    assert t20["model.layers.23.mlp.experts.down_proj_blocks"] == ((32, 2880, 90, 16), torch.uint8)
    assert t20["model.layers.0.mlp.experts.gate_up_proj_bias"] == ((32, 5760), torch.bfloat16)
    assert t20["model.layers.0.self_attn.q_proj.weight"] == ((4096, 2880), torch.bfloat16)
    assert t20["model.layers.0.self_attn.sinks"] == ((64,), torch.bfloat16)
    assert t20["model.layers.0.mlp.router.weight"] == ((32, 2880), torch.bfloat16)
    assert t20["model.embed_tokens.weight"] == ((201088, 2880), torch.bfloat16)
    assert "model.layers.24.input_layernorm.weight" not in t20 and len(t20) == 24 * 19 + 3
    t120 = {t.name: tuple(t.shape) for t in tensor_table("gpt_oss", "gpt-oss-120b", quant="mxfp4")}
    assert t120["model.layers.35.mlp.experts.down_proj_scales"] == (128, 2880, 90)


def test_quant_choices_per_arch(tmp_path):
    with pytest.raises(SynthError, match="quant 'nvfp4' does not exist for gpt_oss; supported: none, mxfp4"):
        synth("gpt_oss", "tiny", tmp_path / "a", quant="nvfp4")
    with pytest.raises(SynthError, match="quant 'mxfp4' does not exist for qwen3_moe; supported: none, nvfp4"):
        synth("qwen3_moe", "tiny", tmp_path / "b", quant="mxfp4")


def test_stream_writer_at_tiny_size(tmp_path, monkeypatch):
    """The full-size path (pool windows, MXFP4 code windows, per-expert twin) at the tiny geometry: the same table as
    the in-memory writer, its twin the exact dequantization, and our runtime on both agrees."""
    from ft.compiler.synth import gpt_oss_stream, pools
    from ft.runtime.model import Segment, load_model

    monkeypatch.setattr(gpt_oss_stream, "SMALL", 64)
    monkeypatch.setattr(pools, "NORMAL_LEN", 65_537)
    monkeypatch.setattr(pools, "FP4_BLOCKS", 4_099)
    out, twin = tmp_path / "s", tmp_path / "s-twin"
    out.mkdir()
    twin.mkdir()
    from ft.compiler.synth.gpt_oss import build_gpt_oss

    keys = dict(PRESETS["tiny"].configs["gpt_oss"])
    build_gpt_oss(preset=dataclasses.replace(PRESETS["tiny"], kind="stream"), keys=keys, dtype=torch.float32,
                  quant="mxfp4", seed=0, shard=300_000, out=out, twin=twin)
    ref = synth("gpt_oss", "tiny", tmp_path / "ref", quant="mxfp4")

    def headers(d: Path) -> dict:
        out = {}
        for f in d.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                out.update({k: (st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in st.keys()})
        return out
    assert headers(out) == headers(ref) and headers(twin) == headers(ref.with_name("ref-twin"))
    a = load_model(compile_checkpoint(out, tmp_path / "a.ftw", progress=False))
    b = load_model(compile_checkpoint(twin, tmp_path / "b.ftw", progress=False))
    ids = torch.arange(30) % 500
    la, lb = (m.forward(ids, [Segment(m.new_state(32), 30, "all")])[0] for m in (a, b))
    assert (la - lb).abs().max() < 1e-4 and float(la.std()) > 0.1
