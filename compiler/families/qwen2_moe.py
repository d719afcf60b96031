"""qwen2_moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v biases, MoE plus a sigmoid-gated shared expert."""

from __future__ import annotations

from ft.compiler.errors import CheckpointError
from ft.compiler.families.base import Family, HFConfig, common_fields, make_config, sparse_mlp_types
from ft.formats import ModelConfig


class Qwen2Moe(Family):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        c.refuse("use_sliding_window", "sliding-window attention is not implemented")
        c.refuse("layer_types", "only full_attention layers are implemented",
                 ok=lambda v: v is None or all(t == "full_attention" for t in v))
        if not c.get("qkv_bias", True):
            raise CheckpointError(f"{c.where}: qkv_bias=false is not supported (qwen2_moe has q/k/v biases)")
        f = common_fields(c, gen, family=self.name, default_theta=10_000.0)
        num_experts = c.int("num_experts", 60)
        f.update(
            layer_types=("full_attention",) * f["num_layers"],
            mlp_types=sparse_mlp_types(c, f["num_layers"], num_experts),
            attn_qkv_bias=True, attn_qk_norm=False, attn_output_gate=False,
            num_experts=num_experts, num_experts_per_tok=c.int("num_experts_per_tok"),
            moe_intermediate_size=c.int("moe_intermediate_size"), norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=c.int("shared_expert_intermediate_size"),
            intermediate_size=c.int("intermediate_size", 0),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
        return make_config(f, c.where)
