"""glm4_moe (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7): GQA with optional q/k/v biases (o_proj never has one) and
optional q/k-norm, partial rotary (default half of head_dim), `first_k_dense_replace` leading dense layers, then MoE
layers with DeepSeek-style routing (sigmoid scores, `e_score_correction_bias` for selection only, group-limited top-k,
`routed_scaling_factor`) and an ungated shared expert `mlp.shared_experts` (n_shared_experts × moe_intermediate_size).

The multi-token-prediction layers the releases carry after the decoder (`model.layers.{L}.*` … for
`num_nextn_predict_layers` layers; transformers ignores them too) are skipped and recorded as skipped.
"""

from __future__ import annotations

from ft.compiler.errors import CheckpointError
from ft.compiler.experts import ExpertSource
from ft.compiler.families.base import Family, HFConfig, common_fields, make_config
from ft.compiler.plan import BankItem, Item, LinearItem, TensorItem
from ft.formats import ModelConfig

_TOPK_METHODS = (None, "noaux_tc")  # the only selection rule transformers' Glm4MoeTopkRouter implements
_SCORING = (None, "sigmoid")


class Glm4Moe(Family):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        c.refuse("topk_method", f"routing is sigmoid + correction bias, group-limited ({_TOPK_METHODS[1]})",
                 ok=lambda v: v in _TOPK_METHODS)
        c.refuse("scoring_func", "glm4_moe routers score experts with a sigmoid", ok=lambda v: v in _SCORING)
        c.refuse("q_lora_rank", "low-rank (MLA) attention is deepseek_v3's, not glm4_moe's")
        c.refuse("kv_lora_rank", "low-rank (MLA) attention is deepseek_v3's, not glm4_moe's")
        c.refuse("use_sliding_window", "sliding-window attention is not implemented")
        f = common_fields(c, gen, family=self.name, default_theta=10_000.0, default_partial=0.5)
        L = f["num_layers"]
        dense = c.int("first_k_dense_replace", 1)
        if not 0 <= dense <= L:
            raise CheckpointError(f"{c.where}: first_k_dense_replace must be in 0..{L}, got {dense}")
        mtp = c.int("num_nextn_predict_layers", c.int("num_mtp_layers", 0))
        if mtp < 0:
            raise CheckpointError(f"{c.where}: num_nextn_predict_layers must be >= 0, got {mtp}")
        self.skip_prefixes = tuple(f"{self.prefix}layers.{L + j}." for j in range(mtp))
        f.update(
            layer_types=("full_attention",) * L, mlp_types=("dense",) * dense + ("moe",) * (L - dense),
            attn_qkv_bias=_flag(c, "attention_bias", False), attn_qk_norm=_flag(c, "use_qk_norm", False),
            attn_output_gate=False, **moe_fields(c, self.name, experts=128, scale=1.0),
        )
        return make_config(f, c.where)

    def moe(self, cfg: ModelConfig, i: int, experts: ExpertSource, *, block: str = "mlp",
            router: str = "gate") -> list[Item]:
        """Router, its fp32 correction bias, the expert bank and the ungated shared expert (`shared_experts`)."""
        p, o, H = f"{self.prefix}layers.{i}.mlp.", f"layers.{i}.mlp.", cfg.hidden_size
        items: list[Item] = [
            LinearItem(f"{o}gate", ((f"{p}gate", cfg.num_experts),), H, router=True),
            TensorItem(f"{o}e_score_correction_bias", f"{p}gate.e_score_correction_bias", (cfg.num_experts,), "fp32"),
            BankItem(f"{o}experts", cfg.num_experts, cfg.moe_intermediate_size, H, experts),
        ]
        if cfg.has_shared_expert:
            items += self.gated_mlp(f"{p}shared_experts.", f"{o}shared_expert.", cfg.shared_expert_intermediate_size, H)
        return items


def moe_fields(c: HFConfig, family: str, *, experts: int, scale: float) -> dict:
    """The normalized config's MoE fields of GLM's MoE (glm4_moe, glm_moe_dsa): sigmoid router with the correction
    bias and group-limited top-k, routed scaling (`scale`, `experts`: the defaults when the config omits them), one
    ungated shared expert of `n_shared_experts` x the expert width."""
    shared = c.int("n_shared_experts", 1)
    if shared < 1:
        raise CheckpointError(f"{c.where}: n_shared_experts={shared} is not supported ({family} has a shared expert)")
    routed = c.get("routed_scaling_factor", scale)
    if isinstance(routed, bool) or not isinstance(routed, (int, float)):
        raise CheckpointError(f"{c.where}: routed_scaling_factor must be a number, got {routed!r}")
    moe_inter = c.int("moe_intermediate_size")
    return dict(
        num_experts=c.int("n_routed_experts", c.int("num_local_experts", experts)),
        num_experts_per_tok=c.int("num_experts_per_tok"), moe_intermediate_size=moe_inter,
        norm_topk_prob=_flag(c, "norm_topk_prob", True), shared_expert_intermediate_size=shared * moe_inter,
        intermediate_size=c.int("intermediate_size", 0), tie_word_embeddings=_flag(c, "tie_word_embeddings", False),
        router_scoring="sigmoid", router_correction_bias=True, router_n_group=c.int("n_group", 1),
        router_topk_group=c.int("topk_group", 1), routed_scaling_factor=float(routed), shared_expert_gate=False)


def _flag(c: HFConfig, key: str, default: bool) -> bool:
    v = c.get(key, default)
    if not isinstance(v, bool):
        raise CheckpointError(f"{c.where}: {key!r} must be true or false, got {v!r}")
    return v
