"""deepseek_v4 (DeepSeek-V4-Flash, DeepSeek-V4-Pro): compressed sliding attention, hyper-connections, hash-routed and
sqrtsoftplus-routed MoE with a clamped shared expert (the runtime's `ft.runtime.layers.compressed_attention`,
`hyper`, `ft.runtime.models.deepseek_v4`).

The checkpoints use DeepSeek's own names (transformers converts them on load and back on save): the release's
`embed.weight`, `layers.{i}.*`, `hc_head_{fn,base,scale}`, `norm.weight`, `head.weight`, or as transformers'
save_pretrained writes them, `model.embed_tokens.weight`, `model.layers.{i}.*`, `model.hc_head.hc_{fn,base,scale}`,
`model.norm.weight`, `head.weight` (`bind` picks by the embedding's name); below, the layer names:
    model.layers.{i}.attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink}
      -> layers.{i}.self_attn.{q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks}
    attn.compressor.{wkv, wgate, ape, norm} -> self_attn.compressor.{kv_proj, gate_proj, position_bias, kv_norm}
    attn.indexer.compressor.* -> self_attn.compressor.indexer.* (same four), attn.indexer.{wq_b, weights_proj}
      -> self_attn.compressor.indexer.{q_b_proj, weights_proj}
    attn_norm, ffn_norm -> input_layernorm, post_attention_layernorm
    hc_{attn,ffn}_{fn,base,scale} -> {attn,ffn}_hc.{fn,base,scale};  model.hc_head.* -> hc_head.*;  head -> lm_head
    ffn.gate.{weight, bias, tid2eid} -> mlp.{gate, e_score_correction_bias, tid2eid (int32)}
    ffn.experts.{e}.{w1, w3, w2} -> the bank (gate, up, down);  ffn.shared_experts.{w1|w3, w2}
      -> mlp.shared_expert.{gate_up_proj, down_proj}
The release (`quantization_config` quant_method "fp8", scale_fmt "ue8m0", `expert_dtype` "fp4") is read by the
generic encodings: each FP8 linear's `scale` (E8M0 128x128 tiles) next to its `weight` (`ft.compiler.linear`), and
the routed experts' FP4 weights kept as an MXFP4 bank without biases (`ft.compiler.experts.PerExpert`).
Every layer is `compressed_attention` (`compress_kinds`: none / csa / hca from transformers' `layer_types`) and MoE
(`hash_moe_layers` from `mlp_layer_types`). The multi-token-prediction head (`mtp.*`) is skipped.
"""

from __future__ import annotations

from ft.compiler.errors import CheckpointError, supported
from ft.compiler.experts import ExpertSource, PerExpert
from ft.compiler.families.base import Family, HFConfig, make_config, rope
from ft.compiler.families.base import common_fields as _common
from ft.compiler.plan import BankItem, Item, LinearItem, TensorItem
from ft.compiler.source import Checkpoint
from ft.formats import ModelConfig

_KINDS = {"sliding_attention": "none", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_LEGACY_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_MLP = ("hash_moe", "moe")


class DeepseekV4(Family):
    name = "deepseek_v4"
    architectures = ("DeepseekV4ForCausalLM",)
    model_types = ("deepseek_v4",)
    skip_prefixes = ("mtp.",)
    _release = False  # the release's names (`bind`)

    def bind(self, ck: Checkpoint) -> None:
        if ck.has("embed.weight"):
            self.prefix, self._release = "", True

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        c.refuse("scoring_func", "deepseek_v4 routers score experts with sqrt(softplus)",
                 ok=lambda v: v in (None, "sqrtsoftplus"))
        c.refuse("attention_bias", "DeepSeek-V4's projections have no biases")
        c.refuse("mlp_bias", "DeepSeek-V4's MLPs have no biases")
        c.refuse("norm_topk_prob", "DeepSeek-V4 always renormalizes the routed weights", ok=lambda v: v in (None, True))
        kv = c.int("num_key_value_heads", 1)
        if kv != 1:
            raise CheckpointError(f"{c.where}: num_key_value_heads {kv} is not supported (one shared K=V head)")
        L = c.int("num_hidden_layers")
        kinds = _layer_kinds(c, L)
        mlp = c.d.get("mlp_layer_types")
        if mlp is None:
            n_hash = c.int("num_hash_layers", 3)
            mlp = ["hash_moe"] * min(L, n_hash) + ["moe"] * max(0, L - n_hash)
        if not isinstance(mlp, list) or len(mlp) != L or any(k not in _MLP for k in mlp):
            raise CheckpointError(f"{c.where}: mlp_layer_types must list {L} entries of {supported(_MLP)}, got {mlp!r}")
        rates = dict(_default_rates(c))
        head_dim = c.int("head_dim")
        partial = _partial(c, head_dim)
        main_theta = float(c.get("rope_theta", 10_000.0))
        compress_theta, scaling = _compress_rope(c, partial)
        plain = HFConfig({k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters", "rope_scaling",
                                                                  "partial_rotary_factor", "head_dim")})
        f = _common(plain, gen, family=self.name, default_theta=main_theta)
        shared = c.int("n_shared_experts", 1)
        if shared != 1:
            raise CheckpointError(f"{c.where}: n_shared_experts={shared} is not supported (one shared expert)")
        limit = float(c.get("swiglu_limit", 10.0))
        csa = "csa" in kinds
        inter = c.int("moe_intermediate_size")
        f.update(scaling)
        f.update(
            num_kv_heads=1, head_dim=head_dim, rotary_dim=int(head_dim * partial), rope_theta=main_theta,
            layer_types=("compressed_attention",) * L, mlp_types=("moe",) * L, compress_kinds=kinds,
            csa_compress_rate=rates["compressed_sparse_attention"] if csa else 0,
            hca_compress_rate=rates["heavily_compressed_attention"] if "hca" in kinds else 0,
            compress_rope_theta=compress_theta, sliding_window=c.int("sliding_window", 128),
            q_lora_rank=c.int("q_lora_rank"), o_groups=c.int("o_groups"), o_lora_rank=c.int("o_lora_rank"),
            index_n_heads=c.int("index_n_heads") if csa else 0, index_head_dim=c.int("index_head_dim") if csa else 0,
            index_topk=c.int("index_topk") if csa else 0, hc_mult=c.int("hc_mult", 4),
            hc_sinkhorn_iters=c.int("hc_sinkhorn_iters", 20), hc_eps=float(c.get("hc_eps", 1e-6)),
            hash_moe_layers=tuple(i for i, k in enumerate(mlp) if k == "hash_moe"),
            attn_qkv_bias=False, attn_qk_norm=False, attn_output_gate=False, attn_sinks=True,
            num_experts=c.int("n_routed_experts", 256), num_experts_per_tok=c.int("num_experts_per_tok"),
            moe_intermediate_size=inter, norm_topk_prob=True, shared_expert_intermediate_size=inter,
            intermediate_size=0, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            router_scoring="sqrtsoftplus", router_correction_bias=True, shared_expert_gate=False,
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.5)), expert_act="clamped_silu",
            swiglu_limit=limit,
        )
        return make_config(f, c.where)

    def plan(self, cfg: ModelConfig, ck: Checkpoint) -> list[Item]:
        p, V, H, n = self.prefix, cfg.vocab_size, cfg.hidden_size, cfg.hc_mult
        embed, hc = ("embed.weight", "hc_head_") if self._release else (f"{p}embed_tokens.weight", f"{p}hc_head.hc_")
        items: list[Item] = [TensorItem("embed_tokens.weight", embed, (V, H), "keep")]
        for i in range(cfg.num_layers):
            items += self.layer(cfg, i)
        items += [TensorItem("hc_head.hc_fn", f"{hc}fn", (n, n * H), "fp32"),
                  TensorItem("hc_head.hc_base", f"{hc}base", (n,), "fp32"),
                  TensorItem("hc_head.hc_scale", f"{hc}scale", (1,), "fp32"),
                  TensorItem("norm.weight", f"{p}norm.weight", (H,), "norm")]
        if not cfg.tie_word_embeddings:
            items.append(LinearItem("lm_head", (("head", V),), H))
        return items

    def layer(self, cfg: ModelConfig, i: int) -> list[Item]:
        p, o, H, n = f"{self.prefix}layers.{i}.", f"layers.{i}.", cfg.hidden_size, cfg.hc_mult
        items: list[Item] = [TensorItem(f"{o}input_layernorm.weight", f"{p}attn_norm.weight", (H,), "norm"),
                             TensorItem(f"{o}post_attention_layernorm.weight", f"{p}ffn_norm.weight", (H,), "norm")]
        for hc in ("attn", "ffn"):
            w = (2 + n) * n
            items += [TensorItem(f"{o}{hc}_hc.fn", f"{p}hc_{hc}_fn", (w, n * H), "fp32"),
                      TensorItem(f"{o}{hc}_hc.base", f"{p}hc_{hc}_base", (w,), "fp32"),
                      TensorItem(f"{o}{hc}_hc.scale", f"{p}hc_{hc}_scale", (3,), "fp32")]
        return items + self.attention(cfg, i) + self.moe(cfg, i, self.experts(cfg, i, None))

    def attention(self, cfg: ModelConfig, i: int) -> list[Item]:
        p, o, H = f"{self.prefix}layers.{i}.attn.", f"layers.{i}.self_attn.", cfg.hidden_size
        nq, hd, ql, g, ol = cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
        items: list[Item] = [
            LinearItem(f"{o}q_a_proj", ((f"{p}wq_a", ql),), H),
            TensorItem(f"{o}q_a_norm.weight", f"{p}q_norm.weight", (ql,), "norm"),
            LinearItem(f"{o}q_b_proj", ((f"{p}wq_b", nq * hd),), ql),
            LinearItem(f"{o}kv_proj", ((f"{p}wkv", hd),), H),
            TensorItem(f"{o}kv_norm.weight", f"{p}norm.weight", (hd,), "norm"),
            LinearItem(f"{o}o_a_proj", ((f"{p}wo_a", g * ol),), nq * hd // g),
            LinearItem(f"{o}o_b_proj", ((f"{p}wo_b", H),), g * ol),
            TensorItem(f"{o}sinks", f"{p}attn_sink", (nq,), "fp32"),
        ]
        kind = cfg.compress_kinds[i]
        if kind == "none":
            return items
        m = cfg.csa_compress_rate if kind == "csa" else cfg.hca_compress_rate
        items += _pooled(f"{p}compressor.", f"{o}compressor.", H, hd, m, 2 if kind == "csa" else 1)
        if kind == "csa":
            d, nh = cfg.index_head_dim, cfg.index_n_heads
            pi, oi = f"{p}indexer.", f"{o}compressor.indexer."
            items += _pooled(f"{pi}compressor.", oi, H, d, m, 2)
            items += [LinearItem(f"{oi}q_b_proj", ((f"{pi}wq_b", nh * d),), ql),
                      LinearItem(f"{oi}weights_proj", ((f"{pi}weights_proj", nh),), H)]
        return items

    def experts(self, cfg: ModelConfig, i: int, ck: Checkpoint | None) -> ExpertSource:
        p = f"{self.prefix}layers.{i}.ffn.experts.{{e}}."
        return PerExpert(p + "w1", p + "w3", p + "w2")

    def moe(self, cfg: ModelConfig, i: int, experts: ExpertSource, *, block: str = "mlp",
            router: str = "gate") -> list[Item]:
        p, o, H, E, I = f"{self.prefix}layers.{i}.ffn.", f"layers.{i}.mlp.", cfg.hidden_size, cfg.num_experts, \
            cfg.moe_intermediate_size
        items: list[Item] = [LinearItem(f"{o}gate", ((f"{p}gate", E),), H, router=True)]
        if i in cfg.hash_moe_layers:
            items.append(TensorItem(f"{o}tid2eid", f"{p}gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok),
                                    "index"))
        else:
            items.append(TensorItem(f"{o}e_score_correction_bias", f"{p}gate.bias", (E,), "fp32"))
        items.append(BankItem(f"{o}experts", E, I, H, experts))
        return items + [LinearItem(f"{o}shared_expert.gate_up_proj",
                                   ((f"{p}shared_experts.w1", I), (f"{p}shared_experts.w3", I)), H),
                        LinearItem(f"{o}shared_expert.down_proj", ((f"{p}shared_experts.w2", H),), I)]


def _pooled(p: str, o: str, H: int, width: int, m: int, series: int) -> list[Item]:
    """A compressor's kv / gate projections (`series` x width rows), position bias and norm."""
    return [LinearItem(f"{o}kv_proj", ((f"{p}wkv", series * width),), H),
            LinearItem(f"{o}gate_proj", ((f"{p}wgate", series * width),), H),
            TensorItem(f"{o}position_bias", f"{p}ape", (m, series * width), "fp32"),
            TensorItem(f"{o}kv_norm.weight", f"{p}norm.weight", (width,), "norm")]


def _layer_kinds(c: HFConfig, L: int) -> tuple[str, ...]:
    """transformers' rule: `layer_types`, else the legacy per-layer `compress_ratios` (0 / 4 / 128), else V4-Pro's
    default (two HCA layers, then CSA / HCA alternating)."""
    types = c.d.get("layer_types")
    if types is None and c.d.get("compress_ratios") is not None:
        ratios = c.d["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in _LEGACY_RATIOS for r in ratios):
            raise CheckpointError(f"{c.where}: compress_ratios must list 0 / 4 / 128, got {ratios!r}")
        types = [_LEGACY_RATIOS[r] for r in ratios][:L]
    if types is None:
        types = ["heavily_compressed_attention"] * min(L, 2) + [
            "compressed_sparse_attention" if j % 2 else "heavily_compressed_attention" for j in range(max(L - 2, 0))]
    if not isinstance(types, list) or len(types) != L or any(t not in _KINDS for t in types):
        raise CheckpointError(f"{c.where}: layer_types must list {L} entries of {supported(tuple(_KINDS))}, "
                              f"got {types!r}")
    return tuple(_KINDS[t] for t in types)


def _default_rates(c: HFConfig):
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    given = c.d.get("compress_rates") or {}
    if not isinstance(given, dict) or any(k not in rates for k in given):
        raise CheckpointError(f"{c.where}: compress_rates must map {supported(tuple(rates))} to rates, got {given!r}")
    rates |= given
    for legacy, key in (("compress_rate_csa", "compressed_sparse_attention"),
                        ("compress_rate_hca", "heavily_compressed_attention")):
        if c.d.get(legacy) is not None:
            rates[key] = c.d[legacy]
    for k, v in rates.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CheckpointError(f"{c.where}: compress rate of {k} must be a positive integer, got {v!r}")
    return rates.items()


def _partial(c: HFConfig, head_dim: int) -> float:
    """partial_rotary_factor: the config's (top level or in a rope sub-dict), else qk_rope_head_dim / head_dim, else
    transformers' 64 / 512."""
    rp = c.d.get("rope_parameters") or {}
    for src in (c.d, rp.get("main") if isinstance(rp.get("main"), dict) else {}):
        if src.get("partial_rotary_factor") is not None:
            return float(src["partial_rotary_factor"])
    if c.d.get("qk_rope_head_dim") is not None:
        return c.int("qk_rope_head_dim") / head_dim
    return 64 / 512


def _compress_rope(c: HFConfig, partial: float) -> tuple[float, dict]:
    """(compress_rope_theta, rope_* fields): the "compress" rope sub-dict (or the flat rope_scaling / rope_parameters
    of older configs); YaRN there has attention_factor 1 unless given (transformers forces it)."""
    rp = c.d.get("rope_parameters") or c.d.get("rope_scaling") or {}
    main = rp.get("main") if isinstance(rp, dict) else None
    if isinstance(main, dict) and main.get("rope_type", "default") != "default":
        raise CheckpointError(f"{c.where}: the sliding layers' rope must be plain, got {main.get('rope_type')!r}")
    sub = rp.get("compress") if isinstance(rp, dict) and isinstance(rp.get("compress"), dict) else \
        {k: v for k, v in (rp or {}).items() if k not in ("main", "compress")}
    theta = float(sub.get("rope_theta", c.get("compress_rope_theta", 160_000.0)))
    sub = {k: v for k, v in sub.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if sub.get("rope_type", sub.get("type", "default")) == "yarn":
        sub.setdefault("attention_factor", 1.0)
    _, _, scaling = rope(HFConfig({"rope_parameters": sub, "max_position_embeddings": c.d.get(
        "max_position_embeddings")}, c.where), default_theta=theta, allow_yarn=True)
    return theta, scaling
