"""Architectures and presets of `ft synth`: the Hugging Face config values each preset starts from.

Every preset is a dict of the architecture's own transformers config keys (for qwen3_5_moe: `text_config` keys plus a
`vision` dict). Full-size presets copy the published configs of the real releases (sources in the checkpoint-formats
reference, §1); tiny/small/demo presets keep each family's structure (GQA, shared expert, qkv bias, hybrid layers,
gated attention, partial/mrope rotary) at sizes that run on a laptop CPU.

glm4_moe presets keep the releases' structure (q/k/v biases, partial rotary over half of head_dim, leading dense
layers, sigmoid router with correction bias, ungated shared expert, one MTP layer after the decoder); tiny is
GLM-4.5-like (q/k-norm, routed_scaling_factor 2.5) with 2 expert groups of which 1 is eligible, small is
GLM-4.5-Air-like.
GLM-4.5 / GLM-4.5-Air copy the published configs. Their BPE ranks are not available offline: Qwen3's stand in, with
GLM's special tokens and chat format (tokenizer flavor `glm`), truncated so that every id stays below the real
151552-row embedding (like mixtral).

glm_moe_dsa presets keep GLM-5's structure at small sizes (MLA with q/kv low-rank projections, rope width a quarter
of the query width, value heads wider than the rope part, the DSA indexer, leading dense layers, sigmoid router with
correction bias and routed_scaling_factor 2.5, an ungated shared expert, one MTP layer); tiny has an `index_topk` of 8,
so test prompts exceed it, and a `shared` indexer layer (GLM-5.2's IndexShare); small is GLM-5-like (every layer full).

deepseek_v4 presets keep DeepSeek-V4-Flash's structure at small sizes (one shared K=V head, partial interleaved
rotary, sliding, CSA and HCA layers, YaRN on the compressed layers' rope, the grouped output projection, 4
hyper-connection streams, hash-routed leading MoE layers, sqrtsoftplus routers with correction bias, a clamped shared
expert); tiny compresses every 4 (CSA) and 8 (HCA) tokens with a window of 8 and an `index_topk` of 4, so test
prompts exceed all three, and a `swiglu_limit` of 2 that the synthetic activations reach. There is no offline
DeepSeek tokenizer: Qwen3's stands in (flavor `qwen3`).

gpt_oss presets keep the release's structure (biased attention with sinks, alternating sliding / full layers, YaRN,
biased router and experts; hidden and intermediate sizes multiples of 32 for MXFP4); gpt-oss-20b / gpt-oss-120b copy
the published configs (tensors written by `synth.gpt_oss_stream`).

Vocabulary: tiny presets use a truncated real Qwen tokenizer (`TINY_RANKS` BPE ranks + the real special tokens right
after), so `vocab_size` equals the tokenizer's size. Other presets use the full real vocabulary (embedding rows padded
like the real releases: 151936 for Qwen3-family tokenizers, 248320 for Qwen3.5/3.6). Synthetic mixtral has no Llama
tokenizer offline: it uses the Qwen3 tokenizer truncated to 32000 - (number of specials) ranks, so the embedding keeps
the real 32000 rows and every token id the tokenizer can produce is < 32000.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "gpt_oss", "glm4_moe", "glm_moe_dsa",
         "deepseek_v4")
TOKENIZER_FLAVOR = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen3", "mixtral": "qwen3", "qwen3_next": "qwen3",
                    "qwen3_5_moe": "qwen3_5", "gpt_oss": "harmony", "glm4_moe": "glm", "glm_moe_dsa": "glm",
                    "deepseek_v4": "qwen3"}
TINY_RANKS = 512  # BPE ranks kept by tiny presets (the 256 single bytes + 256 merges)
MIXTRAL_VOCAB = 32000
GLM_VOCAB = 151552
GLM5_VOCAB = 154880  # GLM-5's embedding rows


@dataclass(frozen=True)
class Preset:
    name: str
    archs: tuple[str, ...]
    kind: str  # "hf": built with transformers + save_pretrained; "stream": written tensor by tensor
    dtype: str  # default dtype: "fp32" | "bf16"
    max_shard_size: int  # bytes per safetensors shard (several shards even for tiny models, like real releases)
    configs: dict[str, dict] = field(default_factory=dict)  # arch -> config keys


_GPT_OSS_YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)
# gpt-oss-20b config.json as published (openai/gpt-oss-20b); 120b differs in layers and experts
_GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                    num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5, rope_theta=150000.0,
                    max_position_embeddings=131072, rope_scaling=_GPT_OSS_YARN, swiglu_limit=7.0,
                    tie_word_embeddings=False)


def _tiny() -> dict[str, dict]:
    attn = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                max_position_embeddings=4096, tie_word_embeddings=False)
    hybrid = dict(attn, num_hidden_layers=4, head_dim=32, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    return {
        "qwen3_moe": dict(attn, num_hidden_layers=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1e6),
        "qwen2_moe": dict(attn, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=False, rope_theta=1e6),
        "mixtral": dict(attn, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                        rms_norm_eps=1e-5, rope_theta=1e6),
        "qwen3_next": dict(hybrid, intermediate_size=128, norm_topk_prob=True, rope_theta=1e7,
                           partial_rotary_factor=0.25, full_attention_interval=4),
        "qwen3_5_moe": dict(hybrid, rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                            full_attention_interval=4,
                            vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                        num_position_embeddings=16, patch_size=16)),
        # 4 layers: sliding, full, sliding, full; a window of 8 so that test prompts exceed it
        "gpt_oss": dict(attn, num_hidden_layers=4, head_dim=16, intermediate_size=64, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=8, rms_norm_eps=1e-5, rope_theta=150000.0,
                        max_position_embeddings=8192,
                        rope_scaling=dict(_GPT_OSS_YARN, original_max_position_embeddings=256)),
        # 3 layers: dense, MoE, MoE (+ the MTP layer); 2 groups of 4 experts, the best group only
        "glm4_moe": dict(attn, num_hidden_layers=3, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                         n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                         attention_bias=True, partial_rotary_factor=0.5, rope_theta=1e6, rms_norm_eps=1e-5,
                         num_nextn_predict_layers=1),
        # 4 layers: dense, MoE x3; indexer full, full, shared, full; 2 groups of 4 experts, the best group only
        "glm_moe_dsa": dict(attn, num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                            qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=16, index_n_heads=8,
                            index_head_dim=16, index_topk=8, indexer_types=["full", "full", "shared", "full"],
                            intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                            routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-5,
                            num_nextn_predict_layers=1),
        # 4 layers: sliding, CSA, HCA, CSA; MoE everywhere, the first hash-routed
        "deepseek_v4": dict(attn, num_hidden_layers=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
                            q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
                            layer_types=["sliding_attention", "compressed_sparse_attention",
                                         "heavily_compressed_attention", "compressed_sparse_attention"],
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                            index_n_heads=4, index_head_dim=16, index_topk=4, hc_mult=4,
                            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], moe_intermediate_size=32,
                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5,
                            swiglu_limit=2.0, rope_theta=10_000.0, compress_rope_theta=160_000.0,
                            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024,
                                              beta_fast=32.0, beta_slow=1.0)),
    }


def _small() -> dict[str, dict]:
    base = dict(hidden_size=256, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False)
    hybrid = dict(base, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=64,
                  num_experts_per_tok=8, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                  linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=262144)
    return {
        "qwen3_moe": dict(base, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                          intermediate_size=768, moe_intermediate_size=128, num_experts=64, num_experts_per_tok=8,
                          norm_topk_prob=True, rope_theta=1e6, vocab_size=151936),
        "qwen2_moe": dict(base, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
                          intermediate_size=768, moe_intermediate_size=128, shared_expert_intermediate_size=512,
                          num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, rope_theta=1e6,
                          vocab_size=151936, max_position_embeddings=8192),
        "mixtral": dict(base, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024,
                        num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
                        vocab_size=MIXTRAL_VOCAB),
        "qwen3_next": dict(hybrid, intermediate_size=512, norm_topk_prob=True, rope_theta=1e7,
                           partial_rotary_factor=0.25, full_attention_interval=4, vocab_size=151936),
        "qwen3_5_moe": dict(hybrid, rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[6, 5, 5],
                            full_attention_interval=4, vocab_size=248320,
                            vision=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4,
                                        num_position_embeddings=64, patch_size=16)),
        "gpt_oss": dict(base, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                        intermediate_size=256, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
                        rope_scaling=_GPT_OSS_YARN, vocab_size=201088),
        "glm4_moe": dict(base, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         intermediate_size=768, moe_intermediate_size=128, n_routed_experts=64, n_shared_experts=1,
                         num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                         routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
                         partial_rotary_factor=0.5, rope_theta=1e6, rms_norm_eps=1e-5, vocab_size=GLM_VOCAB,
                         max_position_embeddings=131072, num_nextn_predict_layers=1),
        "glm_moe_dsa": dict(base, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128,
                            kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
                            index_n_heads=8, index_head_dim=32, index_topk=256, intermediate_size=768,
                            moe_intermediate_size=128, n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=8,
                            n_group=1, topk_group=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
                            norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-5, vocab_size=GLM5_VOCAB,
                            max_position_embeddings=202752, num_nextn_predict_layers=1),
        "deepseek_v4": dict(base, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                            partial_rotary_factor=0.125, q_lora_rank=128, o_groups=4, o_lora_rank=64,
                            sliding_window=128, index_n_heads=8, index_head_dim=32, index_topk=64, hc_mult=4,
                            moe_intermediate_size=128, n_routed_experts=64, n_shared_experts=1,
                            num_experts_per_tok=6, routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10_000.0,
                            compress_rope_theta=160_000.0, vocab_size=151936, max_position_embeddings=262144,
                            rope_scaling=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=16384,
                                              beta_fast=32.0, beta_slow=1.0)),
    }


# Qwen3.6-35B-A3B text_config and vision_config as published (nvidia/Qwen3.6-35B-A3B-NVFP4 config.json copy)
_QWEN36_35B = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
    rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
    full_attention_interval=4, tie_word_embeddings=False,
    vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, num_position_embeddings=2304,
                patch_size=16),
)

# GLM-4.5-Air config.json as published (zai-org/GLM-4.5-Air); GLM-4.5 differs as below (checkpoint-formats §1.7)
_GLM45_AIR = dict(vocab_size=GLM_VOCAB, hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
                  num_key_value_heads=8, head_dim=128, intermediate_size=10944, moe_intermediate_size=1408,
                  n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                  first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False,
                  attention_bias=True, partial_rotary_factor=0.5, rope_theta=1e6, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, num_nextn_predict_layers=1, tie_word_embeddings=False)

PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", ARCHS, "hf", "fp32", 256 << 10, _tiny()),
    "small": Preset("small", ARCHS, "hf", "bf16", 128 << 20, _small()),
    # a Qwen3.6-shaped model with the real 248k tokenizer that compiles and serves on 2 CPU cores
    "demo": Preset("demo", ("qwen3_5_moe",), "hf", "bf16", 64 << 20, {"qwen3_5_moe": dict(
        hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[3, 3, 2], full_attention_interval=4,
        tie_word_embeddings=False,
        vision=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, num_position_embeddings=16,
                    patch_size=16))}),
    "qwen3-30b-a3b": Preset("qwen3-30b-a3b", ("qwen3_moe",), "stream", "bf16", 4 << 30, {"qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False)}),
    # qwen3_moe at the Qwen3.6 MoE geometry (attention and experts of the 35B-A3B, plain qwen3_moe layers)
    "qwen3moe-35b-geom": Preset("qwen3moe-35b-geom", ("qwen3_moe",), "stream", "bf16", 4 << 30, {"qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
        norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=False)}),
    "qwen3.6-35b-a3b": Preset("qwen3.6-35b-a3b", ("qwen3_5_moe",), "stream", "bf16", 4 << 30,
                              {"qwen3_5_moe": _QWEN36_35B}),
    "qwen3-next-80b-a3b": Preset("qwen3-next-80b-a3b", ("qwen3_next",), "stream", "bf16", 4 << 30, {"qwen3_next": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=262144, rope_theta=1e7, partial_rotary_factor=0.25, full_attention_interval=4,
        rms_norm_eps=1e-6, tie_word_embeddings=False)}),
    "qwen1.5-moe-a2.7b": Preset("qwen1.5-moe-a2.7b", ("qwen2_moe",), "stream", "bf16", 4 << 30, {"qwen2_moe": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4, norm_topk_prob=False, max_position_embeddings=8192, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False)}),
    "mixtral-8x7b": Preset("mixtral-8x7b", ("mixtral",), "stream", "bf16", 4 << 30, {"mixtral": dict(
        vocab_size=MIXTRAL_VOCAB, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False)}),
    "gpt-oss-20b": Preset("gpt-oss-20b", ("gpt_oss",), "stream", "bf16", 4 << 30, {"gpt_oss": _GPT_OSS_20B}),
    "gpt-oss-120b": Preset("gpt-oss-120b", ("gpt_oss",), "stream", "bf16", 4 << 30, {"gpt_oss": dict(
        _GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)}),
    "glm-4.5-air": Preset("glm-4.5-air", ("glm4_moe",), "stream", "bf16", 4 << 30, {"glm4_moe": _GLM45_AIR}),
    "glm-4.5": Preset("glm-4.5", ("glm4_moe",), "stream", "bf16", 4 << 30, {"glm4_moe": dict(
        _GLM45_AIR, hidden_size=5120, num_hidden_layers=92, intermediate_size=12288, moe_intermediate_size=1536,
        n_routed_experts=160, first_k_dense_replace=3, routed_scaling_factor=2.5, use_qk_norm=True)}),
}
FULL_SIZE = tuple(name for name, p in PRESETS.items() if p.kind == "stream")


def describe() -> str:
    """One line per preset: the architectures it exists for (used by error messages and --help)."""
    return "; ".join(f"{name} ({', '.join(p.archs)})" for name, p in PRESETS.items())


def lookup(arch: str, preset: str) -> Preset:
    """The preset, or ValueError naming what exists."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {describe()}")
    p = PRESETS[preset]
    if arch not in p.archs:
        raise ValueError(f"preset {preset!r} does not exist for arch {arch!r}; presets: {describe()}")
    return p
