"""deepseek_v4 (DeepSeek-V4-Flash, DeepSeek-V4-Pro).

The residual is `hc_mult` streams [N, n, H] (`ft.runtime.layers.hyper`): the embedding is copied into every stream;
layer i mixes them into one block input, runs the block and writes its output back into all streams, twice:
    post, comb, x = attn_hc(s);  s = expand(s, self_attn(input_layernorm(x)), post, comb)
    post, comb, x = ffn_hc(s);   s = expand(s, mlp(post_attention_layernorm(x)), post, comb)
then `hc_head` collapses the streams, the final norm and lm_head give the logits.
self_attn: sliding / CSA / HCA compressed attention (`ft.runtime.layers.compressed_attention`, its per-sequence state
`SequenceState.compressed[i]`). mlp: sqrtsoftplus router with correction bias, or on `hash_moe_layers` the frozen
table `tid2eid` [V, k] read at the token ids (`route_sqrtsoftplus`); the routed experts (`clamped_silu`) plus a shared
expert with the same clamped activation.

    layers.{i}: input_layernorm, post_attention_layernorm, attn_hc.{fn, base, scale}, ffn_hc.{...},
                self_attn.{q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks,
                [compressor.{kv_proj, gate_proj, position_bias, kv_norm,
                             [indexer.{kv_proj, gate_proj, position_bias, kv_norm, q_b_proj, weights_proj}]}]},
                mlp.{gate, e_score_correction_bias | tid2eid, experts, shared_expert.{gate_up_proj, down_proj}}
    hc_head.{hc_fn, hc_base, hc_scale}
CPU only for now: the GPU engine refuses the family (`runtime/gpu/engine_setup.unsupported_reason`).
"""

from __future__ import annotations

import torch

from ft.formats.config import ModelConfig
from ft.runtime.experts import clamped_silu
from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.batch import ForwardBatch
from ft.runtime.layers.compressed_attention import CompressedAttention, rotaries, spec_for
from ft.runtime.layers.hyper import HyperConnection, HyperHead
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.moe import BoundExperts, route_sqrtsoftplus
from ft.runtime.layers.norm import RMSNorm
from ft.runtime.layers.rope import Rotary
from ft.runtime.model import CausalLM
from ft.runtime.models.base import Family

FAMILY = Family(
    "deepseek_v4",
    rules={"attn_qkv_bias": False, "attn_qk_norm": False, "attn_output_gate": False, "attn_sinks": True,
           "router_scoring": "sqrtsoftplus", "router_correction_bias": True, "shared_expert_gate": False,
           "expert_act": "clamped_silu", "norm_topk_prob": True},
    free=("routed_scaling_factor",),
    positive=("shared_expert_intermediate_size", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult",
              "hc_sinkhorn_iters", "sliding_window"),
    layer_types=("compressed_attention",),
    mlp_types=("moe",),
    full_rotary=False,
    rope_types=("default", "yarn"),
)


class ClampedMLP(Op):
    """The shared expert: `[g; u] = gate_up_proj · x`, `down_proj · (silu(min(g, l)) ⊙ clamp(u, ±l))`."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = Linear()
        self.down_proj = Linear()
        self._limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(clamped_silu(g, u, self._limit))


class V4Moe(Op):
    banks = ("experts",)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = Linear()                                   # [E, H], never quantized
        self._hashed = layer in cfg.hash_moe_layers
        if self._hashed:
            self.tid2eid: torch.Tensor = REQUIRED              # int32 [V, k]
        else:
            self.e_score_correction_bias: torch.Tensor = REQUIRED  # fp32 [E]
        self.experts: BoundExperts = REQUIRED
        self.shared_expert = ClampedMLP(cfg.swiglu_limit)
        self._top_k, self._scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T] (the tokens, for the hash table) -> [T, H]."""
        logits = self.gate(x)
        if self._hashed:
            topk_ids, weights = route_sqrtsoftplus(logits, None, self._top_k, self._scale,
                                                   hashed=self.tid2eid[ids.to(self.tid2eid.device)])
        else:
            topk_ids, weights = route_sqrtsoftplus(logits, self.e_score_correction_bias, self._top_k, self._scale)
        return self.experts(x, topk_ids, weights) + self.shared_expert(x)


class V4DecoderLayer(Op):
    def __init__(self, cfg: ModelConfig, layer: int, rope: tuple[Rotary, Rotary]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.self_attn = CompressedAttention(spec_for(cfg, layer), rope[cfg.compress_kinds[layer] != "none"])
        self.mlp = V4Moe(cfg, layer)
        self._layer = layer

    def __call__(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """streams [N, n, H] -> [N, n, H]."""
        post, comb, x = self.attn_hc.weights(streams)
        a = self.input_layernorm(x)
        out = torch.empty_like(a)
        for seg in batch.segments:
            out[seg.rows] = self.self_attn(a[seg.rows], seg.past, seg.state.compressed[self._layer])
        streams = HyperConnection.expand(streams, out, post, comb)
        post, comb, x = self.ffn_hc.weights(streams)
        return HyperConnection.expand(streams, self.mlp(self.post_attention_layernorm(x), batch.input_ids), post,
                                      comb)


class DeepseekV4ForCausalLM(CausalLM):
    family = FAMILY

    def __init__(self, config: ModelConfig) -> None:
        rope = rotaries(config) if config.family == FAMILY.name else None
        self._v4_rope = rope
        super().__init__(config)
        self.hc_head = HyperHead(config.hc_mult, config.hc_eps, config.rms_norm_eps)
        self._rotary = None                    # each layer rotates with its own rope (main / compress)

    def decoder_layer(self, config: ModelConfig, i: int) -> V4DecoderLayer:
        return V4DecoderLayer(config, i, self._v4_rope)

    def layers_pending(self, h: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, None]:
        """h [N, H] embeddings -> (the collapsed streams [N, H], None): the final norm has no add left."""
        if batch.input_ids is None:
            raise ValueError("deepseek_v4 forwards need the token ids (hash routing)")
        streams = h.unsqueeze(1).expand(-1, self._config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, batch)
        return self.hc_head(streams), None
