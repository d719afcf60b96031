"""glm_moe_dsa (GLM-5, GLM-5.1, GLM-5.2): multi-head latent attention (MLA, DeepSeek-V3 style: low-rank q and kv
projections with RMSNorms, a decoupled rotary part shared by all heads) with the DSA indexer (DeepSeek Sparse
Attention: a small multi-head scorer picks each query's top-`index_topk` past keys; "shared" layers reuse the
previous full layer's selection), and the glm4_moe MLP: `first_k_dense_replace` (or `mlp_layer_types`) dense layers,
then MoE with the sigmoid group-limited router and an ungated shared expert.

Renaming and fusions (families.md): `q_a_proj | kv_a_proj_with_mqa` -> `self_attn.qkv_a_proj` (both read the
normed hidden state). GLM rotates the rope dims as interleaved pairs `(x0, x1), (x2, x3), …` and writes the result
de-interleaved (`apply_rotary_pos_emb_interleave`); reordering the rows that produce the rope dims to `[even | odd]`
(and the indexer's LayerNorm weight and bias with them) makes it the runtime's rotate_half RoPE exactly, and the
rotated keys equal transformers' cached ones. The MTP layers after the decoder are skipped (as in glm4_moe).
"""

from __future__ import annotations

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.families.base import HFConfig, common_fields, make_config
from ft.compiler.families.glm4_moe import Glm4Moe, moe_fields
from ft.compiler.plan import Item, LinearItem, TensorItem
from ft.formats import ModelConfig
from ft.formats.config import INDEXER_TYPES

_TOPK_METHODS = (None, "noaux_tc")
_SCORING = (None, "sigmoid")
_INDEXED = ("indexed_attention", "deepseek_sparse_attention")  # transformers >= 5.23 / GLM-5 releases and 5.17


def interleaved_to_half(width: int, rope: int, *, first: bool) -> torch.Tensor:
    """Row order of one head of `width` rows whose `rope` rotated rows (the first or the last) go from interleaved
    pairs to `[even | odd]`; the other rows stay."""
    idx = torch.arange(width)
    lo = 0 if first else width - rope
    pairs = torch.arange(lo, lo + rope)
    idx[lo:lo + rope] = torch.cat([pairs[0::2], pairs[1::2]])
    return idx


def per_head(heads: int, width: int, one: torch.Tensor) -> torch.Tensor:
    return torch.cat([one + h * width for h in range(heads)])


class GlmMoeDsa(Glm4Moe):
    name = "glm_moe_dsa"
    architectures = ("GlmMoeDsaForCausalLM",)
    model_types = ("glm_moe_dsa",)

    def normalize(self, hf: dict, gen: dict | None) -> ModelConfig:
        c = HFConfig(hf)
        c.refuse("topk_method", "routing is sigmoid + correction bias, group-limited (noaux_tc)",
                 ok=lambda v: v in _TOPK_METHODS)
        c.refuse("scoring_func", "glm_moe_dsa routers score experts with a sigmoid", ok=lambda v: v in _SCORING)
        c.refuse("attention_bias", "GLM-5's MLA projections have no biases")
        c.refuse("mlp_bias", "GLM-5's MLPs have no biases")
        c.refuse("partial_rotary_factor", "MLA rotates exactly qk_rope_head_dim dims", ok=lambda v: v in (None, 1, 1.0))
        c.refuse("layer_types", "every glm_moe_dsa layer is indexed (MLA + DSA) attention",
                 ok=lambda v: v is None or all(t in _INDEXED for t in v))
        # transformers derives head_dim (= qk_rope_head_dim) and layer_types itself: both are set from the MLA keys
        plain = HFConfig({k: x for k, x in hf.items() if k not in ("head_dim", "layer_types")})
        f = common_fields(plain, gen, family=self.name, default_theta=10_000.0)
        L, nq = f["num_layers"], f["num_heads"]
        nope, rope, v = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
        if f["num_kv_heads"] != nq:
            raise CheckpointError(f"{c.where}: num_key_value_heads {f['num_kv_heads']} != num_attention_heads {nq} "
                                  "(MLA expands the latent to every head)")
        if rope % 2 or min(nope, rope, v) <= 0:
            raise CheckpointError(f"{c.where}: qk_nope_head_dim, qk_rope_head_dim (even) and v_head_dim must be "
                                  f"positive, got {nope}, {rope}, {v}")
        mtp = c.int("num_nextn_predict_layers", 0)
        if mtp < 0:
            raise CheckpointError(f"{c.where}: num_nextn_predict_layers must be >= 0, got {mtp}")
        self.skip_prefixes = tuple(f"{self.prefix}layers.{L + j}." for j in range(mtp))
        f.update(
            head_dim=nope + rope, rotary_dim=rope, layer_types=("mla_attention",) * L, mlp_types=_mlp_types(c, L),
            attn_qkv_bias=False, attn_qk_norm=False, attn_output_gate=False,
            q_lora_rank=c.int("q_lora_rank"), kv_lora_rank=c.int("kv_lora_rank"), v_head_dim=v,
            index_n_heads=c.int("index_n_heads"), index_head_dim=c.int("index_head_dim"),
            index_topk=c.int("index_topk"), indexer_types=_indexer_types(c, L),
            **moe_fields(c, self.name, experts=256, scale=2.5),
        )
        return make_config(f, c.where)

    def attention(self, cfg: ModelConfig, i: int) -> list[Item]:
        """MLA projections (rope rows reordered, see the module docstring), their norms, and the layer's indexer."""
        p, o, H = f"{self.prefix}layers.{i}.self_attn.", f"layers.{i}.self_attn.", cfg.hidden_size
        nq, hd, r, v = cfg.num_heads, cfg.head_dim, cfg.rotary_dim, cfg.v_head_dim
        ql, kvl = cfg.q_lora_rank, cfg.kv_lora_rank
        a_rows = interleaved_to_half(ql + kvl + r, r, first=False)   # [q_a | kv latent | k_rope]
        items: list[Item] = [
            LinearItem(f"{o}qkv_a_proj", ((f"{p}q_a_proj", ql), (f"{p}kv_a_proj_with_mqa", kvl + r)), H, perm=a_rows),
            TensorItem(f"{o}q_a_layernorm.weight", f"{p}q_a_layernorm.weight", (ql,), "norm"),
            LinearItem(f"{o}q_b_proj", ((f"{p}q_b_proj", nq * hd),), ql,
                       perm=per_head(nq, hd, interleaved_to_half(hd, r, first=False))),
            TensorItem(f"{o}kv_a_layernorm.weight", f"{p}kv_a_layernorm.weight", (kvl,), "norm"),
            LinearItem(f"{o}kv_b_proj", ((f"{p}kv_b_proj", nq * (hd - r + v)),), kvl),
            LinearItem(f"{o}o_proj", ((f"{p}o_proj", H),), nq * v),
        ]
        if cfg.indexer_types[i] == "full":
            n, d = cfg.index_n_heads, cfg.index_head_dim
            k_rows = interleaved_to_half(d, r, first=True)            # indexer heads: [rope | pass]
            p, o = f"{p}indexer.", f"{o}indexer."
            items += [
                LinearItem(f"{o}wq_b", ((f"{p}wq_b", n * d),), ql, perm=per_head(n, d, k_rows)),
                LinearItem(f"{o}wk", ((f"{p}wk", d),), H, perm=k_rows),
                TensorItem(f"{o}k_norm.weight", f"{p}k_norm.weight", (d,), "fp32", perm=k_rows),
                TensorItem(f"{o}k_norm.bias", f"{p}k_norm.bias", (d,), "fp32", perm=k_rows),
                TensorItem(f"{o}weights_proj.weight", f"{p}weights_proj.weight", (n, H), "fp32"),
            ]
        return items


def _mlp_types(c: HFConfig, L: int) -> tuple[str, ...]:
    """`mlp_layer_types` (dense / sparse) when given, else `first_k_dense_replace` (default 3) dense layers first."""
    kinds = c.d.get("mlp_layer_types")
    if kinds is None:
        dense = c.int("first_k_dense_replace", 3)
        if not 0 <= dense <= L:
            raise CheckpointError(f"{c.where}: first_k_dense_replace must be in 0..{L}, got {dense}")
        return ("dense",) * dense + ("moe",) * (L - dense)
    if not isinstance(kinds, list) or len(kinds) != L or any(k not in ("dense", "sparse") for k in kinds):
        raise CheckpointError(f"{c.where}: mlp_layer_types must list {L} entries of dense / sparse, got {kinds!r}")
    return tuple("moe" if k == "sparse" else "dense" for k in kinds)


def _indexer_types(c: HFConfig, L: int) -> tuple[str, ...]:
    """transformers' rule: `indexer_types`, else `index_topk_pattern` (a string of F / S, or a list), else layer i is
    full iff max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (defaults 2 and 1: every layer full)."""
    kinds = c.d.get("indexer_types")
    if kinds is None and c.d.get("index_topk_pattern") is not None:
        pattern = c.d["index_topk_pattern"]
        if isinstance(pattern, str):
            if any(ch not in "FS" for ch in pattern):
                raise CheckpointError(f"{c.where}: index_topk_pattern must be a string of F / S, got {pattern!r}")
            kinds = [{"F": "full", "S": "shared"}[ch] for ch in pattern]
        else:
            kinds = pattern
    if kinds is None:
        freq, offset = max(c.int("index_topk_freq", 1), 1), c.int("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
    if not isinstance(kinds, list) or len(kinds) != L or any(k not in INDEXER_TYPES for k in kinds):
        raise CheckpointError(f"{c.where}: indexer_types must list {L} entries of full / shared, got {kinds!r}")
    if kinds[0] != "full":
        raise CheckpointError(f"{c.where}: indexer_types[0] must be full (shared layers reuse an earlier selection)")
    return tuple(kinds)
