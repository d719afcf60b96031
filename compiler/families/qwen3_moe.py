"""qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): GQA with q/k-norm, MoE with optional dense layers."""

from __future__ import annotations

from ft.compiler.families.base import Family, HFConfig, common_fields, make_config, sparse_mlp_types
from ft.formats import ModelConfig


class Qwen3Moe(Family):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        c.refuse("use_sliding_window", "sliding-window attention is not implemented")
        c.refuse("attention_bias", "attention biases are not part of the qwen3_moe FTW layout")
        f = common_fields(c, gen, family=self.name, default_theta=10_000.0)
        num_experts = c.int("num_experts", c.int("num_local_experts", 128))  # transformers saves num_local_experts
        f.update(
            layer_types=("full_attention",) * f["num_layers"],
            mlp_types=sparse_mlp_types(c, f["num_layers"], num_experts),
            attn_qkv_bias=False, attn_qk_norm=True, attn_output_gate=False,
            num_experts=num_experts, num_experts_per_tok=c.int("num_experts_per_tok"),
            moe_intermediate_size=c.int("moe_intermediate_size"), norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=0, intermediate_size=c.int("intermediate_size", 0),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
        return make_config(f, c.where)
