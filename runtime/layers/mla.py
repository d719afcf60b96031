"""Multi-head latent attention (MLA) with the DSA indexer: glm_moe_dsa's `mla_attention` layers.

Projections (FTW names, families.md; nq heads, hd = nope + r query/key width, r = rotary_dim, v value width,
ql = q_lora_rank, c = kv_lora_rank):
    [q_a (ql) | latent (c) | k_rope (r)] = qkv_a_proj(x)
    q_resid = q_a_layernorm(q_a);  q = q_b_proj(q_resid) [N, nq, hd] = [q_nope (nope) | q_rope (r)] per head
    kv = kv_a_layernorm(latent) [N, c];  k_rope = RoPE(k_rope) [N, r], one for all heads
    kv_b_proj [nq·(nope + v), c]: per head [W_k (nope rows) | W_v (v rows)]; key_h = [W_k·kv | k_rope], value_h = W_v·kv
The cache keeps `[kv | k_rope]` per token (c + r values, not nq·(hd + v)); attention runs in the latent space
("absorbed"): score_h = ((W_kᵀ q_nope_h)·kv + q_rope_h·k_rope) · hd^-0.5, out_h = W_v · Σ p·kv, the same sums as
transformers' expanded keys and values in another order. The low-rank norms use eps 1e-6 (transformers builds them
without the config's eps); RoPE is rotate_half on rows the compiler reordered from GLM's interleaved pairs.

DSA (the indexer, `indexer.*`, on `full` layers): index keys `k_i = RoPE(LayerNorm(wk·x))` [N, d] (cached beside the
latent), queries `q_i = RoPE(wq_b·q_resid)` [N, n, d] (RoPE on the first r dims), head weights
`w = weights_proj·x · n^-0.5` (fp32); a query at position p scores key j <= p with
`Σ_h w_h · relu(q_i,h · k_i,j · d^-0.5)` and attends only its `index_topk` best keys (all of them while p < topk).
A `shared` layer has no indexer and reuses the selection of the last full layer of the same forward
(`ForwardBatch.selection`). Scores are computed in fp32 in query blocks that bound the [rows, heads, keys] matrices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.formats.config import ModelConfig
from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.batch import ForwardBatch
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.norm import RMSNorm
from ft.runtime.layers.rope import apply_rotary

LOW_RANK_EPS = 1e-6     # q_a_layernorm / kv_a_layernorm (transformers' default for these norms)
INDEX_NORM_EPS = 1e-6   # the indexer's LayerNorm
BLOCK_ELEMENTS = 1 << 24  # fp32 score elements per query block (64 MiB)


class LayerNorm(Op):
    """`weight`, `bias` [d] fp32; `(x - mean) / sqrt(var + eps) · w + b` in fp32, cast back."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED
        self.bias: torch.Tensor = REQUIRED
        self._eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight, self.bias, self._eps).to(x.dtype)


class Fp32Proj(Op):
    """`weight [out, in]` kept in fp32 (transformers keeps the indexer's weights_proj in fp32): fp32 outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class Indexer(Op):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wq_b = Linear()
        self.wk = Linear()
        self.k_norm = LayerNorm(INDEX_NORM_EPS)
        self.weights_proj = Fp32Proj()
        self._n, self._d, self._topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> index keys [N, d] (first r dims rotated)."""
        return apply_rotary(self.k_norm(self.wk(x))[:, None, :], cos, sin)[:, 0]

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_resid [N, ql] -> index queries [N, n, d]."""
        return apply_rotary(self.wq_b(q_resid).view(-1, self._n, self._d), cos, sin)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> fp32 [N, n]."""
        return self.weights_proj(x) * self._n ** -0.5

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, past: int) -> torch.Tensor:
        """q [T, n, d], w [T, n] of a segment's queries at positions past.., keys [S, d] (S = past + T) -> bool
        [T, S]: the keys each query attends (its top-k causal keys by index score; all causal keys when S <= topk)."""
        t, s = q.shape[0], keys.shape[0]
        causal = torch.arange(s, device=q.device)[None, :] <= torch.arange(past, past + t, device=q.device)[:, None]
        if s <= self._topk:
            return causal
        kt = keys.float().t()
        out = torch.empty(t, s, dtype=torch.bool, device=q.device)
        step = max(1, BLOCK_ELEMENTS // (self._n * s))
        for a in range(0, t, step):
            b = min(t, a + step)
            scores = F.relu(torch.matmul(q[a:b].float(), kt) * self._d ** -0.5)          # [rows, n, S]
            index = torch.matmul(w[a:b].unsqueeze(-2), scores).squeeze(-2)                # [rows, S]
            index = index.masked_fill(~causal[a:b], float("-inf"))
            top = index.topk(self._topk, dim=-1).indices
            out[a:b] = torch.zeros_like(causal[a:b]).scatter_(-1, top, True) & causal[a:b]
        return out


class MlaAttention(Op):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.qkv_a_proj = Linear()
        self.q_a_layernorm = RMSNorm(LOW_RANK_EPS)
        self.q_b_proj = Linear()
        self.kv_a_layernorm = RMSNorm(LOW_RANK_EPS)
        self.kv_b_proj = Linear()
        self.o_proj = Linear()
        kind = cfg.indexer_types[layer] if cfg.indexer_types else None
        if kind == "full":
            self.indexer = Indexer(cfg)
        self._shared = kind == "shared"
        self._layer = layer
        self._nq, self._hd, self._r, self._v = cfg.num_heads, cfg.head_dim, cfg.rotary_dim, cfg.v_head_dim
        self._nope = cfg.head_dim - cfg.rotary_dim
        self._split = [cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rotary_dim]

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n, nq, c = x.shape[0], self._nq, self._split[1]                 # x [N, H]
        q_a, latent, k_rope = self.qkv_a_proj(x).split(self._split, dim=-1)
        q_resid = self.q_a_layernorm(q_a)
        q = self.q_b_proj(q_resid).view(n, nq, self._hd)
        cos, sin = batch.rope["cos"], batch.rope["sin"]
        q_rope = apply_rotary(q[..., self._nope:], cos, sin)             # [N, nq, r]
        entry = torch.cat([self.kv_a_layernorm(latent), apply_rotary(k_rope[:, None, :], cos, sin)[:, 0]], dim=-1)
        w = self.kv_b_proj.weight.view(nq, self._nope + self._v, c)      # per head [W_k; W_v]
        q_lat = torch.einsum("tnd,ndc->tnc", q[..., :self._nope], w[:, :self._nope])   # W_kᵀ q_nope [N, nq, c]
        qq = torch.cat([q_lat, q_rope], dim=-1)                          # scores = qq · [kv | k_rope]
        indexer = getattr(self, "indexer", None)
        if indexer is not None:
            ikeys = indexer.keys(x, cos, sin)
            iq, iw = indexer.queries(q_resid, cos, sin), indexer.head_weights(x)
        out = torch.empty(n, nq, c, dtype=x.dtype, device=x.device)
        for si, seg in enumerate(batch.segments):
            cache, icache = seg.state.kv[self._layer]                    # [cap, 1, c + r], [cap, 1, d or 0]
            past, end = seg.past, seg.past + seg.num_tokens
            cache[past:end, 0] = entry[seg.rows]
            selected = None
            if indexer is not None:
                icache[past:end, 0] = ikeys[seg.rows]
                selected = batch.selection[si] = indexer.select(iq[seg.rows], iw[seg.rows], icache[:end, 0], past)
            elif self._shared:
                selected = batch.selection[si]                           # the last full layer's, this forward
            out[seg.rows] = latent_attention(qq[seg.rows], cache[:end, 0], c, past, selected, self._hd ** -0.5)
        return self.o_proj(torch.einsum("tnc,nvc->tnv", out, w[:, self._nope:]).reshape(n, nq * self._v))


def latent_attention(qq: torch.Tensor, cache: torch.Tensor, c: int, past: int, selected: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """qq [T, nq, c + r] (absorbed queries), cache [S, c + r] (S = past + T), selected bool [T, S] or None (causal)
    -> [T, nq, c]: softmax over the visible keys of `scale · qq·cache`, applied to the latents cache[:, :c]."""
    t, nq, _ = qq.shape
    s = cache.shape[0]
    visible = torch.arange(s, device=qq.device)[None, :] <= torch.arange(past, past + t, device=qq.device)[:, None]
    if selected is not None:
        visible = visible & selected
    out = torch.empty(t, nq, c, dtype=qq.dtype, device=qq.device)
    step = max(1, BLOCK_ELEMENTS // (nq * s))
    for a in range(0, t, step):
        b = min(t, a + step)
        scores = torch.matmul(qq[a:b].transpose(0, 1).float(), cache.float().t()) * scale          # [nq, rows, S]
        probs = torch.softmax(scores.masked_fill(~visible[a:b], float("-inf")), dim=-1)
        out[a:b] = torch.matmul(probs, cache[:, :c].float()).transpose(0, 1).to(qq.dtype)
    return out
