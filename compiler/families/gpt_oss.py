"""gpt_oss (gpt-oss-20b, gpt-oss-120b): GQA with q/k/v/o biases and per-head attention sinks, sliding-window and full
attention layers alternating, YaRN RoPE, a biased router, and biased experts with the clamped SwiGLU; experts in MXFP4
(the release) or plain (transformers' save_pretrained), fused 3-D on disk (`GptOssExperts`)."""

from __future__ import annotations

from ft.compiler.errors import CheckpointError
from ft.compiler.experts_gpt_oss import GptOssExperts
from ft.compiler.families.base import Family, HFConfig, common_fields, make_config
from ft.compiler.plan import Item, TensorItem
from ft.compiler.source import Checkpoint
from ft.formats import ModelConfig

_LAYER_KINDS = ("sliding_attention", "full_attention")


class GptOss(Family):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        if c.get("attention_bias", True) is not True:
            raise CheckpointError(f"{c.where}: attention_bias={c.d['attention_bias']!r} is not supported (gpt_oss "
                                  "attention has q/k/v/o biases)")
        f = common_fields(c, gen, family=self.name, default_theta=150_000.0, allow_yarn=True, sliding=True)
        if f["rotary_dim"] != f["head_dim"]:
            raise CheckpointError(f"{c.where}: partial rotary is not supported for gpt_oss")
        L = f["num_layers"]
        layer_types = tuple(c.get("layer_types", None) or (_LAYER_KINDS[i % 2] for i in range(L)))
        if len(layer_types) != L or any(t not in _LAYER_KINDS for t in layer_types):
            raise CheckpointError(f"{c.where}: layer_types must list {L} entries of {' / '.join(_LAYER_KINDS)}, "
                                  f"got {list(layer_types)!r}")
        window = c.int("sliding_window", 0) if "sliding_attention" in layer_types else 0
        if "sliding_attention" in layer_types and window <= 0:
            raise CheckpointError(f"{c.where}: sliding_attention layers need a positive sliding_window")
        experts = c.int("num_local_experts", c.int("num_experts", 32))
        top_k = c.int("num_experts_per_tok") if "num_experts_per_tok" in c.d else c.int("experts_per_token")
        if c.d.get("experts_per_token") not in (None, top_k):
            raise CheckpointError(f"{c.where}: num_experts_per_tok {top_k} and experts_per_token "
                                  f"{c.d['experts_per_token']} disagree")
        f.update(
            layer_types=layer_types, mlp_types=("moe",) * L, sliding_window=window,
            attn_qkv_bias=True, attn_o_bias=True, attn_sinks=True, attn_qk_norm=False, attn_output_gate=False,
            num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=c.int("intermediate_size"),
            # top-k of the logits then a softmax over the k == softmax, top-k, renormalise (same ids and weights)
            norm_topk_prob=True, router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)), swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            shared_expert_intermediate_size=0, intermediate_size=0,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
        return make_config(f, c.where)

    def attention(self, cfg: ModelConfig, i: int) -> list[Item]:
        sinks = TensorItem(f"layers.{i}.self_attn.sinks", f"{self.prefix}layers.{i}.self_attn.sinks",
                           (cfg.num_heads,), "keep")
        return super().attention(cfg, i) + [sinks]

    def experts(self, cfg: ModelConfig, i: int, ck: Checkpoint) -> GptOssExperts:
        return GptOssExperts(f"{self.prefix}layers.{i}.mlp.experts.")

    def mlp(self, cfg: ModelConfig, i: int, experts: GptOssExperts) -> list[Item]:
        return self.moe(cfg, i, experts, router="router")
