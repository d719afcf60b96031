"""qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B).

Layer: RMSNorm → GQA attention without bias, per-head q_norm/k_norm before full-width RoPE → residual →
RMSNorm → MoE (softmax → top-k → renorm iff `norm_topk_prob`; no shared expert), or a dense gated MLP on the
layers `mlp_only_layers` / `decoder_sparse_step` exclude (the compiler records them in `mlp_types`).

    embed_tokens
    layers.{i}: input_layernorm, self_attn.{qkv_proj, q_norm, k_norm, o_proj}, post_attention_layernorm,
                mlp.{gate, experts} | mlp.{gate_up_proj, down_proj}
    norm, lm_head
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "qwen3_moe",
    rules={"attn_qkv_bias": False, "attn_qk_norm": True, "attn_output_gate": False,
           "shared_expert_intermediate_size": 0},
)


class Qwen3MoeForCausalLM(CausalLM):
    family = FAMILY
