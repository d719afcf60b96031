"""glm4_moe compilation: the normalized config, variants refused by name, the MTP layer skipped only when the config
declares it, and the full-size presets' tensor tables."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ft.compiler import compile_checkpoint
from ft.compiler.errors import CheckpointError
from ft.compiler.families import family_for
from ft.compiler.synth import tensor_table
from ft.formats import FtwReader

from compile_lib import assert_refused, copy_checkpoint


def _air_config(**change) -> dict:
    d = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=4096,
             num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
             intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
             num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
             norm_topk_prob=True, use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5, rope_theta=1e6,
             rope_scaling=None, max_position_embeddings=131072, rms_norm_eps=1e-5, num_nextn_predict_layers=1,
             tie_word_embeddings=False, eos_token_id=[151329, 151336, 151338], hidden_act="silu")
    return d | change


def test_release_config_normalizes():
    fam = family_for(_air_config())
    cfg = fam.normalize(_air_config(), None)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (128, 64, 1e6)
    assert cfg.mlp_types == ("dense",) + ("moe",) * 45 and cfg.shared_expert_intermediate_size == 1408
    assert (cfg.router_scoring, cfg.router_n_group, cfg.router_topk_group, cfg.routed_scaling_factor) == \
        ("sigmoid", 1, 1, 1.0)
    assert cfg.attn_qkv_bias and not cfg.attn_qk_norm and not cfg.attn_o_bias and not cfg.shared_expert_gate
    assert cfg.eos_token_ids == (151329, 151336, 151338)
    assert fam.skip_prefixes == ("model.layers.46.",)
    # no head_dim: transformers' fallback hidden // heads = 42, whose default half (21 dims) cannot be rotated
    bare = {k: v for k, v in _air_config().items() if k not in ("head_dim", "partial_rotary_factor")}
    with pytest.raises(CheckpointError, match="rotary_dim 21 must be even and within head_dim 42"):
        family_for(bare).normalize(bare, None)
    cfg = family_for(bare).normalize(bare | dict(num_attention_heads=64, num_key_value_heads=8), None)
    assert (cfg.head_dim, cfg.rotary_dim) == (64, 32)


@pytest.mark.parametrize("change, match", [
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported .*sigmoid"),
    (dict(q_lora_rank=1536), "q_lora_rank=1536 is not supported .*MLA"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    (dict(first_k_dense_replace=47), "first_k_dense_replace must be in 0..46, got 47"),
    (dict(n_group=3), "inconsistent config: .*num_experts 128 must split into router_n_group 3 groups"),
    (dict(n_group=4, topk_group=5), r"router_topk_group \(5\) <= router_n_group \(4\)"),
    (dict(use_qk_norm="yes"), "'use_qk_norm' must be true or false"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
     "rope type 'yarn' is not supported"),
    (dict(routed_scaling_factor="2.5"), "routed_scaling_factor must be a number"),
])
def test_config_variants_areassert_refused(change, match):
    with pytest.raises(CheckpointError, match=match):
        family_for(_air_config()).normalize(_air_config(**change), None)


def test_mtp_layer_is_skipped_only_when_declared(hf_for, tmp_path):
    d = copy_checkpoint(hf_for("glm4_moe"), tmp_path / "ck", lambda c: c.update(num_nextn_predict_layers=0))
    assert_refused(d, tmp_path / "o.ftw", "model.layers.3.")
    ftw = FtwReader(compile_checkpoint(hf_for("glm4_moe"), tmp_path / "ok.ftw", progress=False))
    assert ftw.metadata["skipped"] == {"model.layers.3.": 44}


def test_missing_correction_bias_isassert_refused(hf_for, tmp_path):
    src = hf_for("glm4_moe")
    d = shutil.copytree(src, tmp_path / "ck")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.layers.2.mlp.gate.e_score_correction_bias")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(d, tmp_path / "o.ftw", "model.layers.2.mlp.gate.e_score_correction_bias")


def test_full_size_tables_match_the_release():
    """GLM-4.5-Air / GLM-4.5 (meta device, no data): names, shapes, dtypes and parameter counts of the releases."""
    air = {t.name: (tuple(t.shape), t.dtype) for t in tensor_table("glm4_moe", "glm-4.5-air")}
    assert air["model.layers.0.mlp.gate_proj.weight"] == ((10944, 4096), torch.bfloat16)
    assert air["model.layers.1.self_attn.q_proj.weight"] == ((12288, 4096), torch.bfloat16)
    assert air["model.layers.1.self_attn.q_proj.bias"] == ((12288,), torch.bfloat16)
    assert "model.layers.1.self_attn.o_proj.bias" not in air and "model.layers.1.self_attn.q_norm.weight" not in air
    assert air["model.layers.1.mlp.gate.weight"] == ((128, 4096), torch.bfloat16)
    assert air["model.layers.1.mlp.gate.e_score_correction_bias"] == ((128,), torch.float32)
    assert air["model.layers.45.mlp.experts.127.down_proj.weight"] == ((4096, 1408), torch.bfloat16)
    assert air["model.layers.1.mlp.shared_experts.up_proj.weight"] == ((1408, 4096), torch.bfloat16)
    assert air["model.layers.46.eh_proj.weight"] == ((4096, 8192), torch.bfloat16)  # the MTP layer
    main = sum(torch.Size(s).numel() for n, (s, _) in air.items() if not n.startswith("model.layers.46."))
    assert 106.5e9 < main < 107.2e9  # GLM-4.5-Air: 106B total parameters
    full = {t.name: tuple(t.shape) for t in tensor_table("glm4_moe", "glm-4.5", num_layers=4)}
    assert full["model.layers.3.mlp.experts.159.gate_proj.weight"] == (1536, 5120)
    assert full["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert "model.layers.2.mlp.gate_proj.weight" in full and "model.layers.3.mlp.gate.weight" in full
