"""glm_moe_dsa compilation: GLM-5's config normalized, the indexer schedule (full / shared) read as transformers reads
it, variants refused by name, the rope rows reordered from interleaved pairs, and the MTP layer skipped."""

from __future__ import annotations

import pytest
import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.families import family_for
from ft.compiler.families.glm_moe_dsa import interleaved_to_half
from ft.formats import FtwReader

from compile_lib import assert_refused, copy_checkpoint


def _glm5_config(**change) -> dict:
    """GLM-5's published geometry (transformers' GlmMoeDsaConfig defaults are GLM-5's)."""
    d = dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
             num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, head_dim=64,
             intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
             num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
             norm_topk_prob=True, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
             v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32, attention_bias=False,
             rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, max_position_embeddings=202752,
             rms_norm_eps=1e-5, num_nextn_predict_layers=1, tie_word_embeddings=False, eos_token_id=[154820, 154827],
             hidden_act="silu", scoring_func="sigmoid", topk_method="noaux_tc")
    return d | change


def test_release_config_normalizes():
    fam = family_for(_glm5_config())
    cfg = fam.normalize(_glm5_config(), None)
    assert (cfg.family, cfg.head_dim, cfg.rotary_dim, cfg.v_head_dim, cfg.rope_theta) == \
        ("glm_moe_dsa", 256, 64, 256, 1e6)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == \
        (2048, 512, 32, 128, 2048)
    assert cfg.layer_types == ("mla_attention",) * 78 and cfg.indexer_types == ("full",) * 78
    assert cfg.mlp_types == ("dense",) * 3 + ("moe",) * 75 and cfg.shared_expert_intermediate_size == 2048
    assert (cfg.router_scoring, cfg.routed_scaling_factor, cfg.shared_expert_gate) == ("sigmoid", 2.5, False)
    assert fam.skip_prefixes == ("model.layers.78.",)
    assert cfg.to_dict()["indexer_types"] == ["full"] * 78


@pytest.mark.parametrize("name", ["indexed_attention", "deepseek_sparse_attention"])
def test_both_spellings_of_the_indexed_layer_type_are_read(name):
    """GLM-5 releases and transformers 5.17 write `deepseek_sparse_attention`, 5.23+ `indexed_attention`."""
    hf = _glm5_config(layer_types=[name] * 78)
    assert family_for(hf).normalize(hf, None).layer_types == ("mla_attention",) * 78


@pytest.mark.parametrize("keys, want", [
    (dict(index_topk_freq=2), "FFSFSF"),                          # transformers' freq / offset rule
    (dict(index_topk_freq=3, index_skip_topk_offset=1), "FSSFSS"),
    (dict(index_topk_pattern="FFSSFS"), "FFSSFS"),
    (dict(indexer_types=["full", "shared"] * 3), "FSFSFS"),
])
def test_indexer_schedule_matches_transformers(keys, want):
    from transformers import GlmMoeDsaConfig

    d = _glm5_config(num_hidden_layers=6, **keys)
    cfg = family_for(d).normalize(d, None)
    assert "".join(k[0].upper() for k in cfg.indexer_types) == want
    theirs = GlmMoeDsaConfig(num_hidden_layers=6, **keys).indexer_types
    assert list(cfg.indexer_types) == theirs


@pytest.mark.parametrize("change, match", [
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(num_key_value_heads=8), "num_key_value_heads 8 != num_attention_heads 64"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim \\(even\\)"),
    (dict(index_topk_pattern="FSX" + "F" * 75), "index_topk_pattern must be a string of F / S"),
    (dict(indexer_types=["shared"] + ["full"] * 77), "indexer_types\\[0\\] must be full"),
    (dict(indexer_types=["full"] * 77), "indexer_types must list 78 entries"),
    (dict(mlp_layer_types=["dense"] * 78 + ["sparse"]), "mlp_layer_types must list 78 entries"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                           "rope_theta": 1e6}), "rope type 'yarn' is not supported"),
    (dict(layer_types=["full_attention"] * 78), "every glm_moe_dsa layer is indexed"),
    (dict(index_head_dim=32), "index_head_dim 32 must hold the rotary_dim 64"),
    (dict(q_lora_rank=None), "required key 'q_lora_rank' is missing"),
])
def test_unsupported_variants_are_refused(change, match):
    d = _glm5_config(**change)
    with pytest.raises(CheckpointError, match=match):
        family_for(d).normalize(d, None)


def test_interleaved_rope_rows_become_half_split():
    assert interleaved_to_half(6, 4, first=False).tolist() == [0, 1, 2, 4, 3, 5]
    assert interleaved_to_half(6, 4, first=True).tolist() == [0, 2, 1, 3, 4, 5]


def test_tiny_layout(ftw_for, hf_for):
    from safetensors import safe_open

    r = FtwReader(ftw_for("glm_moe_dsa"))
    cfg = r.config
    assert cfg.indexer_types == ("full", "full", "shared", "full") and cfg.mlp_types == ("dense",) + ("moe",) * 3
    names = set(r.tensor_names())
    assert "layers.1.self_attn.indexer.wq_b.weight" in names
    assert not any(n.startswith("layers.2.self_attn.indexer.") for n in names)   # shared: no indexer
    assert not any(n.startswith("layers.4.") for n in names) and "model.layers.4." in r.metadata["skipped"]
    for n in ("layers.1.self_attn.indexer.k_norm.bias", "layers.1.self_attn.indexer.weights_proj.weight",
              "layers.1.self_attn.q_a_layernorm.weight"):
        assert r.tensor(n).dtype == torch.float32
    # qkv_a_proj = [q_a_proj | kv_a_proj_with_mqa] with the last (rope) rows reordered to [even | odd]
    src = next(p for p in hf_for("glm_moe_dsa").glob("*.safetensors")
               if "model.layers.1.self_attn.q_a_proj.weight" in safe_open(str(p), "pt").keys())
    with safe_open(str(src), "pt") as f:
        qa, kva = f.get_tensor("model.layers.1.self_attn.q_a_proj.weight"), \
            f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    fused = r.tensor("layers.1.self_attn.qkv_a_proj.weight")
    c = cfg.kv_lora_rank
    assert torch.equal(fused[:qa.shape[0] + c], torch.cat([qa, kva[:c]]))
    assert torch.equal(fused[qa.shape[0] + c:], torch.cat([kva[c::2], kva[c + 1::2]]))


def test_checkpoint_refusals_leave_nothing(hf_for, tmp_path):
    src = copy_checkpoint(hf_for("glm_moe_dsa"), tmp_path / "src",
                          lambda c: c.update(indexer_types=["shared", "full", "full", "full"]))
    assert_refused(src, tmp_path / "out.ftw", "indexer_types\\[0\\] must be full")
