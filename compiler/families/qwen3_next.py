"""qwen3_next (Qwen3-Next-80B-A3B): hybrid Gated DeltaNet + gated attention; the source's in_proj_qkvz / in_proj_ba
rows are grouped per key head and are regrouped here into the contiguous [q | k | v | z] / [b | a] layout."""

from __future__ import annotations

import torch

from ft.compiler.families.base import HFConfig, make_config, sparse_mlp_types
from ft.compiler.families.hybrid import HybridFamily
from ft.compiler.plan import Item, LinearItem
from ft.formats import ModelConfig


def regroup(num_groups: int, sizes: list[int]) -> torch.Tensor:
    """Row index turning `num_groups` repeats of [part_0 | part_1 | ...] (sizes) into
    [all part_0 | all part_1 | ...]."""
    rows = torch.arange(num_groups * sum(sizes)).view(num_groups, sum(sizes))
    return torch.cat([chunk.reshape(-1) for chunk in rows.split(sizes, dim=1)])


class Qwen3Next(HybridFamily):
    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    skip_prefixes = ("mtp.",)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        f = self.hybrid_fields(c, gen, allow_mrope=False)
        f.update(mlp_types=sparse_mlp_types(c, f["num_layers"], f["num_experts"]),
                 norm_topk_prob=bool(c.get("norm_topk_prob", True)), intermediate_size=c.int("intermediate_size", 0),
                 tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))
        return make_config(f, c.where)

    def linear_attention(self, cfg: ModelConfig, i: int) -> list[Item]:
        p, o, H = f"{self.prefix}layers.{i}.linear_attn.", f"layers.{i}.linear_attn.", cfg.hidden_size
        Hk, Hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        r = Hv // Hk  # value heads per key head
        return [
            # per key head g: [q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)]  ->  [q all | k all | v all | z all]
            LinearItem(f"{o}in_proj_qkvz", ((f"{p}in_proj_qkvz", 2 * Hk * dk + 2 * Hv * dv),), H,
                       perm=regroup(Hk, [dk, dk, r * dv, r * dv])),
            # per key head g: [b_g (r) | a_g (r)]  ->  [b all | a all]
            LinearItem(f"{o}in_proj_ba", ((f"{p}in_proj_ba", 2 * Hv),), H, perm=regroup(Hk, [r, r])),
            *self.gdn_tail(cfg, i),
        ]
