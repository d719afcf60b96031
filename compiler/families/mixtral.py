"""mixtral (Mixtral-8x7B, 8x22B): GQA, MoE only; source experts are `block_sparse_moe.experts.{e}.w1/w3/w2`."""

from __future__ import annotations

from ft.compiler.families.base import Family, HFConfig, common_fields, make_config
from ft.compiler.experts import PerExpert
from ft.compiler.plan import Item
from ft.compiler.source import Checkpoint
from ft.formats import ModelConfig


class Mixtral(Family):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        f = common_fields(c, gen, family=self.name, default_theta=1_000_000.0)
        c.refuse("sliding_window", "sliding-window attention is not implemented",
                 ok=lambda v: v is None or v >= f["max_position_embeddings"])
        f.update(
            layer_types=("full_attention",) * f["num_layers"], mlp_types=("moe",) * f["num_layers"],
            attn_qkv_bias=False, attn_qk_norm=False, attn_output_gate=False,
            num_experts=c.int("num_local_experts", c.int("num_experts", 8)),
            num_experts_per_tok=c.int("num_experts_per_tok"), moe_intermediate_size=c.int("intermediate_size"),
            norm_topk_prob=True, shared_expert_intermediate_size=0,
            intermediate_size=0,  # no dense MLP layers; the experts' size is moe_intermediate_size
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
        return make_config(f, c.where)

    def experts(self, cfg: ModelConfig, i: int, ck: Checkpoint) -> PerExpert:
        p = f"{self.prefix}layers.{i}.block_sparse_moe.experts.{{e}}."
        return PerExpert(gate=p + "w1", up=p + "w3", down=p + "w2")

    def mlp(self, cfg: ModelConfig, i: int, experts: PerExpert) -> list[Item]:
        return self.moe(cfg, i, experts, block="block_sparse_moe")
