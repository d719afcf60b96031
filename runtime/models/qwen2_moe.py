"""qwen2_moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Layer: RMSNorm → GQA attention with q/k/v bias (no qk-norm, full-width RoPE) → residual → RMSNorm → MoE with a
sigmoid-gated shared expert: `y = Σ_k w_k·expert_k(x) + σ(shared_expert_gate·x)·shared_expert(x)`; the router
renormalises the top-k only if `norm_topk_prob` (false in the released models). Dense layers where the source's
`mlp_only_layers` / `decoder_sparse_step` say.

    layers.{i}: input_layernorm, self_attn.{qkv_proj (weight + bias), o_proj}, post_attention_layernorm,
                mlp.{gate, experts, shared_expert.{gate_up_proj, down_proj}, shared_expert_gate}
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "qwen2_moe",
    rules={"attn_qkv_bias": True, "attn_qk_norm": False, "attn_output_gate": False},
    positive=("shared_expert_intermediate_size",),
)


class Qwen2MoeForCausalLM(CausalLM):
    family = FAMILY
