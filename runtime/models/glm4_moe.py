"""glm4_moe (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7).

Layer: RMSNorm → GQA attention with optional q/k/v biases (never on o_proj) and optional per-head q_norm/k_norm, then
partial RoPE (rotate_half on the first `rotary_dim` dims, half of head_dim in the releases) → residual → RMSNorm →
a dense gated MLP on the first `first_k_dense_replace` layers, else MoE: the sigmoid router (`router_scoring =
sigmoid`, `e_score_correction_bias` for selection only, group-limited top-k, `norm_topk_prob`, `routed_scaling_factor`;
`ft.runtime.layers.moe.route_sigmoid`) plus an ungated shared expert: `y = Σ_k w_k·expert_k(x) + shared_expert(x)`.

    layers.{i}: input_layernorm, self_attn.{qkv_proj (weight [+ bias]), [q_norm, k_norm], o_proj},
                post_attention_layernorm, mlp.{gate, e_score_correction_bias, experts, shared_expert.{gate_up_proj,
                down_proj}} | mlp.{gate_up_proj, down_proj}
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "glm4_moe",
    rules={"attn_output_gate": False, "router_scoring": "sigmoid", "router_correction_bias": True,
           "shared_expert_gate": False},
    free=("router_n_group", "router_topk_group", "routed_scaling_factor"),
    positive=("shared_expert_intermediate_size",),
    full_rotary=False,
)


class Glm4MoeForCausalLM(CausalLM):
    family = FAMILY
