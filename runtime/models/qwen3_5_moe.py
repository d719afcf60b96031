"""qwen3_5_moe (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B, and larger), text part.

Same stack as qwen3_next (gated attention every 4th layer, Gated DeltaNet elsewhere, MoE + shared expert on every
layer); the differences are in the source layout, which the compiler normalises: weights under
`model.language_model.`, split contiguous `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` (fused here into
`in_proj_qkvz` / `in_proj_ba`), experts per-expert 2-D or fused 3-D, a router that always renormalises. mrope on
text-only input has three identical position streams, i.e. plain partial RoPE on `rotary_dim` dims.
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "qwen3_5_moe",
    rules={"attn_qkv_bias": False, "attn_qk_norm": True, "attn_output_gate": True, "norm_topk_prob": True},
    positive=("shared_expert_intermediate_size",),
    layer_types=("full_attention", "linear_attention"),
    mlp_types=("moe",),
    full_rotary=False,
    needs_linear_attention=True,
)


class Qwen3_5MoeForCausalLM(CausalLM):
    family = FAMILY
