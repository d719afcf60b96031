"""Full-size presets: name/shape tables (no data) against the real parameter counts, and the streaming pool writer
checked on small shapes against what save_pretrained writes, transformers and the exact twin."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ft.compiler.synth import PRESETS, synth, tensor_table
from ft.compiler.synth import full_size, pools
from ft.compiler.synth.build import build_checkpoint
from ft.compiler.synth.hf_config import DTYPES


def count(table, prefix: str = "") -> int:
    return sum(t.numel for t in table if t.name.startswith(prefix))


def test_param_counts_match_real_releases():
    # Qwen3.6-35B-A3B "35B": 34.66B language model + 0.45B vision tower; the MTP head (0.85B) is extra
    t = tensor_table("qwen3_5_moe", "qwen3.6-35b-a3b")
    mtp, visual = count(t, "mtp."), count(t, "model.visual.")
    assert 34.60e9 < count(t) - mtp - visual < 34.72e9 and 0.44e9 < visual < 0.45e9 and 0.8e9 < mtp < 0.9e9
    assert 35.0e9 < count(t) - mtp < 35.2e9
    assert 30.4e9 < count(tensor_table("qwen3_moe", "qwen3-30b-a3b")) < 30.6e9  # Qwen3-30B-A3B: 30.5B
    assert 46.6e9 < count(tensor_table("mixtral", "mixtral-8x7b")) < 46.8e9  # Mixtral-8x7B: 46.7B
    assert 14.2e9 < count(tensor_table("qwen2_moe", "qwen1.5-moe-a2.7b")) < 14.4e9  # Qwen1.5-MoE-A2.7B: 14.3B
    # Qwen3-Next-80B-A3B (48 layers = 12 x [3 GDN + 1 full]), extrapolated from one 4-layer block: 80B
    n4 = tensor_table("qwen3_next", "qwen3-next-80b-a3b", num_layers=4)
    outside = count(n4) - count(n4, "model.layers.") - count(n4, "mtp.")
    assert 79.5e9 < outside + 12 * count(n4, "model.layers.") < 80.0e9


def test_full_size_nvfp4_table_has_release_shapes():
    t = {s.name: (s.dtype, s.shape) for s in tensor_table("qwen3_5_moe", "qwen3.6-35b-a3b", quant="nvfp4",
                                                           num_layers=4)}
    p = "model.language_model.layers.0."
    assert t[p + "mlp.experts.121.gate_proj.weight"] == (torch.uint8, (512, 1024))
    assert t[p + "mlp.experts.121.gate_proj.weight_scale"] == (torch.float8_e4m3fn, (512, 128))
    assert t[p + "mlp.experts.121.down_proj.weight"] == (torch.uint8, (2048, 256))
    assert t[p + "mlp.experts.121.down_proj.weight_scale"] == (torch.float8_e4m3fn, (2048, 32))
    assert t[p + "mlp.experts.0.up_proj.weight_scale_2"] == (torch.float32, ())
    assert t[p + "mlp.experts.0.up_proj.input_scale"] == (torch.float32, ())
    assert t["lm_head.weight"] == (torch.uint8, (248320, 1024)) and t["lm_head.weight_scale"][1] == (248320, 128)
    assert t[p + "linear_attn.in_proj_qkv.weight"] == (torch.float8_e4m3fn, (8192, 2048))
    assert t[p + "linear_attn.in_proj_qkv.weight_scale"] == (torch.float32, ())
    assert t[p + "linear_attn.in_proj_a.weight"] == (torch.bfloat16, (32, 2048))
    assert t["model.language_model.layers.3.self_attn.q_proj.weight"] == (torch.float8_e4m3fn, (8192, 2048))
    assert t[p + "mlp.gate.weight"] == (torch.bfloat16, (256, 2048))
    assert t["mtp.layers.0.mlp.experts.5.down_proj.weight"] == (torch.bfloat16, (2048, 512))  # MTP stays BF16
    assert not any(k.endswith("gate_up_proj") for k in t)
    bf16 = {s.name: s.shape for s in tensor_table("qwen3_5_moe", "qwen3.6-35b-a3b", num_layers=1)}
    assert bf16[p + "mlp.experts.gate_up_proj"] == (256, 1024, 2048)
    assert bf16[p + "mlp.experts.down_proj"] == (256, 2048, 512)


def headers(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: (st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in st.keys()})
    return out


def ref_nvfp4(w, s, s2):
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).long()
    return lut[codes] * (s.float() * s2).repeat_interleave(16, dim=1)


@pytest.mark.parametrize("arch,quant,layout,routing", [("qwen3_5_moe", "nvfp4", "per_expert", "uniform"),
                                                       ("qwen3_5_moe", "none", "fused", "skewed"),
                                                       ("qwen3_next", "nvfp4", "per_expert", "uniform"),
                                                       ("glm4_moe", "nvfp4", "per_expert", "uniform")])
def test_streaming_writer_matches_save_pretrained(tmp_path, monkeypatch, arch, quant, layout, routing):
    """The pool writer (every tensor pool-backed here) writes save_pretrained's exact table; transformers runs it."""
    from ft.compiler.synth.hf_small import load_reference

    monkeypatch.setattr(full_size, "SMALL", 64)  # every tensor from the pools...
    for name, length in (("NORMAL_LEN", 65_537), ("FP4_BLOCKS", 4_099), ("FP8_LEN", 65_537)):
        monkeypatch.setattr(pools, name, length)  # ...which are short, so windows wrap around
    ref = synth(arch, "tiny", tmp_path / "ref", quant=quant, expert_layout=layout, routing=routing)
    out, twin = tmp_path / "stream", tmp_path / "stream-twin"
    out.mkdir()
    if quant == "nvfp4":
        twin.mkdir()
    preset = dataclasses.replace(PRESETS["tiny"], kind="stream")
    keys = dict(PRESETS["tiny"].configs[arch])
    build_checkpoint(arch=arch, preset=preset, keys=keys, dtype=DTYPES["fp32"], quant=quant, routing=routing, seed=0,
                     fused=layout == "fused", shard=300_000, out=out, twin=twin if quant == "nvfp4" else None)
    assert headers(out) == headers(ref)
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    target = twin if quant == "nvfp4" else out
    if quant == "nvfp4":
        assert headers(twin) == headers(ref.with_name("ref-twin"))
        with safe_open(str(next(out.glob("*00001*"))), "pt") as st:  # first shard: embeddings, layer 0
            names = [k for k in st.keys() if k.endswith("experts.3.gate_proj.weight")]
            q = {k: st.get_tensor(k) for k in st.keys()}
        tw = {}
        for f in twin.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                tw.update({k: st.get_tensor(k) for k in st.keys()})
        for n in names:
            m = n[: -len(".weight")]
            assert torch.equal(tw[n].float(), ref_nvfp4(q[n], q[m + ".weight_scale"], q[m + ".weight_scale_2"]))
    model = load_reference(target, arch)
    vocab = json.loads((out / "config.json").read_text()).get("text_config", {}).get("vocab_size") or \
        json.loads((out / "config.json").read_text())["vocab_size"]
    with torch.no_grad():
        logits = model(input_ids=torch.arange(20).reshape(1, 20) % vocab).logits
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0.5


def test_full_size_preset_with_small_overrides_loads(tmp_path):
    """The public path of a full-size preset (meta table, pools, real vocab) at a CPU-friendly width."""
    from ft.compiler.synth.hf_small import load_reference

    small = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                 moe_intermediate_size=64, num_experts=16)
    d = synth("qwen3_moe", "qwen3-30b-a3b", tmp_path / "q", num_layers=2, overrides=small, max_shard_size="30MB")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 151936 and cfg["max_position_embeddings"] == 40960
    assert cfg["torch_dtype"] == "bfloat16" and cfg["num_experts"] == 16
    h = headers(d)
    assert h["model.embed_tokens.weight"] == ("BF16", (151936, 128))
    assert h["model.layers.1.mlp.experts.15.down_proj.weight"] == ("BF16", (128, 64))
    assert len(list(d.glob("model-*-of-*.safetensors"))) >= 2
    model = load_reference(d, "qwen3_moe")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[9707, 11, 1879, 0, 151645]])).logits
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_full_geometry_routing_estimate(tmp_path, routing):
    """Predicted expert load for the real Qwen3.6 geometry (256 experts, top-8) from the generated weights."""
    from ft.compiler.synth.build import _config, _meta_tables
    from ft.compiler.synth.hf_config import text_config
    from ft.compiler.synth.weights import ValueContext

    keys = dict(PRESETS["qwen3.6-35b-a3b"].configs["qwen3_5_moe"], num_hidden_layers=2)
    _, cfg = _config("qwen3_5_moe", PRESETS["qwen3.6-35b-a3b"], keys, torch.bfloat16, tmp_path)
    table = [t for t in _meta_tables("qwen3_5_moe", cfg, torch.bfloat16, False)
             if "embed_tokens" in t.name or t.name.endswith("mlp.gate.weight")]
    ctx = ValueContext("qwen3_5_moe", 2048, 2, 0, routing)
    cov = full_size.FullSizeWriter("qwen3_5_moe", ctx, "none").estimate_coverage(
        table, text_config(cfg).num_experts_per_tok, num_tokens=4096)
    assert len(cov) == 2
    for c in cov:
        if routing == "uniform":
            assert c.used_fraction == 1.0 and c.max_over_mean < 2.0 and c.entropy_ratio > 0.97
        else:
            assert c.top_decile_share > 0.35 and c.max_over_mean > 8
