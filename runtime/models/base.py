"""The decoder layer every first-wave family is built from, and the family rules checked at load.

Layer i (pre-norm residual):
    h = x + mixer(input_layernorm(x))            mixer = self_attn (full_ / sliding_ / mla_attention) | linear_attn
    y = h + mlp(post_attention_layernorm(h))     mlp = SparseMoe (moe) | GatedMLP (dense)
A layer call leaves the final add pending: it takes the previous layer's pair (x, delta) and returns (h, mlp_out), whose
sum is y, so each residual add runs inside the norm that follows it (`RMSNorm.add`: one fused launch per layer
boundary with `_fused`, the same rounded sum either way). The model's final norm takes the last pair.
A family is this layer plus the facts its config must satisfy (`Family.rules`); a config that breaks them is refused
by name, because it would describe a model this code was never checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ft.formats.config import ModelConfig
from ft.runtime.layers.attention import Attention
from ft.runtime.layers.base import Op
from ft.runtime.layers.batch import ForwardBatch
from ft.runtime.layers.deltanet import GatedDeltaNet
from ft.runtime.layers.mla import MlaAttention
from ft.runtime.layers.mlp import GatedMLP
from ft.runtime.layers.moe import SparseMoe
from ft.runtime.layers.norm import RMSNorm


class DecoderLayer(Op):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps)
        if cfg.layer_types[layer] == "mla_attention":
            self.self_attn: Attention | MlaAttention = MlaAttention(cfg, layer)
        elif cfg.is_attention(layer):
            self.self_attn = Attention(cfg, layer)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps)
        self.mlp: SparseMoe | GatedMLP = SparseMoe(cfg) if cfg.mlp_types[layer] == "moe" else GatedMLP()

    @property
    def mixer(self) -> Attention | MlaAttention | GatedDeltaNet:
        return self.self_attn if hasattr(self, "self_attn") else self.linear_attn

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None,
                 batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Input x + delta (delta None: x alone), all [N, H] -> (h, mlp_out), whose sum is the layer's output."""
        x, a = self.input_layernorm.add(x, delta)                         # x = x + delta, a = norm(x)
        h, b = self.post_attention_layernorm.add(x, self.mixer(a, batch))  # h = x + mixer(a), b = norm(h)
        return h, self.mlp(b)


@dataclass(frozen=True)
class Family:
    """What a family's normalized config must say: `rules` maps a config key to its required value, `positive` lists
    keys that must be > 0; `layer_types` / `mlp_types` list the kinds the family may use."""

    name: str
    rules: dict[str, Any] = field(default_factory=dict)
    positive: tuple[str, ...] = ()
    layer_types: tuple[str, ...] = ("full_attention",)
    mlp_types: tuple[str, ...] = ("moe", "dense")
    full_rotary: bool = True            # rotary_dim == head_dim
    needs_linear_attention: bool = False
    rope_types: tuple[str, ...] = ("default",)
    free: tuple[str, ...] = ()          # feature keys (below) whose value the config chooses (ModelConfig checks them)

    def check(self, cfg: ModelConfig) -> None:
        # a family that does not name these keys has none of their features; `free` keys take any valid value
        rules = {k: v for k, v in (_FEATURE_DEFAULTS | self.rules).items() if k not in self.free}
        problems = [f"{key} is {getattr(cfg, key)!r}, {self.name} requires {want!r}"
                    for key, want in rules.items() if getattr(cfg, key) != want]
        if cfg.rope_type not in self.rope_types:
            problems.append(f"rope_type is {cfg.rope_type!r}; {self.name} allows {list(self.rope_types)}")
        problems += [f"{key} must be > 0 for {self.name}" for key in self.positive if getattr(cfg, key) <= 0]
        for key, allowed in (("layer_types", self.layer_types), ("mlp_types", self.mlp_types)):
            bad = sorted(set(getattr(cfg, key)) - set(allowed))
            if bad:
                problems.append(f"{key} has {bad}; {self.name} allows {list(allowed)}")
        if self.needs_linear_attention and "linear_attention" not in cfg.layer_types:
            problems.append(f"{self.name} expects linear_attention layers, the config lists none")
        if self.full_rotary and cfg.rotary_dim != cfg.head_dim:
            problems.append(f"rotary_dim {cfg.rotary_dim} != head_dim {cfg.head_dim} ({self.name} rotates whole heads)")
        if "full_attention" in cfg.layer_types and cfg.rotary_dim <= 0:
            problems.append("full_attention layers need rotary_dim > 0")
        if "moe" in cfg.mlp_types and cfg.moe_intermediate_size <= 0:
            problems.append("moe layers need moe_intermediate_size > 0")
        if "dense" in cfg.mlp_types and cfg.intermediate_size <= 0:
            problems.append("dense layers need intermediate_size > 0")
        if problems:
            raise ValueError(f"config of family {cfg.family!r} is not supported: " + "; ".join(problems))


_FEATURE_DEFAULTS = {"attn_o_bias": False, "attn_sinks": False, "router_bias": False, "expert_bias": False,
                     "expert_act": "silu", "router_scoring": "softmax", "router_correction_bias": False,
                     "router_n_group": 1, "router_topk_group": 1, "routed_scaling_factor": 1.0,
                     "shared_expert_gate": True}


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of layer `layer`'s weights after dequantization (names relative to `layers.{layer}.`)."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if cfg.layer_types[layer] == "mla_attention":
        shapes |= _mla_shapes(cfg, layer)
    elif cfg.layer_types[layer] == "compressed_attention":
        shapes |= _compressed_shapes(cfg, layer)
    elif cfg.is_attention(layer):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        rows = q + 2 * kv + (q if cfg.attn_output_gate else 0)
        shapes |= {"self_attn.qkv_proj.weight": (rows, h), "self_attn.o_proj.weight": (h, q)}
        if cfg.attn_qkv_bias:
            shapes["self_attn.qkv_proj.bias"] = (rows,)
        if cfg.attn_o_bias:
            shapes["self_attn.o_proj.bias"] = (h,)
        if cfg.attn_sinks:
            shapes["self_attn.sinks"] = (cfg.num_heads,)
        if cfg.attn_qk_norm:
            shapes |= {"self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,)}
    else:
        kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        hv = cfg.linear_num_value_heads
        shapes |= {
            "linear_attn.in_proj_qkvz.weight": (2 * kd + 2 * vd, h), "linear_attn.in_proj_ba.weight": (2 * hv, h),
            "linear_attn.conv1d.weight": (2 * kd + vd, cfg.linear_conv_kernel_dim),
            "linear_attn.dt_bias": (hv,), "linear_attn.A_log": (hv,),
            "linear_attn.norm.weight": (cfg.linear_value_head_dim,), "linear_attn.out_proj.weight": (h, vd)}
    if cfg.mlp_types[layer] == "moe":
        shapes["mlp.gate.weight"] = (cfg.num_experts, h)
        if cfg.router_bias:
            shapes["mlp.gate.bias"] = (cfg.num_experts,)
        if layer in cfg.hash_moe_layers:
            shapes["mlp.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
        elif cfg.router_correction_bias:
            shapes["mlp.e_score_correction_bias"] = (cfg.num_experts,)
        if cfg.shared_expert_intermediate_size > 0:
            si = cfg.shared_expert_intermediate_size
            shapes |= {"mlp.shared_expert.gate_up_proj.weight": (2 * si, h),
                       "mlp.shared_expert.down_proj.weight": (h, si)}
            if cfg.shared_expert_gate:
                shapes["mlp.shared_expert_gate.weight"] = (1, h)
    else:
        shapes |= {"mlp.gate_up_proj.weight": (2 * cfg.intermediate_size, h),
                   "mlp.down_proj.weight": (h, cfg.intermediate_size)}
    return shapes


def _mla_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    h, nq, hd, r, v = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rotary_dim, cfg.v_head_dim
    ql, c = cfg.q_lora_rank, cfg.kv_lora_rank
    shapes = {"self_attn.qkv_a_proj.weight": (ql + c + r, h), "self_attn.q_a_layernorm.weight": (ql,),
              "self_attn.q_b_proj.weight": (nq * hd, ql), "self_attn.kv_a_layernorm.weight": (c,),
              "self_attn.kv_b_proj.weight": (nq * (hd - r + v), c), "self_attn.o_proj.weight": (h, nq * v)}
    if cfg.indexer_types and cfg.indexer_types[layer] == "full":
        n, d = cfg.index_n_heads, cfg.index_head_dim
        shapes |= {"self_attn.indexer.wq_b.weight": (n * d, ql), "self_attn.indexer.wk.weight": (d, h),
                   "self_attn.indexer.k_norm.weight": (d,), "self_attn.indexer.k_norm.bias": (d,),
                   "self_attn.indexer.weights_proj.weight": (n, h)}
    return shapes


def _compressed_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """deepseek_v4: the layer's hyper-connections and compressed attention (ft.runtime.layers.compressed_attention)."""
    h, nq, hd, n = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult
    w = (2 + n) * n
    shapes = {f"{hc}_hc.{k}": s for hc in ("attn", "ffn") for k, s in (("fn", (w, n * h)), ("base", (w,)),
                                                                        ("scale", (3,)))}
    a, ql, g, ol = "self_attn.", cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    shapes |= {f"{a}q_a_proj.weight": (ql, h), f"{a}q_a_norm.weight": (ql,), f"{a}q_b_proj.weight": (nq * hd, ql),
               f"{a}kv_proj.weight": (hd, h), f"{a}kv_norm.weight": (hd,),
               f"{a}o_a_proj.weight": (g * ol, nq * hd // g), f"{a}o_b_proj.weight": (h, g * ol), f"{a}sinks": (nq,)}
    kind = cfg.compress_kinds[layer]
    if kind == "none":
        return shapes
    m, series = (cfg.csa_compress_rate, 2) if kind == "csa" else (cfg.hca_compress_rate, 1)
    pooled = [(f"{a}compressor.", hd)] + ([(f"{a}compressor.indexer.", cfg.index_head_dim)] if kind == "csa" else [])
    for p, d in pooled:
        shapes |= {f"{p}kv_proj.weight": (series * d, h), f"{p}gate_proj.weight": (series * d, h),
                   f"{p}position_bias": (m, series * d), f"{p}kv_norm.weight": (d,)}
    if kind == "csa":
        p, d, ni = f"{a}compressor.indexer.", cfg.index_head_dim, cfg.index_n_heads
        shapes |= {f"{p}q_b_proj.weight": (ni * d, ql), f"{p}weights_proj.weight": (ni, h)}
    return shapes
