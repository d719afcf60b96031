"""mixtral (Mixtral-8x7B, 8x22B).

Layer: RMSNorm → GQA attention (no bias, no qk-norm, full-width RoPE) → residual → RMSNorm → MoE on every layer:
softmax (fp32) → top-2 → always renormalised; no shared expert. The source's `block_sparse_moe.experts.{e}.w1/w3/w2`
are the bank's `gate_up` (w1 rows first, then w3) and `down` (w2); `block_sparse_moe.gate` is `mlp.gate`.

    layers.{i}: input_layernorm, self_attn.{qkv_proj, o_proj}, post_attention_layernorm, mlp.{gate, experts}
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "mixtral",
    rules={"attn_qkv_bias": False, "attn_qk_norm": False, "attn_output_gate": False,
           "shared_expert_intermediate_size": 0, "norm_topk_prob": True},
    mlp_types=("moe",),
)


class MixtralForCausalLM(CausalLM):
    family = FAMILY
