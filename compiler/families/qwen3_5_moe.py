"""qwen3_5_moe (Qwen3.5/3.6-35B-A3B, 122B-A10B, 397B-A17B): as qwen3_next with split contiguous GDN projections,
always-renormalised routing, the decoder under `model.language_model.` (vision tower and MTP head skipped), and experts
stored either per expert (2-D) or fused (3-D `experts.gate_up_proj` / `experts.down_proj`)."""

from __future__ import annotations

from ft.compiler.families.base import HFConfig, eos_ids, make_config
from ft.compiler.families.hybrid import HybridFamily
from ft.compiler.experts import ExpertSource, FusedExperts
from ft.compiler.plan import Item, LinearItem
from ft.compiler.source import Checkpoint
from ft.formats import ModelConfig


class Qwen35Moe(HybridFamily):
    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    skip_prefixes = ("mtp.", "model.visual.")

    def text_config(self, hf: dict) -> HFConfig:
        tc = hf.get("text_config")
        return HFConfig(tc, "config.json text_config") if isinstance(tc, dict) else HFConfig(hf)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = self.text_config(hf)
        f = self.hybrid_fields(c, gen, allow_mrope=True)
        tie = hf.get("tie_word_embeddings", c.get("tie_word_embeddings", False))  # the top level governs the VLM
        f.update(mlp_types=("moe",) * f["num_layers"], norm_topk_prob=True, intermediate_size=0,
                 tie_word_embeddings=bool(tie))
        if f["bos_token_id"] is None and isinstance(hf.get("bos_token_id"), int):
            f["bos_token_id"] = hf["bos_token_id"]
        f["eos_token_ids"] = eos_ids(c.d, hf, gen)
        return make_config(f, c.where)

    def bind(self, ck: Checkpoint) -> None:
        # ForConditionalGeneration checkpoints nest the decoder; text-only ForCausalLM saves use `model.`
        self.prefix = "model.language_model." if ck.has("model.language_model.embed_tokens.weight") else "model."

    def experts(self, cfg: ModelConfig, i: int, ck: Checkpoint) -> ExpertSource:
        p = f"{self.prefix}layers.{i}.mlp.experts."
        if ck.has(p + "gate_up_proj"):
            return FusedExperts(p + "gate_up_proj", p + "down_proj")
        return super().experts(cfg, i, ck)

    def linear_attention(self, cfg: ModelConfig, i: int) -> list[Item]:
        p, o, H = f"{self.prefix}layers.{i}.linear_attn.", f"layers.{i}.linear_attn.", cfg.hidden_size
        Hk, Hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        return [
            LinearItem(f"{o}in_proj_qkvz", ((f"{p}in_proj_qkv", 2 * Hk * dk + Hv * dv), (f"{p}in_proj_z", Hv * dv)), H),
            LinearItem(f"{o}in_proj_ba", ((f"{p}in_proj_b", Hv), (f"{p}in_proj_a", Hv)), H),
            *self.gdn_tail(cfg, i),
        ]
