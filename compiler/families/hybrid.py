"""Shared by qwen3_next and qwen3_5_moe: Gated DeltaNet layers interleaved with gated full attention,
zero-centred RMSNorms, partial RoPE, MoE with a sigmoid-gated shared expert."""

from __future__ import annotations

from typing import Any

from ft.compiler.families.base import Family, HFConfig, common_fields, hybrid_layer_types
from ft.compiler.plan import Item, LinearItem, TensorItem
from ft.formats import ModelConfig


class HybridFamily(Family):
    zero_centred_norms = True

    def hybrid_fields(self, c: HFConfig, gen: dict | None, *, allow_mrope: bool) -> dict[str, Any]:
        c.refuse("attention_bias", "attention biases are not part of the gated-attention FTW layout")
        c.refuse("attn_output_gate", "only gated attention is implemented for this family", ok=lambda v: v is not False)
        f = common_fields(c, gen, family=self.name, default_theta=10_000.0, default_partial=0.25,
                          allow_mrope=allow_mrope)
        f.update(
            layer_types=hybrid_layer_types(c, f["num_layers"]),
            attn_qkv_bias=False, attn_qk_norm=True, attn_output_gate=True,
            num_experts=c.int("num_experts"), num_experts_per_tok=c.int("num_experts_per_tok"),
            moe_intermediate_size=c.int("moe_intermediate_size"),
            shared_expert_intermediate_size=c.int("shared_expert_intermediate_size"),
            linear_num_key_heads=c.int("linear_num_key_heads", 16),
            linear_num_value_heads=c.int("linear_num_value_heads", 32),
            linear_key_head_dim=c.int("linear_key_head_dim", 128),
            linear_value_head_dim=c.int("linear_value_head_dim", 128),
            linear_conv_kernel_dim=c.int("linear_conv_kernel_dim", 4),
        )
        return f

    def gdn_tail(self, cfg: ModelConfig, i: int) -> list[Item]:
        """conv1d (squeezed to [C, K]), dt_bias / A_log (fp32), RMSNormGated weight (plain w), out_proj."""
        p, o = f"{self.prefix}layers.{i}.linear_attn.", f"layers.{i}.linear_attn."
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        conv_dim = 2 * Hk * dk + Hv * dv
        return [
            TensorItem(f"{o}conv1d.weight", f"{p}conv1d.weight", (conv_dim, 1, K), "conv"),
            TensorItem(f"{o}dt_bias", f"{p}dt_bias", (Hv,), "fp32"),
            TensorItem(f"{o}A_log", f"{p}A_log", (Hv,), "fp32"),
            TensorItem(f"{o}norm.weight", f"{p}norm.weight", (dv,), "norm"),
            LinearItem(f"{o}out_proj", ((f"{p}out_proj", cfg.hidden_size),), Hv * dv),
        ]
