"""The normalized model config stored in the FTW manifest (specs/families.md).

The runtime reads this instead of Hugging Face's config.json: one flat, frozen record whose keys are
all required. `from_dict` refuses unknown keys, unknown families and inconsistent geometry loudly.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "gpt_oss", "glm4_moe", "glm_moe_dsa",
            "deepseek_v4")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "mla_attention", "compressed_attention")
# layers with a softmax attention and a KV cache (mla_attention: the cache holds the compressed latent, see families.md)
ATTENTION_TYPES = ("full_attention", "sliding_attention", "mla_attention")
INDEXER_TYPES = ("full", "shared")  # DSA: run the layer's own indexer, or reuse the previous full layer's selection
# compressed_attention (deepseek_v4): the sliding window alone, + compressed sparse (CSA) or heavily compressed (HCA)
COMPRESS_KINDS = ("none", "csa", "hca")
EXPERT_ACTS = ("silu", "clamped_swiglu", "clamped_silu")
ROPE_TYPES = ("default", "yarn")
ROUTER_SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
MLP_TYPES = ("moe", "dense")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    attn_qkv_bias: bool
    attn_qk_norm: bool
    attn_output_gate: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Keys added with gpt_oss. They may be absent from a manifest (written before them): absent = the default here,
    # which is what every earlier family means.
    sliding_window: int = 0             # sliding_attention layers: a query sees itself and the window - 1 keys before
    attn_sinks: bool = False            # `self_attn.sinks [nq]`: one extra softmax logit per head, dropped after
    attn_o_bias: bool = False           # `self_attn.o_proj.bias` exists
    router_bias: bool = False           # `mlp.gate.bias` exists (added to the router logits before top-k)
    expert_bias: bool = False           # expert records carry `gate_up_bias` and `down_bias`
    expert_act: str = "silu"            # silu: silu(g)·u; clamped_swiglu: see families.md
    swiglu_alpha: float = 0.0           # clamped_swiglu only
    swiglu_limit: float = 0.0           # clamped_swiglu only
    rope_type: str = "default"          # default | yarn
    rope_factor: float = 1.0            # yarn only: the five rope_* keys below as in HF's rope_scaling
    rope_attention_factor: float = 1.0  # multiplies cos and sin (yarn: 0.1·ln(factor) + 1 unless given)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_original_max_position_embeddings: int = 0
    rope_truncate: bool = True
    # Keys added with glm4_moe (absent = default = the earlier families' softmax router and gated shared expert).
    router_scoring: str = "softmax"     # softmax: softmax → top-k; sigmoid: σ → group-limited top-k (families.md)
    router_correction_bias: bool = False  # `mlp.e_score_correction_bias [E]` fp32, added to σ for selection only
    router_n_group: int = 1             # sigmoid: experts split in n_group equal groups ...
    router_topk_group: int = 1          # ... of which the topk_group best (sum of each group's top-2) stay eligible
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (after any renormalisation)
    shared_expert_gate: bool = True     # the shared expert is scaled by σ(shared_expert_gate · x); false: added as is
    # Keys added with glm_moe_dsa (absent = 0 / empty: no MLA layer, no indexer). mla_attention layers: head_dim is
    # the query/key width qk_nope + qk_rope, rotary_dim the rope part (qk_rope), num_kv_heads == num_heads.
    q_lora_rank: int = 0                # MLA: rank of the query compression (q_a_proj -> q_a_layernorm -> q_b_proj)
    kv_lora_rank: int = 0               # MLA: width of the cached key/value latent
    v_head_dim: int = 0                 # MLA: value width per head
    index_n_heads: int = 0              # DSA indexer heads (0 = no indexer)
    index_head_dim: int = 0             # DSA indexer head width (its first rotary_dim dims rotated)
    index_topk: int = 0                 # DSA: keys each query attends (its top-k by indexer score, causal)
    indexer_types: tuple[str, ...] = ()  # per layer full | shared (empty without an indexer)
    # Keys added with deepseek_v4 (absent = 0 / empty: no compressed_attention layer, no hyper-connections).
    # compressed_attention layers: one shared K=V head (num_kv_heads 1) over `sliding_window`, rotary_dim rotated at
    # the end of each head; rope_theta is the sliding layers' base, the rope_* scaling keys apply to the compressed
    # layers' rope, of base compress_rope_theta. q_lora_rank and the index_* keys (CSA's indexer) are shared with MLA.
    compress_kinds: tuple[str, ...] = ()  # per layer none | csa | hca
    csa_compress_rate: int = 0          # source tokens per CSA entry
    hca_compress_rate: int = 0          # source tokens per HCA entry
    compress_rope_theta: float = 0.0
    o_groups: int = 0                   # grouped output projection: head groups ...
    o_lora_rank: int = 0                # ... each mapped to this many rows before o_b_proj
    hc_mult: int = 0                    # hyper-connections: residual streams (0: a plain residual)
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    hash_moe_layers: tuple[int, ...] = ()  # MoE layers whose experts the frozen table `mlp.tid2eid` [V, k] picks

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self):
        if self.family not in FAMILIES:
            yield f"unknown family {self.family!r}; supported: {', '.join(FAMILIES)}"
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                yield f"{name} must be positive, got {getattr(self, name)}"
        for f in fields(self):
            if f.type == "int" and getattr(self, f.name) < 0:
                yield f"{f.name} must be non-negative, got {getattr(self, f.name)}"
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)  # an int is finite (and may be too large for math.isfinite)
            if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
                yield f"{name} must be a positive finite number, got {v}"
        if any(i < 0 for i in self.eos_token_ids) or (self.bos_token_id is not None and self.bos_token_id < 0):
            yield "token ids must be non-negative"
        if "moe" in self.mlp_types and self.moe_intermediate_size <= 0:
            yield "moe layers need moe_intermediate_size > 0"
        if "dense" in self.mlp_types and self.intermediate_size <= 0:
            yield "dense layers need intermediate_size > 0"
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            yield f"layer_types must list {self.num_layers} entries from {LAYER_TYPES}"
        if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
            yield "sliding_attention layers need sliding_window > 0"
        if self.expert_act not in EXPERT_ACTS:
            yield f"expert_act {self.expert_act!r} not in {EXPERT_ACTS}"
        elif self.expert_act == "clamped_swiglu" and not (self.swiglu_alpha > 0 and self.swiglu_limit > 0):
            yield "clamped_swiglu needs swiglu_alpha > 0 and swiglu_limit > 0"
        elif self.expert_act == "clamped_silu" and not (self.swiglu_alpha == 0 and self.swiglu_limit > 0):
            yield "clamped_silu needs swiglu_limit > 0 and no swiglu_alpha"
        if self.rope_type not in ROPE_TYPES:
            yield f"rope_type {self.rope_type!r} not in {ROPE_TYPES}"
        elif self.rope_type == "yarn" and not (self.rope_factor >= 1 and self.rope_original_max_position_embeddings > 0
                                                and self.rope_attention_factor > 0 and self.rope_beta_fast > 0
                                                and self.rope_beta_slow > 0):
            yield ("yarn rope needs rope_factor >= 1, rope_original_max_position_embeddings > 0 and positive "
                   "rope_attention_factor, rope_beta_fast, rope_beta_slow")
        yield from self._router_problems()
        yield from self._mla_problems()
        yield from self._compressed_problems()
        if len(self.mlp_types) != self.num_layers or any(t not in MLP_TYPES for t in self.mlp_types):
            yield f"mlp_types must list {self.num_layers} entries from {MLP_TYPES}"
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            yield f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            yield f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}"
        if "moe" in self.mlp_types and not 0 < self.num_experts_per_tok <= self.num_experts:
            yield f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts {self.num_experts}"
        if "linear_attention" in self.layer_types:
            if min(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                   self.linear_value_head_dim, self.linear_conv_kernel_dim) <= 0:
                yield "linear_attention layers need positive linear_* geometry"
            elif self.linear_num_value_heads % self.linear_num_key_heads:
                yield "linear_num_value_heads must be a multiple of linear_num_key_heads"

    def _compressed_problems(self):
        keys = ("csa_compress_rate", "hca_compress_rate", "compress_rope_theta", "o_groups", "o_lora_rank", "hc_mult",
                "hc_sinkhorn_iters", "hc_eps")
        if "compressed_attention" not in self.layer_types:
            if self.compress_kinds or any(getattr(self, k) for k in keys) or self.hash_moe_layers:
                yield "compress_kinds, hash_moe_layers and the keys " + ", ".join(keys) + " belong to " \
                      "compressed_attention layers"
            return
        if any(not 0 <= i < len(self.mlp_types) or self.mlp_types[i] != "moe" for i in self.hash_moe_layers):
            yield "hash_moe_layers must name moe layers"
        if set(self.layer_types) != {"compressed_attention"}:
            yield "compressed_attention layers do not mix with other layer types"
        kinds = self.compress_kinds
        if len(kinds) != self.num_layers or any(k not in COMPRESS_KINDS for k in kinds):
            yield f"compress_kinds must list {self.num_layers} entries from {COMPRESS_KINDS}"
        for kind, rate in (("csa", self.csa_compress_rate), ("hca", self.hca_compress_rate)):
            if kind in kinds and rate <= 0:
                yield f"{kind} layers need {kind}_compress_rate > 0"
        for k in ("q_lora_rank", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters", "sliding_window"):
            if getattr(self, k) <= 0:
                yield f"compressed_attention layers need {k} > 0"
        if not (self.compress_rope_theta > 0 and self.hc_eps > 0):
            yield "compressed_attention layers need compress_rope_theta > 0 and hc_eps > 0"
        if self.num_kv_heads != 1:
            yield "compressed_attention layers share one key/value head (num_kv_heads 1)"
        if self.o_groups > 0 and (self.num_heads * self.head_dim) % self.o_groups:
            yield f"num_heads·head_dim must split into o_groups {self.o_groups}"
        indexed = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if "csa" in kinds and (min(indexed) <= 0 or self.index_head_dim < self.rotary_dim):
            yield "csa layers need positive index_n_heads, index_topk and index_head_dim >= rotary_dim"
        if "csa" not in kinds and indexed != (0, 0, 0):
            yield "the index_* keys belong to csa layers"

    def _mla_problems(self):
        mla = "mla_attention" in self.layer_types
        if "compressed_attention" in self.layer_types:
            return
        if not mla:
            if (self.q_lora_rank, self.kv_lora_rank, self.v_head_dim, self.index_n_heads, self.index_head_dim,
                    self.index_topk, self.indexer_types) != (0, 0, 0, 0, 0, 0, ()):
                yield "q_lora_rank, kv_lora_rank, v_head_dim and the index_* keys belong to mla_attention layers"
            return
        if min(self.q_lora_rank, self.kv_lora_rank, self.v_head_dim) <= 0:
            yield "mla_attention layers need positive q_lora_rank, kv_lora_rank and v_head_dim"
        if self.num_kv_heads != self.num_heads:
            yield "mla_attention layers need num_kv_heads == num_heads"
        if not 0 < self.rotary_dim < self.head_dim:
            yield "mla_attention layers need 0 < rotary_dim (qk_rope) < head_dim (qk_nope + qk_rope)"
        indexed = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if indexed == (0, 0, 0) and not self.indexer_types:
            return
        if min(indexed) <= 0:
            yield "the DSA indexer needs positive index_n_heads, index_head_dim and index_topk"
        elif self.index_head_dim < self.rotary_dim:
            yield f"index_head_dim {self.index_head_dim} must hold the rotary_dim {self.rotary_dim} rotated dims"
        kinds = self.indexer_types
        if len(kinds) != self.num_layers or any(t not in INDEXER_TYPES for t in kinds):
            yield f"indexer_types must list {self.num_layers} entries from {INDEXER_TYPES}"
        elif kinds[0] != "full":
            yield "indexer_types[0] must be full (a shared layer reuses the previous full layer's selection)"

    def _router_problems(self):
        if self.router_scoring not in ROUTER_SCORINGS:
            yield f"router_scoring {self.router_scoring!r} not in {ROUTER_SCORINGS}"
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            yield f"routed_scaling_factor must be a positive finite number, got {self.routed_scaling_factor}"
        g, tg = self.router_n_group, self.router_topk_group
        if g < 1 or not 1 <= tg <= g:
            yield f"router groups need 1 <= router_topk_group ({tg}) <= router_n_group ({g})"
        elif self.router_scoring == "softmax" and (g, tg, self.router_correction_bias) != (1, 1, False):
            yield "router groups and the correction bias belong to the sigmoid router"
        elif "moe" in self.mlp_types and g > 1:
            per = self.num_experts // g
            if self.num_experts % g or per < 2:
                yield f"num_experts {self.num_experts} must split into router_n_group {g} groups of >= 2 experts"
            elif self.num_experts_per_tok > tg * per:
                yield (f"num_experts_per_tok {self.num_experts_per_tok} exceeds the {tg} eligible groups' "
                       f"{tg * per} experts")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ValueError("config must be a JSON object")
        known = {f.name for f in fields(cls)}
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        unknown = sorted(set(d) - known)
        missing = sorted(known - optional - set(d))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}")
        if missing:
            raise ValueError(f"missing config keys {missing}")
        kw = {f.name: f.default for f in fields(cls) if f.name in optional} | d
        for name in _TUPLE_KEYS:
            if not isinstance(kw[name], (list, tuple)):
                raise ValueError(f"config key {name} must be a list")
            kw[name] = tuple(kw[name])
        for f in fields(cls):
            _check_type(f.name, f.type, kw[f.name])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; an optional key (one added after FTW 1.0) is written only when it differs from its default,
        so a model that uses none of them has the same manifest config as before they existed."""
        d = asdict(self)
        for f in fields(self):
            if f.default is not MISSING and d[f.name] == f.default:
                del d[f.name]
        for name in _TUPLE_KEYS:
            if name in d:
                d[name] = list(d[name])
        return d

    # Derived facts, used by the runtime and by `ft inspect`.
    @property
    def num_moe_layers(self) -> int:
        return self.mlp_types.count("moe")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def is_attention(self, layer: int) -> bool:
        """Layer `layer` is a softmax-attention layer with a KV cache (full or sliding window)."""
        return self.layer_types[layer] in ATTENTION_TYPES


_TUPLE_KEYS = ("layer_types", "mlp_types", "eos_token_ids", "indexer_types", "compress_kinds", "hash_moe_layers")


def _check_type(name: str, annotation: str, value: Any) -> None:
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "int | None": value is None or (isinstance(value, int) and not isinstance(value, bool)),
    }.get(annotation)
    if annotation.startswith("tuple"):
        inner = "int" if "int" in annotation else "str"
        ok = all(_check_type_scalar(inner, v) for v in value)
    if not ok:
        raise ValueError(f"config key {name} has the wrong type: {value!r} (expected {annotation})")


def _check_type_scalar(kind: str, v: Any) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, str)
