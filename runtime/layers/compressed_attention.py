"""deepseek_v4's attention: shared-KV MQA over a sliding window, plus compressed long-range entries (CSA / HCA).

One spec per layer kind (transformers' `layer_types`): `sliding_attention`, `compressed_sparse_attention` (CSA) and
`heavily_compressed_attention` (HCA). Shapes (nq heads of width hd, r = rotary_dim rotated at the END of each head as
interleaved pairs (x0, x1), (x2, x3), …, ql = q_lora_rank, g = o_groups, ol = o_lora_rank, W = sliding_window,
m = compress_rate):
    q_resid = q_a_norm(q_a_proj(x)) [T, ql];  q = RoPE(rms(q_b_proj(q_resid)) per head) [T, nq, hd] (unweighted rms)
    kv = RoPE(kv_norm(kv_proj(x))) [T, hd]: one head, key and value at once (the state keeps every row)
    query p attends keys j with p - W < j <= p, then the compressed entries visible to it, plus one sink logit per
    head (`sinks` [nq] fp32, dropped after the softmax); o = Σ prob·kv, then RoPE⁻¹ (angle -p) on its rope dims
    out = o_b_proj(o_a(o)): o_a_proj [g·ol, nq·hd/g] maps each of the g head groups on its own ol rows
Compressed entries (`compressor.*`, rope type "compress"): entry w pools the window of source tokens
[w·m, (w + 1)·m) and becomes visible to query p once the window is complete (w < (p + 1) // m), at rope angle w·m:
    HCA: kv_proj, gate_proj [hd, H], position_bias [m, hd]: e_w = kv_norm(Σ_j softmax_j(gate_j + bias_j) ⊙ kv_j)
    CSA: the same at width 2·hd, two series: the softmax runs over 2m slots, the first half [:hd] of window w - 1's
         rows and the second half [hd:] of window w's (window -1: no slots); every entry is then ranked by the
         Lightning indexer, and query p sees only its `index_topk` best complete entries.
    indexer (CSA): its own pooled keys at width ihd = index_head_dim (kv_proj, gate_proj [2·ihd, H], position_bias
         [m, 2·ihd], kv_norm); queries RoPE(q_b_proj(q_resid)) [T, nih, ihd]; the score of entry w for query p is
         Σ_h weights_proj(x)_h · nih^-0.5 · relu(q_h · k_w) · ihd^-0.5.
The state (`CompressedKV`) keeps the raw [kv | gate] projections of the last 2m source tokens in a ring (a window
completes, and CSA's needs the previous one, whatever the chunking) and the pooled entries by window index, so a
prefill in chunks, then decode, computes what one forward would (transformers' buffer / overlap cache, another way).
It goes back to an earlier length L (prefix reuse) by truncation, `kv` to L rows and the entries to the L // m
complete at L (entry w reads only tokens before (w + 1)·m), with the rings restored from a snapshot taken at L
(`SequenceState.snapshot`): they are the only parts a truncation cannot rebuild.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ft.formats.config import ModelConfig
from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.compressor import Compressor, half_angles, rope_interleaved
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.norm import RMSNorm, rms_normalize
from ft.runtime.layers.rope import Rotary, yarn_inv_freq

__all__ = ["CompressedAttention", "CompressedAttentionSpec", "CompressedKV", "rope_interleaved", "rotaries", "spec_for"]

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_OF_CONFIG = {"none": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}


@dataclass(frozen=True)
class CompressedAttentionSpec:
    kind: str
    hidden_size: int
    num_heads: int
    head_dim: int
    rotary_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    compress_rate: int = 0      # CSA / HCA
    index_n_heads: int = 0      # CSA
    index_head_dim: int = 0     # CSA
    index_topk: int = 0         # CSA

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"attention kind {self.kind!r} not in {KINDS}")
        for name in ("hidden_size", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "sliding_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"num_heads·head_dim {self.num_heads * self.head_dim} does not split in o_groups "
                             f"{self.o_groups}")
        compressed = self.kind != "sliding_attention"
        if compressed != (self.compress_rate > 0):
            raise ValueError(f"{self.kind} needs compress_rate {'> 0' if compressed else '0'}, got "
                             f"{self.compress_rate}")
        indexed = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if self.kind == "compressed_sparse_attention":
            if min(indexed) <= 0 or self.index_head_dim < self.rotary_dim:
                raise ValueError("compressed_sparse_attention needs positive index_n_heads, index_topk and "
                                 f"index_head_dim >= rotary_dim, got {indexed}")
        elif indexed != (0, 0, 0):
            raise ValueError(f"index_* keys belong to compressed_sparse_attention, not {self.kind}")


def spec_for(cfg: ModelConfig, layer: int) -> CompressedAttentionSpec:
    """Layer `layer`'s spec from a normalized deepseek_v4 config (`compress_kinds`, families.md)."""
    kind = cfg.compress_kinds[layer]
    csa = kind == "csa"
    return CompressedAttentionSpec(
        kind=_OF_CONFIG[kind], hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
        rotary_dim=cfg.rotary_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        sliding_window=cfg.sliding_window, rms_norm_eps=cfg.rms_norm_eps,
        compress_rate={"none": 0, "csa": cfg.csa_compress_rate, "hca": cfg.hca_compress_rate}[kind],
        index_n_heads=cfg.index_n_heads if csa else 0, index_head_dim=cfg.index_head_dim if csa else 0,
        index_topk=cfg.index_topk if csa else 0)


def rotaries(cfg: ModelConfig) -> tuple[Rotary, Rotary]:
    """(main, compress): the sliding layers' plain rope of base rope_theta; the compressed layers' of base
    compress_rope_theta, YaRN-scaled when `rope_type` says so (attention factor as the config gives it: 1 for V4)."""
    main = Rotary(cfg.rotary_dim, cfg.rope_theta)
    if cfg.rope_type != "yarn":
        return main, Rotary(cfg.rotary_dim, cfg.compress_rope_theta)
    inv = yarn_inv_freq(dataclasses.replace(cfg, rope_theta=cfg.compress_rope_theta))
    return main, Rotary(cfg.rotary_dim, cfg.compress_rope_theta, inv_freq=inv, scale=cfg.rope_attention_factor)


class CompressedKV:
    """One sequence's state of one layer (module docstring): `kv` [capacity, hd] every row; compressed layers add
    `raw` [2m, 2·cw] (kv | gate projections, position p at row p % 2m; cw = 2·hd for CSA, hd for HCA) and
    `entries` [capacity // m, hd]; CSA adds `index_raw` [2m, 4·ihd] and `index_entries` [capacity // m, ihd]."""

    def __init__(self, spec: CompressedAttentionSpec, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        m, hd = spec.compress_rate, spec.head_dim
        self.capacity = capacity
        self.kv = torch.empty(capacity, hd, dtype=dtype, device=device)
        if m:
            cw = 2 * hd if spec.kind == "compressed_sparse_attention" else hd
            self.raw = torch.zeros(2 * m, 2 * cw, dtype=dtype, device=device)
            self.entries = torch.empty(capacity // m, hd, dtype=dtype, device=device)
        if spec.kind == "compressed_sparse_attention":
            self.index_raw = torch.zeros(2 * m, 4 * spec.index_head_dim, dtype=dtype, device=device)
            self.index_entries = torch.empty(capacity // m, spec.index_head_dim, dtype=dtype, device=device)
        self._m = m

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.kv, getattr(self, "raw", None), getattr(self, "entries", None),
                            getattr(self, "index_raw", None), getattr(self, "index_entries", None)) if t is not None]

    def resize(self, capacity: int, length: int) -> None:
        """Buffers for `capacity` tokens, the first `length` tokens' rows (and complete entries) copied."""
        def grown(old: torch.Tensor, rows: int, filled: int) -> torch.Tensor:
            buf = old.new_empty((rows, *old.shape[1:]))
            buf[:filled] = old[:filled]
            return buf

        self.kv = grown(self.kv, capacity, length)
        if self._m:
            self.entries = grown(self.entries, capacity // self._m, length // self._m)
        if hasattr(self, "index_entries"):
            self.index_entries = grown(self.index_entries, capacity // self._m, length // self._m)
        self.capacity = capacity

    def rows(self, length: int) -> dict[str, torch.Tensor]:
        """The per-token parts holding the first `length` tokens, as views: `kv` [length, hd] and the entries of the
        windows complete at `length` (`entries`, CSA `index_entries` [length // m, ...]). Entry w pools only tokens
        before (w + 1)·m (window w, and CSA's window w - 1), so these rows of a longer state are exactly those of the
        state at `length`: truncation rewinds them."""
        out = {"kv": self.kv[:length]}
        for name in ("entries", "index_entries"):
            if hasattr(self, name):
                out[name] = getattr(self, name)[:length // self._m]
        return out

    def windows(self) -> dict[str, torch.Tensor]:
        """The parts valid at one length only (rewound from a snapshot, `SequenceState.snapshot`): the rings of raw
        projections `raw` and (CSA) `index_raw`; none for a sliding layer."""
        return {name: getattr(self, name) for name in ("raw", "index_raw") if hasattr(self, name)}

    def set_window(self, name: str, value: torch.Tensor) -> None:
        """Replace the ring `name` (`windows`) by `value` (a state parked in host memory and back)."""
        if name not in self.windows():
            raise ValueError(f"no ring {name!r} in this layer's state")
        setattr(self, name, value)


class CompressedAttention(Op):
    """`rope`: the layer's rotary (transformers' "main" for sliding layers, "compress" for CSA / HCA)."""

    def __init__(self, spec: CompressedAttentionSpec, rope: Rotary) -> None:
        super().__init__()
        if rope.rotary_dim != spec.rotary_dim:
            raise ValueError(f"rope of {rope.rotary_dim} dims for a rotary_dim {spec.rotary_dim} layer")
        self.q_a_proj = Linear()
        self.q_a_norm = RMSNorm(spec.rms_norm_eps)
        self.q_b_proj = Linear()
        self.kv_proj = Linear()
        self.kv_norm = RMSNorm(spec.rms_norm_eps)
        self.o_a_proj = Linear()
        self.o_b_proj = Linear()
        self.sinks: torch.Tensor = REQUIRED
        if spec.compress_rate:
            self.compressor = Compressor(spec)
        self._spec, self._rope = spec, rope

    def new_state(self, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> CompressedKV:
        return CompressedKV(self._spec, capacity, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, past: int, state: CompressedKV) -> torch.Tensor:
        """x [T, H] at positions past..past + T - 1 of the sequence whose state is `state` -> [T, H]."""
        sp = self._spec
        t, nq, hd, end = x.shape[0], sp.num_heads, sp.head_dim, past + x.shape[0]
        if end > state.capacity:
            raise ValueError(f"{end} tokens exceed the state's capacity {state.capacity}")
        positions = torch.arange(past, end, device=x.device)
        cos, sin = half_angles(self._rope, positions)
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = rms_normalize(self.q_b_proj(q_resid).view(t, nq, hd), sp.rms_norm_eps).to(x.dtype)
        q = rope_interleaved(q, cos, sin)
        state.kv[past:end] = rope_interleaved(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]
        lo = max(0, past - sp.sliding_window + 1)
        keys = state.kv[lo:end]
        dist = positions[:, None] - torch.arange(lo, end, device=x.device)[None, :]
        visible = (dist >= 0) & (dist < sp.sliding_window)                                    # [T, S]
        if hasattr(self, "compressor"):
            entries, seen = self.compressor(x, q_resid, past, state, self._rope)
            keys, visible = torch.cat((keys, entries)), torch.cat((visible, seen), dim=1)
        scores = torch.matmul(q.transpose(0, 1), keys.t()) * hd ** -0.5                    # [nq, T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = self.sinks.to(scores.dtype).view(nq, 1, 1).expand(nq, t, 1)
        probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
        o = rope_interleaved(torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1), cos, -sin)  # [T, nq, hd]
        g = sp.o_groups
        w = self.o_a_proj.weight.view(g, sp.o_lora_rank, -1)
        grouped = torch.einsum("tgi,goi->tgo", o.reshape(t, g, -1), w).reshape(t, g * sp.o_lora_rank)
        return self.o_b_proj(grouped)
