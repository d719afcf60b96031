"""ModelConfig: the normalized config refuses unknown keys, unknown families and inconsistent geometry."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from ftw_testlib import moe_config, tiny_config

from ft.formats import FAMILIES, ModelConfig


def hybrid(**over: Any) -> ModelConfig:
    """A 4-layer qwen3_next-style config: 3 Gated DeltaNet layers, then full attention; MoE + shared expert."""
    kw: dict[str, Any] = dict(
        family="qwen3_next", num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        mlp_types=("moe",) * 4, attn_output_gate=True, rotary_dim=2, head_dim=8, shared_expert_intermediate_size=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4)
    kw.update(over)
    return moe_config(**kw)


def test_round_trips_through_json_for_every_family() -> None:
    for family in FAMILIES:
        cfg = hybrid(family=family) if family in ("qwen3_next", "qwen3_5_moe") else moe_config(family=family)
        d = json.loads(json.dumps(cfg.to_dict()))
        assert ModelConfig.from_dict(d) == cfg
        # keys added after FTW 1.0 are written only when they differ from their defaults
        assert list(d) == [f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING]
    assert hybrid().num_moe_layers == 4 and hybrid().has_shared_expert and not moe_config().has_shared_expert


def test_gpt_oss_keys_round_trip_and_default_when_absent() -> None:
    cfg = moe_config(family="gpt_oss", layer_types=("sliding_attention",), sliding_window=128, attn_sinks=True,
                     attn_o_bias=True, router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                     swiglu_alpha=1.702, swiglu_limit=7.0, rope_type="yarn", rope_factor=32.0,
                     rope_attention_factor=1.3465735902799727, rope_original_max_position_embeddings=4096,
                     rope_truncate=False)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert ModelConfig.from_dict(d) == cfg
    assert {"sliding_window", "attn_sinks", "rope_truncate", "swiglu_limit"} <= set(d)
    assert "rope_beta_fast" not in d  # equal to its default
    old = moe_config().to_dict()  # a manifest written before the keys existed
    assert ModelConfig.from_dict(old).expert_act == "silu" and ModelConfig.from_dict(old).sliding_window == 0
    with pytest.raises(ValueError, match="config key attn_sinks has the wrong type"):
        ModelConfig.from_dict({**old, "attn_sinks": 1})


def test_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_config().hidden_size = 4  # type: ignore[misc]


def test_refuses_unknown_and_missing_keys() -> None:
    d = tiny_config().to_dict()
    with pytest.raises(ValueError, match=r"unknown config keys \['use_sliding_window'\]"):
        ModelConfig.from_dict({**d, "use_sliding_window": True})
    del d["head_dim"]
    with pytest.raises(ValueError, match=r"missing config keys \['head_dim'\]"):
        ModelConfig.from_dict(d)
    with pytest.raises(ValueError, match="must be a JSON object"):
        ModelConfig.from_dict([])  # type: ignore[arg-type]


def test_refuses_unknown_family() -> None:
    with pytest.raises(ValueError, match="unknown family 'llama'; supported: qwen3_moe, qwen2_moe, mixtral"):
        tiny_config(family="llama")
    with pytest.raises(ValueError, match="unknown family 'deepseek_v3'"):
        ModelConfig.from_dict({**tiny_config().to_dict(), "family": "deepseek_v3"})


@pytest.mark.parametrize("key,value", [("hidden_size", True), ("hidden_size", 2.0), ("hidden_size", "2"),
                                       ("rms_norm_eps", "1e-6"), ("attn_qk_norm", 1), ("bos_token_id", 1.0),
                                       ("eos_token_ids", [1, "2"]), ("layer_types", "full_attention"),
                                       ("family", None)])
def test_refuses_wrong_types(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"config key {key}"):
        ModelConfig.from_dict({**tiny_config().to_dict(), key: value})


@pytest.mark.parametrize("over,message", [
    (dict(hidden_size=0), "hidden_size must be positive"),
    (dict(num_layers=2), "layer_types must list 2 entries"),
    (dict(layer_types=("sliding_attention", "full_attention")), "layer_types must list 1 entries"),
    (dict(layer_types=("sliding_attention",)), "sliding_attention layers need sliding_window > 0"),
    (dict(expert_act="gelu"), "expert_act 'gelu' not in"),
    (dict(expert_act="clamped_swiglu"), "clamped_swiglu needs swiglu_alpha > 0 and swiglu_limit > 0"),
    (dict(rope_type="yarn"), "yarn rope needs rope_factor >= 1, rope_original_max_position_embeddings > 0"),
    (dict(rope_type="longrope"), "rope_type 'longrope' not in"),
    (dict(mlp_types=("moe", "moe")), "mlp_types must list 1 entries"),
    (dict(num_heads=4, num_kv_heads=3), "num_heads 4 is not a multiple of num_kv_heads 3"),
    (dict(rotary_dim=3), "rotary_dim 3 must be even"),
    (dict(rotary_dim=4), "within head_dim 2"),
    (dict(mlp_types=("moe",), num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8),
     "num_experts_per_tok 5 must be in 1..num_experts 4"),
    (dict(mlp_types=("moe",), num_experts=4, num_experts_per_tok=2), "moe layers need moe_intermediate_size > 0"),
    (dict(intermediate_size=0), "dense layers need intermediate_size > 0"),
    (dict(max_position_embeddings=-1), "max_position_embeddings must be non-negative"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be a positive finite number"),
    (dict(rope_theta=float("inf")), "rope_theta must be a positive finite number"),
    (dict(eos_token_ids=(-1,)), "token ids must be non-negative"),
])
def test_refuses_inconsistent_geometry(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**over)
    d = tiny_config().to_dict()
    d.update({k: list(v) if isinstance(v, tuple) else v for k, v in over.items()})
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("over", [dict(linear_conv_kernel_dim=0), dict(linear_num_key_heads=3)])
def test_refuses_inconsistent_linear_attention_geometry(over: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="linear_"):
        hybrid(**over)


def test_reports_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as info:
        tiny_config(family="llama", hidden_size=0, rotary_dim=3)
    assert all(w in str(info.value) for w in ("unknown family", "hidden_size must be positive", "rotary_dim 3"))


def _mla(**over: Any) -> ModelConfig:
    """One mla_attention layer with its DSA indexer (glm_moe_dsa's keys)."""
    kw: dict[str, Any] = dict(family="glm_moe_dsa", layer_types=("mla_attention",), num_kv_heads=4, head_dim=12,
                              rotary_dim=4, q_lora_rank=16, kv_lora_rank=8, v_head_dim=8, index_n_heads=2,
                              index_head_dim=8, index_topk=4, indexer_types=("full",), attn_qk_norm=False)
    kw.update(over)
    return moe_config(**kw)


def test_mla_keys_round_trip_and_default_when_absent() -> None:
    cfg = _mla()
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["indexer_types"] == ["full"] and d["kv_lora_rank"] == 8
    assert ModelConfig.from_dict(d) == cfg
    assert "indexer_types" not in moe_config().to_dict()
    assert ModelConfig.from_dict(moe_config().to_dict()).indexer_types == ()


@pytest.mark.parametrize("over, message", [
    (dict(layer_types=("full_attention",), rotary_dim=4), "belong to mla_attention layers"),
    (dict(kv_lora_rank=0), "need positive q_lora_rank, kv_lora_rank and v_head_dim"),
    (dict(num_kv_heads=2), "num_kv_heads == num_heads"),
    (dict(rotary_dim=12), "0 < rotary_dim"),
    (dict(index_topk=0), "positive index_n_heads, index_head_dim and index_topk"),
    (dict(index_head_dim=2), "must hold the rotary_dim 4"),
    (dict(indexer_types=("full", "shared")), "indexer_types must list 1 entries"),
    (dict(indexer_types=("shared",)), "indexer_types\\[0\\] must be full"),
    (dict(indexer_types=("sparse",)), "indexer_types must list 1 entries from"),
])
def test_refuses_inconsistent_mla_geometry(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _mla(**over)


def _v4(**over: Any) -> ModelConfig:
    """Two compressed_attention layers (a CSA, an HCA), the first MoE layer hash-routed (deepseek_v4's keys)."""
    kw: dict[str, Any] = dict(family="deepseek_v4", layer_types=("compressed_attention",) * 2, mlp_types=("moe",) * 2,
                              num_layers=2, num_kv_heads=1, head_dim=16, rotary_dim=4, attn_qk_norm=False,
                              compress_kinds=("csa", "hca"), csa_compress_rate=4, hca_compress_rate=8,
                              compress_rope_theta=160_000.0, sliding_window=8, q_lora_rank=16, o_groups=2,
                              o_lora_rank=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, index_n_heads=2,
                              index_head_dim=8, index_topk=4, hash_moe_layers=(0,), router_scoring="sqrtsoftplus",
                              expert_act="clamped_silu", swiglu_limit=10.0)
    kw.update(over)
    return moe_config(**kw)


def test_compressed_attention_keys_round_trip_and_default_when_absent() -> None:
    cfg = _v4()
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["compress_kinds"] == ["csa", "hca"] and d["hash_moe_layers"] == [0] and d["hc_mult"] == 4
    assert ModelConfig.from_dict(d) == cfg
    assert "compress_kinds" not in moe_config().to_dict()


@pytest.mark.parametrize("over, message", [
    (dict(layer_types=("full_attention",) * 2), "belong to compressed_attention layers"),
    (dict(layer_types=("compressed_attention", "full_attention")), "do not mix"),
    (dict(compress_kinds=("csa",)), "compress_kinds must list 2 entries"),
    (dict(hca_compress_rate=0), "hca layers need hca_compress_rate > 0"),
    (dict(o_groups=0), "need o_groups > 0"),
    (dict(o_groups=3), "split into o_groups 3"),
    (dict(num_kv_heads=2), "one key/value head"),
    (dict(hc_eps=0.0), "hc_eps > 0"),
    (dict(index_topk=0), "csa layers need positive index_n_heads"),
    (dict(compress_kinds=("none", "hca")), "index_\\* keys belong to csa layers"),
    (dict(hash_moe_layers=(2,)), "hash_moe_layers must name moe layers"),
    (dict(expert_act="clamped_silu", swiglu_limit=0.0), "clamped_silu needs swiglu_limit > 0"),
])
def test_refuses_inconsistent_compressed_geometry(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _v4(**over)
