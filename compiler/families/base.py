"""What every family shares: reading HF config keys, the normalized-config skeleton, and the plan blocks
(embeddings, GQA attention, MoE block, dense MLP) that families compose.

A family module subclasses `Family`, says which architectures it serves, maps its config (`normalize`) and lists its
tensors (`plan`). Adding deepseek_v3 means: new ModelConfig keys and families.md names for what it adds (MLA
exists since glm_moe_dsa: without an indexer, `index_topk` 0; gpt_oss added sinks, biases, sliding windows and
YaRN, glm4_moe the sigmoid group-limited router with its correction bias as a `TensorItem`), a new `ExpertSource`
(ft.compiler.experts) for FP8 block scales with its bank scheme (GLM's FP8 releases need the same), an encoding in
`linear.sniff` for FP8 block-scaled linears, and one module built from these blocks (`first_k_dense_replace` gives
`mlp_types`, as in glm4_moe); the executor, source reading, quant declaration, metadata and verification stay as they
are.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ft.compiler.errors import CheckpointError, supported
from ft.compiler.experts import ExpertSource, PerExpert
from ft.compiler.plan import BankItem, Item, LinearItem, TensorItem
from ft.compiler.source import Checkpoint
from ft.formats import ModelConfig

_REQUIRED = object()


class HFConfig:
    """A config.json object (or its `text_config`) with key lookups that fail naming the key."""

    def __init__(self, d: dict, where: str = "config.json") -> None:
        self.d, self.where = d, where

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self.d.get(key)
        if v is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.where}: required key {key!r} is missing")
            return default
        return v

    def first(self, *keys: str, default: Any = _REQUIRED) -> Any:
        """The first of several spellings that is present (e.g. num_experts / num_local_experts)."""
        for k in keys:
            if self.d.get(k) is not None:
                return self.d[k]
        if default is _REQUIRED:
            raise CheckpointError(f"{self.where}: none of the keys {list(keys)} is present")
        return default

    def int(self, key: str, default: Any = _REQUIRED) -> int:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise CheckpointError(f"{self.where}: {key!r} must be an integer, got {v!r}")
        return v

    def refuse(self, key: str, why: str, ok=lambda v: not v) -> None:
        """Refuse a variant this compiler does not implement (e.g. sliding window in use)."""
        v = self.d.get(key)
        if not ok(v):
            raise CheckpointError(f"{self.where}: {key}={v!r} is not supported ({why})")


def rope(c: HFConfig, *, default_theta: float, default_partial: float = 1.0,
         allow_mrope: bool = False, allow_yarn: bool = False) -> tuple[float, float, dict[str, Any]]:
    """(rope_theta, partial_rotary_factor, scaling fields) from `rope_parameters` or legacy `rope_theta` +
    `rope_scaling`. Plain RoPE everywhere; YaRN where the family allows it (gpt_oss), returned as the ModelConfig
    `rope_*` fields; other scaled variants (linear, dynamic, longrope, llama3) are refused. mrope on text-only input
    is plain RoPE (three identical position streams)."""
    params = c.d.get("rope_scaling") or c.d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{c.where}: rope_parameters must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{c.where}: per-layer-type rope_parameters are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    kinds = ("default",) + (("mrope",) if allow_mrope else ()) + (("yarn",) if allow_yarn else ())
    if kind not in kinds:
        raise CheckpointError(f"{c.where}: rope type {kind!r} is not supported; supported: {supported(kinds)}")
    if "mrope_section" in params and not allow_mrope:
        raise CheckpointError(f"{c.where}: mrope_section is not supported for this architecture")
    theta = params.get("rope_theta", c.d.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", c.d.get("partial_rotary_factor", default_partial))
    return float(theta), float(partial), yarn_fields(c, params) if kind == "yarn" else {}


def yarn_fields(c: HFConfig, p: dict) -> dict[str, Any]:
    """YaRN `rope_scaling` -> the ModelConfig rope_* fields, with transformers' defaults (`_compute_yarn_parameters`):
    factor from max_position_embeddings / original when absent, attention_factor 0.1·ln(factor) + 1 (or the
    mscale / mscale_all_dim ratio) when absent, beta_fast 32, beta_slow 1, truncate true."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    orig = p.get("original_max_position_embeddings")
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise CheckpointError(f"{c.where}: yarn rope needs a positive integer original_max_position_embeddings, "
                              f"got {orig!r}")
    factor = p.get("factor") or c.int("max_position_embeddings") / orig
    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"{c.where}: rope truncate must be true or false, got {truncate!r}")
    return dict(rope_type="yarn", rope_factor=float(factor), rope_attention_factor=float(attention),
                rope_beta_fast=float(p.get("beta_fast") or 32), rope_beta_slow=float(p.get("beta_slow") or 1),
                rope_original_max_position_embeddings=orig, rope_truncate=truncate)


def eos_ids(*sources: dict | None) -> tuple[int, ...]:
    """Stop tokens: every `eos_token_id` (int or list) of the given configs, in order, deduplicated."""
    out: list[int] = []
    for src in sources:
        v = (src or {}).get("eos_token_id")
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and not isinstance(i, bool) and i not in out:
                out.append(i)
    return tuple(out)


def bos_id(c: HFConfig, gen: dict | None) -> int | None:
    for v in (c.d.get("bos_token_id"), (gen or {}).get("bos_token_id")):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def sparse_mlp_types(c: HFConfig, num_layers: int, num_experts: int) -> tuple[str, ...]:
    """qwen2_moe / qwen3_moe / qwen3_next: layer i is MoE iff i ∉ mlp_only_layers and
    (i+1) % decoder_sparse_step == 0."""
    only = c.get("mlp_only_layers", [])
    step = c.int("decoder_sparse_step", 1)
    if step < 1:
        raise CheckpointError(f"{c.where}: decoder_sparse_step must be >= 1, got {step}")
    return tuple("moe" if i not in only and num_experts > 0 and (i + 1) % step == 0 else "dense"
                 for i in range(num_layers))


def hybrid_layer_types(c: HFConfig, num_layers: int) -> tuple[str, ...]:
    """qwen3_next / qwen3_5_moe: explicit layer_types, else every `full_attention_interval`-th layer is full."""
    lt = c.d.get("layer_types")
    if lt is None:
        k = c.int("full_attention_interval", 4)
        lt = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(num_layers)]
    if len(lt) != num_layers or any(t not in ("full_attention", "linear_attention") for t in lt):
        raise CheckpointError(f"{c.where}: layer_types must list {num_layers} entries of full_attention / "
                              f"linear_attention, got {lt!r}")
    return tuple(lt)


def check_act(c: HFConfig) -> None:
    act = c.d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{c.where}: hidden_act {act!r} is not supported; supported: silu")


def common_fields(c: HFConfig, gen: dict | None, *, family: str, default_theta: float, default_partial: float = 1.0,
                  allow_mrope: bool = False, allow_yarn: bool = False, sliding: bool = False) -> dict[str, Any]:
    """ModelConfig fields every family reads the same way (a family fills in the rest). `sliding`: the family
    implements sliding_attention layers (else layer_types naming them are refused)."""
    check_act(c)
    kinds = ("full_attention", "linear_attention") + (("sliding_attention",) if sliding else ())
    c.refuse("layer_types", f"implemented layer types: {', '.join(kinds)}",
             ok=lambda v: v is None or all(t in kinds for t in v))
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    head_dim = c.int("head_dim", hidden // heads)
    theta, partial, scaling = rope(c, default_theta=default_theta, default_partial=default_partial,
                                   allow_mrope=allow_mrope, allow_yarn=allow_yarn)
    return scaling | dict(
        family=family, vocab_size=c.int("vocab_size"), hidden_size=hidden, num_layers=c.int("num_hidden_layers"),
        num_heads=heads, num_kv_heads=c.int("num_key_value_heads", heads), head_dim=head_dim,
        rms_norm_eps=float(c.get("rms_norm_eps")), rope_theta=theta, rotary_dim=int(head_dim * partial),
        max_position_embeddings=c.int("max_position_embeddings"), bos_token_id=bos_id(c, gen),
        eos_token_ids=eos_ids(c.d, gen), linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0,
        linear_value_head_dim=0, linear_conv_kernel_dim=0,
    )


def make_config(fields: dict[str, Any], where: str) -> ModelConfig:
    if "dense" in fields["mlp_types"] and fields["intermediate_size"] <= 0:
        raise CheckpointError(f"{where}: dense MLP layers need a positive 'intermediate_size'")
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: inconsistent config: {e}") from None


class Family(ABC):
    """One HF architecture family. Subclasses set the class attributes and implement `normalize`; `plan` is the
    decoder loop (norms, attention or linear attention, MLP per layer) which families adjust block by block."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    model_types: ClassVar[tuple[str, ...]]
    prefix: str = "model."  # HF prefix of the decoder's tensors
    skip_prefixes: ClassVar[tuple[str, ...]] = ()  # tensors deliberately not compiled (recorded as skipped)
    zero_centred_norms: ClassVar[bool] = False

    def text_config(self, hf: dict) -> HFConfig:
        return HFConfig(hf)

    def bind(self, ck: Checkpoint) -> None:
        """Adapt to the checkpoint's naming before planning (e.g. a nested decoder prefix)."""

    def resolve_tie(self, cfg: ModelConfig, ck: Checkpoint, read) -> tuple[ModelConfig, tuple[str, ...]]:
        """transformers' rule: a tied config whose checkpoint still has an `lm_head.weight` equal to the embedding is
        tied (the copy is skipped); a different one is NOT tied (the model uses it). Returns (config, skip prefixes)."""
        if not cfg.tie_word_embeddings or not ck.has("lm_head.weight"):
            return cfg, ()
        embed, head = f"{self.prefix}embed_tokens.weight", "lm_head.weight"
        a, b = ck.info(embed), ck.info(head)
        if (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(read(embed, a), read(head, b)):
            return cfg, ("lm_head.",)
        return dataclasses.replace(cfg, tie_word_embeddings=False), ()

    @abstractmethod
    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        """HF config.json (+ generation_config.json) -> the normalized config; refuses unsupported variants."""

    def plan(self, cfg: ModelConfig, ck: Checkpoint) -> list[Item]:
        pre, post = self.top(cfg)
        items = list(pre)
        for i in range(cfg.num_layers):
            items += self.layer_norms(cfg, i)
            items += self.attention(cfg, i) if cfg.is_attention(i) else self.linear_attention(cfg, i)
            items += self.mlp(cfg, i, self.experts(cfg, i, ck))
        return items + post

    def linear_attention(self, cfg: ModelConfig, i: int) -> list[Item]:
        raise CheckpointError(f"layer {i}: family {self.name} has no linear-attention layers")

    def experts(self, cfg: ModelConfig, i: int, ck: Checkpoint) -> ExpertSource:
        """Where layer i's experts come from (per-expert 2-D tensors unless a family says otherwise)."""
        p = f"{self.prefix}layers.{i}.mlp.experts.{{e}}."
        return PerExpert(p + "gate_proj", p + "up_proj", p + "down_proj")

    # -- plan blocks ------------------------------------------------------------------------------
    @property
    def norm_kind(self) -> str:
        return "norm_1p" if self.zero_centred_norms else "norm"

    def top(self, cfg: ModelConfig) -> tuple[list[Item], list[Item]]:
        """(items before the layers, items after): embeddings; final norm and lm_head (absent when tied)."""
        p, V, H = self.prefix, cfg.vocab_size, cfg.hidden_size
        head: list[Item] = [TensorItem("norm.weight", f"{p}norm.weight", (H,), self.norm_kind)]
        if not cfg.tie_word_embeddings:
            head.append(LinearItem("lm_head", (("lm_head", V),), H))
        return [TensorItem("embed_tokens.weight", f"{p}embed_tokens.weight", (V, H), "keep")], head

    def layer_norms(self, cfg: ModelConfig, i: int) -> list[Item]:
        p, H = f"{self.prefix}layers.{i}.", cfg.hidden_size
        return [TensorItem(f"layers.{i}.{n}.weight", f"{p}{n}.weight", (H,), self.norm_kind)
                for n in ("input_layernorm", "post_attention_layernorm")]

    def attention(self, cfg: ModelConfig, i: int) -> list[Item]:
        """GQA: q|k|v fused (gated attention's per-head [q_h | gate_h] rows de-interleaved, gate appended)."""
        p, o = f"{self.prefix}layers.{i}.self_attn.", f"layers.{i}.self_attn."
        nq, nkv, hd, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        g = 2 if cfg.attn_output_gate else 1
        perm = None
        if cfg.attn_output_gate:
            per_head = torch.arange(nq * 2 * hd).view(nq, 2, hd)  # q_proj rows: per head [q (hd) | gate (hd)]
            kv = torch.arange(nq * 2 * hd, (nq * 2 + 2 * nkv) * hd)
            perm = torch.cat([per_head[:, 0].reshape(-1), kv, per_head[:, 1].reshape(-1)])
        items: list[Item] = [
            LinearItem(f"{o}qkv_proj",
                       ((f"{p}q_proj", nq * g * hd), (f"{p}k_proj", nkv * hd), (f"{p}v_proj", nkv * hd)),
                       H, perm=perm, bias=cfg.attn_qkv_bias),
            LinearItem(f"{o}o_proj", ((f"{p}o_proj", H),), nq * hd, bias=cfg.attn_o_bias),
        ]
        if cfg.attn_qk_norm:
            items += [TensorItem(f"{o}{n}.weight", f"{p}{n}.weight", (hd,), self.norm_kind)
                      for n in ("q_norm", "k_norm")]
        return items

    def moe(self, cfg: ModelConfig, i: int, experts: ExpertSource, *, block: str = "mlp",
            router: str = "gate") -> list[Item]:
        """Router, expert bank and (if the family has one) the sigmoid-gated shared expert."""
        p, o, H = f"{self.prefix}layers.{i}.{block}.", f"layers.{i}.mlp.", cfg.hidden_size
        items: list[Item] = [
            LinearItem(f"{o}gate", ((f"{p}{router}", cfg.num_experts),), H, router=True, bias=cfg.router_bias),
            BankItem(f"{o}experts", cfg.num_experts, cfg.moe_intermediate_size, H, experts),
        ]
        if cfg.has_shared_expert:
            Is = cfg.shared_expert_intermediate_size
            items += self.gated_mlp(f"{p}shared_expert.", f"{o}shared_expert.", Is, H)
            items.append(LinearItem(f"{o}shared_expert_gate", ((f"{p}shared_expert_gate", 1),), H))
        return items

    @staticmethod
    def gated_mlp(p: str, o: str, inter: int, hidden: int) -> list[Item]:
        """SwiGLU MLP: gate_proj|up_proj fused into gate_up_proj, down_proj as is."""
        return [LinearItem(f"{o}gate_up_proj", ((f"{p}gate_proj", inter), (f"{p}up_proj", inter)), hidden),
                LinearItem(f"{o}down_proj", ((f"{p}down_proj", hidden),), inter)]

    def mlp(self, cfg: ModelConfig, i: int, experts: ExpertSource) -> list[Item]:
        if cfg.mlp_types[i] == "dense":
            return self.gated_mlp(f"{self.prefix}layers.{i}.mlp.", f"layers.{i}.mlp.", cfg.intermediate_size,
                                  cfg.hidden_size)
        return self.moe(cfg, i, experts)
