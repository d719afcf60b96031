"""deepseek_v4 compilation: the config normalized as transformers reads it (layer kinds, hash layers, the two ropes),
variants refused by name, DeepSeek's tensor names mapped, the hash table kept as int32, the MTP head skipped."""

from __future__ import annotations

import pytest
import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.families import family_for
from ft.formats import FtwReader

from compile_lib import assert_refused, copy_checkpoint

transformers = pytest.importorskip("transformers")


def _v4_config(**change) -> dict:
    """transformers' DeepseekV4Config defaults (its docstring names DeepSeek-V4-Flash-Base) as a config.json."""
    d = transformers.DeepseekV4Config().to_dict()
    d.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4")
    return d | change


def test_default_config_normalizes_as_transformers_reads_it():
    d = _v4_config()
    cfg = family_for(d).normalize(d, None)
    theirs = transformers.DeepseekV4Config()
    kinds = {"sliding_attention": "none", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert cfg.compress_kinds == tuple(kinds[t] for t in theirs.layer_types)
    assert cfg.hash_moe_layers == tuple(i for i, t in enumerate(theirs.mlp_layer_types) if t == "hash_moe")
    assert (cfg.head_dim, cfg.rotary_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.compress_rope_theta) == \
        (512, theirs.qk_rope_head_dim, 1, 10_000.0, 160_000.0)
    assert (cfg.csa_compress_rate, cfg.hca_compress_rate, cfg.sliding_window, cfg.o_groups, cfg.o_lora_rank) == \
        (4, 128, 128, 8, 1024)
    assert (cfg.router_scoring, cfg.routed_scaling_factor, cfg.expert_act, cfg.swiglu_limit) == \
        ("sqrtsoftplus", 1.5, "clamped_silu", 10.0)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.shared_expert_intermediate_size) == (4, 20, 2048)
    assert cfg.to_dict()["compress_kinds"][:3] == ["hca", "hca", "hca"]


def test_legacy_keys_and_yarn_on_the_compressed_rope():
    d = _v4_config(num_hidden_layers=4, layer_types=None, mlp_layer_types=None, compress_ratios=[0, 4, 128, 4],
                   num_hash_layers=1, rope_parameters=None,
                   rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536})
    cfg = family_for(d).normalize(d, None)
    assert cfg.compress_kinds == ("none", "csa", "hca", "csa") and cfg.hash_moe_layers == (0,)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_attention_factor, cfg.compress_rope_theta) == \
        ("yarn", 16.0, 1.0, 160_000.0)


@pytest.mark.parametrize("change, match", [
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid' is not supported"),
    (dict(num_key_value_heads=8), "num_key_value_heads 8 is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(n_shared_experts=2), "n_shared_experts=2 is not supported"),
    (dict(layer_types=["full_attention"] * 43), "layer_types must list 43 entries"),
    (dict(mlp_layer_types=["dense"] * 43), "mlp_layer_types must list 43 entries"),
    (dict(compress_rates={"compressed_sparse_attention": 0}), "compress rate of compressed_sparse_attention"),
    (dict(compress_rates={"sliding_attention": 4}), "compress_rates must map"),
    (dict(index_head_dim=32), "index_head_dim >= rotary_dim"),
    (dict(o_groups=7), "split into o_groups 7"),
    (dict(rope_parameters={"main": {"rope_type": "linear", "factor": 2.0}, "compress": {}}),
     "sliding layers' rope must be plain"),
    (dict(q_lora_rank=None), "required key 'q_lora_rank' is missing"),
])
def test_unsupported_variants_are_refused(change, match):
    d = _v4_config(**change)
    with pytest.raises(CheckpointError, match=match):
        family_for(d).normalize(d, None)


def test_tiny_layout(ftw_for, hf_for):
    from safetensors import safe_open

    r = FtwReader(ftw_for("deepseek_v4"))
    cfg = r.config
    assert cfg.compress_kinds == ("none", "csa", "hca", "csa") and cfg.hash_moe_layers == (0,)
    names = set(r.tensor_names())
    assert "layers.1.self_attn.compressor.indexer.weights_proj.weight" in names
    assert not any(n.startswith(("layers.0.self_attn.compressor", "layers.2.self_attn.compressor.indexer"))
                   for n in names)
    assert "layers.0.mlp.tid2eid" in names and "layers.0.mlp.e_score_correction_bias" not in names
    for n in ("layers.1.attn_hc.fn", "layers.1.self_attn.sinks", "layers.2.self_attn.compressor.position_bias",
              "hc_head.hc_scale", "layers.1.mlp.e_score_correction_bias"):
        assert r.tensor(n).dtype == torch.float32
    table = r.tensor("layers.0.mlp.tid2eid")
    src = next(p for p in hf_for("deepseek_v4").glob("*.safetensors")
               if "model.layers.0.ffn.gate.tid2eid" in safe_open(str(p), "pt").keys())
    with safe_open(str(src), "pt") as f:
        want = f.get_tensor("model.layers.0.ffn.gate.tid2eid")
        w1, w3 = f.get_tensor("model.layers.0.ffn.shared_experts.w1.weight"), \
            f.get_tensor("model.layers.0.ffn.shared_experts.w3.weight")
    assert table.dtype == torch.int32 and torch.equal(table.long(), want)
    assert torch.equal(r.tensor("layers.0.mlp.shared_expert.gate_up_proj.weight"), torch.cat([w1, w3]))


def test_checkpoint_refusals_leave_nothing(hf_for, tmp_path):
    src = copy_checkpoint(hf_for("deepseek_v4"), tmp_path / "src", lambda c: c.update(scoring_func="softmax"))
    assert_refused(src, tmp_path / "out.ftw", "scoring_func='softmax' is not supported")


def test_release_names_compile_to_the_same_ftw(ftw_for, hf_for, tmp_path):
    """The release's names (`embed.weight`, `layers.*`, `hc_head_fn`, … without `model.`) and an MTP head give the
    same FTW as transformers' save_pretrained names."""
    from safetensors.torch import load_file, save_file

    from ft.compiler import compile_checkpoint

    src = copy_checkpoint(hf_for("deepseek_v4"), tmp_path / "src")
    renames = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        out = {renames.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}
        if "head.weight" in out:
            out["mtp.0.head.weight"] = out["head.weight"].clone()
        save_file(out, str(f), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        import json
        d = json.loads(index.read_text())
        d["weight_map"] = {renames.get(k, k.removeprefix("model.")): v for k, v in d["weight_map"].items()}
        d["weight_map"]["mtp.0.head.weight"] = d["weight_map"]["head.weight"]
        index.write_text(json.dumps(d))
    ours, theirs = FtwReader(compile_checkpoint(src, tmp_path / "out.ftw", progress=False)), \
        FtwReader(ftw_for("deepseek_v4"))
    assert sorted(ours.tensor_names()) == sorted(theirs.tensor_names())
    assert all(torch.equal(ours.tensor(n), theirs.tensor(n)) for n in theirs.tensor_names())
    assert "mtp." in ours.metadata["skipped"]
