"""gpt_oss (gpt-oss-20b, gpt-oss-120b).

Layer: RMSNorm → GQA attention with q/k/v/o biases and per-head sinks (no qk-norm, full-width YaRN RoPE), on
`sliding_attention` layers over a `sliding_window` of keys → residual → RMSNorm → MoE: router logits `x·Wᵀ + b`, top-k
with a softmax over the k (computed as softmax, top-k, renormalise: the same ids and weights), biased experts with the
clamped SwiGLU (`expert_act = clamped_swiglu`, `ft.runtime.experts`). Expert banks: mxfp4 (the release) or plain.

    layers.{i}: input_layernorm, self_attn.{qkv_proj (weight + bias), o_proj (weight + bias), sinks},
                post_attention_layernorm, mlp.{gate (weight + bias), experts}
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "gpt_oss",
    rules={"attn_qkv_bias": True, "attn_o_bias": True, "attn_sinks": True, "attn_qk_norm": False,
           "attn_output_gate": False, "norm_topk_prob": True, "router_bias": True, "expert_bias": True,
           "expert_act": "clamped_swiglu", "shared_expert_intermediate_size": 0},
    layer_types=("full_attention", "sliding_attention"),
    mlp_types=("moe",),
    rope_types=("default", "yarn"),
)


class GptOssForCausalLM(CausalLM):
    family = FAMILY
