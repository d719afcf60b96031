"""qwen3_next (Qwen3-Next-80B-A3B).

Hybrid stack: `full_attention` layers (every 4th in the release) use gated GQA attention — q_norm/k_norm, partial
RoPE on the first `rotary_dim` dims, output `o_proj(attn · σ(gate))`; the other layers use Gated DeltaNet
(`ft.runtime.layers.deltanet`). Every MLP is MoE with a sigmoid-gated shared expert (dense where the source's
`mlp_only_layers` say). The source's zero-centred norms `(1 + w)` are folded by the compiler, and its per-key-head
grouped `in_proj_qkvz` / `in_proj_ba` rows are regrouped to `[q | k | v | z]` / `[b | a]`.

    layers.{i}: input_layernorm,
                self_attn.{qkv_proj ([q | k | v | gate]), q_norm, k_norm, o_proj}
                | linear_attn.{in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj},
                post_attention_layernorm, mlp.{gate, experts, shared_expert, shared_expert_gate}
"""

from __future__ import annotations

from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "qwen3_next",
    rules={"attn_qkv_bias": False, "attn_qk_norm": True, "attn_output_gate": True},
    positive=("shared_expert_intermediate_size",),
    layer_types=("full_attention", "linear_attention"),
    full_rotary=False,
    needs_linear_attention=True,
)


class Qwen3NextForCausalLM(CausalLM):
    family = FAMILY
