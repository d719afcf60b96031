"""glm_moe_dsa (GLM-5, GLM-5.1, GLM-5.2).

Layer: RMSNorm → multi-head latent attention with the DSA indexer (`ft.runtime.layers.mla`: low-rank q and kv
projections with their norms, a shared rotary key, the cache holding the normed latent + rotated key; each query
attends its `index_topk` best past keys by the indexer's score; `shared` layers reuse the last full layer's choice)
→ residual → RMSNorm → a dense gated MLP on the leading dense layers, else MoE as glm4_moe (sigmoid router with
correction bias, group-limited top-k, `routed_scaling_factor`, ungated shared expert).

    layers.{i}: input_layernorm, self_attn.{qkv_a_proj, q_a_layernorm, q_b_proj, kv_a_layernorm, kv_b_proj, o_proj,
                [indexer.{wq_b, wk, k_norm (weight, bias), weights_proj}]}, post_attention_layernorm,
                mlp.{gate, e_score_correction_bias, experts, shared_expert.{gate_up_proj, down_proj}}
                | mlp.{gate_up_proj, down_proj}
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "glm_moe_dsa",
    rules={"attn_qkv_bias": False, "attn_qk_norm": False, "attn_output_gate": False, "router_scoring": "sigmoid",
           "router_correction_bias": True, "shared_expert_gate": False},
    free=("router_n_group", "router_topk_group", "routed_scaling_factor"),
    positive=("shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "v_head_dim", "index_n_heads",
              "index_head_dim", "index_topk"),
    layer_types=("mla_attention",),
    full_rotary=False,
)


class GlmMoeDsaForCausalLM(CausalLM):
    family = FAMILY
