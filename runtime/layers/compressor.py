"""deepseek_v4's compressed series (`compressed_attention.py`'s module docstring gives the math): the pooling of
complete windows of raw [kv | gate] projections into entries (HCA, CSA with its overlapping windows), CSA's Lightning
indexer, and the interleaved-pair RoPE both use."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.norm import RMSNorm
from ft.runtime.layers.rope import Rotary

if TYPE_CHECKING:
    from ft.runtime.layers.compressed_attention import CompressedAttentionSpec, CompressedKV


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, r/2] fp32 (one angle per pair) -> x with its last r dims rotated as interleaved
    pairs, in fp32, cast back (transformers' deepseek_v4 apply_rotary_pos_emb)."""
    r = 2 * cos.shape[-1]
    pairs = x[..., -r:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], rotated), dim=-1)


def half_angles(rope: Rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope.cos_sin(positions, torch.float32)
    half = rope.rotary_dim // 2
    return cos[:, :half], sin[:, :half]


def _window_sources(ring: torch.Tensor, new: torch.Tensor, past: int, m: int) -> tuple[torch.Tensor, int, int]:
    """The raw rows of the windows this call completes and of the window before them; updates the ring.
    ring [2m, W] (position p at row p % 2m), new [T, W] at positions past.. -> (rows [P, W] at positions start..,
    w0, w1): windows w0..w1-1 complete now, rows start at max(0, (w0 - 1)·m)."""
    end = past + new.shape[0]
    w0, w1 = past // m, end // m
    start = max(0, (w0 - 1) * m)
    old = ring[torch.arange(start, past, device=ring.device) % (2 * m)]
    rows = torch.cat((old, new[:max(0, w1 * m - past)]))
    keep = torch.arange(max(past, end - 2 * m), end, device=ring.device)
    ring[keep % (2 * m)] = new[keep - past]
    return rows, w0, w1


def _pool(rows: torch.Tensor, start: int, w0: int, w1: int, m: int, bias: torch.Tensor, width: int,
          overlap: bool) -> torch.Tensor:
    """rows [P, 2·cw] ([kv | gate]) from `_window_sources` -> pooled [w1 - w0, width] (before the norm).
    overlap (CSA, cw = 2·width): window w's slots are [first half of window w - 1 | second half of window w]."""
    cw = rows.shape[1] // 2
    n = w1 - w0
    cur = rows[w0 * m - start:w1 * m - start].view(n, m, 2 * cw)
    kv, gate = cur[..., :cw], cur[..., cw:] + bias
    if overlap:
        first = rows[:(w1 - 1) * m - start].view(-1, m, 2 * cw)                 # windows max(w0 - 1, 0)..w1 - 2
        pkv, pgate = first[..., :width], first[..., cw:cw + width] + bias[:, :width]
        if w0 == 0:                                                              # window -1: no slots
            pkv = torch.cat((pkv.new_zeros(1, m, width), pkv))
            pgate = torch.cat((pgate.new_full((1, m, width), float("-inf")), pgate))
        kv = torch.cat((pkv, kv[..., width:]), dim=1)                            # [n, 2m, width]
        gate = torch.cat((pgate, gate[..., width:]), dim=1)
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


class _Pooled(Op):
    """kv_proj, gate_proj, position_bias (fp32), kv_norm: the pooled entries of one compressed series."""

    def __init__(self, width: int, m: int, eps: float, overlap: bool) -> None:
        super().__init__()
        self.kv_proj = Linear()
        self.gate_proj = Linear()
        self.position_bias: torch.Tensor = REQUIRED
        self.kv_norm = RMSNorm(eps)
        self._width, self._m, self._overlap = width, m, overlap

    def update(self, x: torch.Tensor, past: int, ring: torch.Tensor, entries: torch.Tensor,
               rope: Rotary) -> int:
        """Pool the windows completed by x's rows (positions past..) into `entries` -> entries now complete."""
        m = self._m
        rows, w0, w1 = _window_sources(ring, torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1), past, m)
        if w1 > w0:
            start = max(0, (w0 - 1) * m)
            pooled = self.kv_norm(_pool(rows, start, w0, w1, m, self.position_bias.to(rows.dtype), self._width,
                                        self._overlap))
            cos, sin = half_angles(rope, torch.arange(w0, w1, device=x.device) * m)
            entries[w0:w1] = rope_interleaved(pooled[:, None], cos, sin)[:, 0]
        return w1


class Indexer(_Pooled):
    """CSA's Lightning indexer (module docstring): picks each query's `index_topk` best complete entries."""

    def __init__(self, spec: CompressedAttentionSpec) -> None:
        super().__init__(spec.index_head_dim, spec.compress_rate, spec.rms_norm_eps, overlap=True)
        self.q_b_proj = Linear()
        self.weights_proj = Linear()
        self._n, self._d, self._topk = spec.index_n_heads, spec.index_head_dim, spec.index_topk

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, past: int, state: CompressedKV,
               rope: Rotary) -> torch.Tensor:
        """-> bool [T, E] (E = entries complete after this call): the entries each query attends."""
        e = self.update(x, past, state.index_raw, state.index_entries, rope)
        t = x.shape[0]
        positions = torch.arange(past, past + t, device=x.device)
        visible = torch.arange(e, device=x.device)[None, :] < ((positions + 1) // self._m)[:, None]   # [T, E]
        if e == 0:
            return visible
        cos, sin = half_angles(rope, positions)
        q = rope_interleaved(self.q_b_proj(q_resid).view(t, self._n, self._d), cos, sin)
        scores = F.relu(torch.matmul(q.float(), state.index_entries[:e].float().t())) * self._d ** -0.5  # [T,n,E]
        w = F.linear(x, self.weights_proj.weight.to(x.dtype)).float() * self._n ** -0.5                  # [T, n]
        index = (scores * w.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))
        top = index.topk(min(self._topk, e), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible


class Compressor(_Pooled):
    def __init__(self, spec: CompressedAttentionSpec) -> None:
        csa = spec.kind == "compressed_sparse_attention"
        super().__init__(spec.head_dim, spec.compress_rate, spec.rms_norm_eps, overlap=csa)
        if csa:
            self.indexer = Indexer(spec)

    def __call__(self, x: torch.Tensor, q_resid: torch.Tensor, past: int, state: CompressedKV,
                 rope: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (entries [E, hd], visible bool [T, E])."""
        e = self.update(x, past, state.raw, state.entries, rope)
        if hasattr(self, "indexer"):
            return state.entries[:e], self.indexer.select(x, q_resid, past, state, rope)
        positions = torch.arange(past, past + x.shape[0], device=x.device)
        return state.entries[:e], torch.arange(e, device=x.device)[None, :] < ((positions + 1) // self._m)[:, None]
