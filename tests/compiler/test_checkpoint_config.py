"""HF config -> normalized ModelConfig: every spelling real and transformers-saved configs use maps to the same
result, and unsupported variants are refused by key. Pure dictionaries, no checkpoint needed."""

from __future__ import annotations

import copy

import pytest
import torch

from ft.compiler import CheckpointError
from ft.compiler.checkpoint import dtype_policy
from ft.compiler.families import family_for
from ft.compiler.quant.modelopt import parse_quant

QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64,
         "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1e6, "rope_scaling": None,
         "eos_token_id": 7, "bos_token_id": 5, "torch_dtype": "bfloat16"}
NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1e7,
        "partial_rotary_factor": 0.25, "full_attention_interval": 4, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4}


def norm(hf: dict, gen: dict | None = None):
    return family_for(hf).normalize(hf, gen)


def variant(base: dict, **changes) -> dict:
    d = copy.deepcopy(base)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def test_spellings_of_the_same_config_agree() -> None:
    want = norm(QWEN3)
    assert norm(variant(QWEN3, num_experts=None, num_local_experts=8)) == want  # transformers' save
    assert norm(variant(QWEN3, rope_theta=None, rope_scaling=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})) == want
    assert (want.rope_theta, want.rotary_dim, want.num_experts) == (1e6, 16, 8)
    nxt = norm(NEXT)
    assert nxt.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert norm(variant(NEXT, full_attention_interval=None, layer_types=list(nxt.layer_types))) == nxt
    assert nxt.rotary_dim == 8 and nxt.attn_output_gate and nxt.attn_qk_norm  # head_dim 32 * 0.25
    assert norm(variant(NEXT, partial_rotary_factor=None, rope_theta=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                         "partial_rotary_factor": 0.25})) == nxt


def test_qwen3_5_text_config_nesting() -> None:
    text = variant(NEXT, architectures=None, model_type="qwen3_5_moe_text", full_attention_interval=None,
                   rope_theta=None, partial_rotary_factor=None,
                   layer_types=["linear_attention"] * 3 + ["full_attention"],
                   num_hidden_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                         "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                                         "mrope_interleaved": True}, eos_token_id=9)
    hf = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": text,
          "vision_config": {"depth": 1}, "tie_word_embeddings": False, "dtype": "bfloat16"}
    cfg = norm(hf, {"eos_token_id": [9, 11]})
    assert cfg.family == "qwen3_5_moe" and cfg.num_layers == 4 and cfg.rotary_dim == 8
    assert cfg.norm_topk_prob and cfg.mlp_types == ("moe",) * 4 and cfg.eos_token_ids == (9, 11)
    assert dtype_policy("auto", False, hf).plain == torch.bfloat16


def test_dense_layers_and_routing_flags() -> None:
    cfg = norm(variant(QWEN3, mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=False))
    assert cfg.mlp_types == ("dense", "moe", "dense", "moe") and cfg.norm_topk_prob is False
    with pytest.raises(CheckpointError, match="dense MLP layers need a positive 'intermediate_size'"):
        norm(variant(QWEN3, mlp_only_layers=[0], intermediate_size=None))


def test_stop_tokens_and_dtype_spellings() -> None:
    cfg = norm(QWEN3, {"eos_token_id": [8, 7], "bos_token_id": 5})
    assert cfg.eos_token_ids == (7, 8) and cfg.bos_token_id == 5
    assert dtype_policy("auto", False, QWEN3).plain == torch.bfloat16  # torch_dtype (older configs)
    assert dtype_policy("auto", False, variant(QWEN3, torch_dtype=None, dtype="float16")).plain == torch.float16
    pol = dtype_policy("fp32", True, QWEN3)
    assert (pol.dtype, pol.plain, pol.dequant) == (torch.float32, torch.float32, True)


@pytest.mark.parametrize("hf, match", [
    (variant(QWEN3, rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear' is not supported"),
    (variant(QWEN3, rope_theta=None, rope_parameters={"rope_type": "llama3"}), "rope type 'llama3'"),
    (variant(NEXT, attn_output_gate=False), "attn_output_gate=False is not supported"),
    (variant(QWEN3, attention_bias=True), "attention_bias=True is not supported"),
    (variant(QWEN3, num_attention_heads=None), "required key 'num_attention_heads' is missing"),
    (variant(QWEN3, num_key_value_heads=3), "num_heads 4 is not a multiple of num_kv_heads 3"),
])
def test_refusals_name_the_key(hf: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        norm(hf)


def test_mixtral_sliding_window() -> None:
    mix = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
           "sliding_window": None}
    cfg = norm(mix)
    assert (cfg.head_dim, cfg.rope_theta, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (16, 1e6, 32, True)
    assert norm(variant(mix, sliding_window=4096)) == cfg  # a window as long as the context is no window
    with pytest.raises(CheckpointError, match="sliding_window=1024 is not supported"):
        norm(variant(mix, sliding_window=1024))


def test_modelopt_declarations() -> None:
    mixed = parse_quant({"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": ["mtp*"],
        "quantized_layers": {"model.layers.0.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                             "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}}}}, None)
    assert mixed.allowed("model.layers.0.mlp.experts.3.gate_proj") == {"nvfp4"}
    assert mixed.allowed("model.layers.0.self_attn.q_proj") == {"fp8"}
    assert mixed.allowed("model.layers.0.mlp.gate") == {"plain"}
    legacy = parse_quant({}, {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*mlp.gate"]}})
    assert legacy.source["quantization"]["quant_algo"] == "NVFP4"
    assert legacy.allowed("model.layers.1.self_attn.o_proj") == {"nvfp4", "plain"}
    assert legacy.allowed("lm_head") == {"plain"} and legacy.allowed("model.layers.1.mlp.gate") == {"plain"}
    assert not parse_quant({}, None).quantized
    with pytest.raises(CheckpointError, match="group_size 32 is not supported"):
        parse_quant({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}},
                    None)
