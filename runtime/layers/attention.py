"""Causal GQA attention over a per-sequence KV cache.

Fused projection rows `[q (nq·hd) | k (nkv·hd) | v (nkv·hd) | gate (nq·hd), only if gated]`, optional bias.
Per head: optional RMSNorm of q and k over head_dim (before RoPE), then (partial) RoPE. Each segment writes its k/v
rows into its cache at positions `[past, past + T)` and its queries attend to cache rows `[0, past + T)`, query i
seeing keys up to `past + i`. A static batch (decode captured in a CUDA graph, see `ForwardBatch.static`) writes each
one-token segment's k/v at its device-side position and attends over the whole buffer under a mask. Gated attention
multiplies the attention output by `sigmoid(gate)` before `o_proj`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ft.formats.config import ModelConfig
from ft.runtime.layers.base import Op
from ft.runtime.layers.batch import ForwardBatch
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.norm import RMSNorm
from ft.runtime.layers.rope import apply_rotary


class Attention(Op):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.qkv_proj = Linear()
        self.o_proj = Linear()
        if cfg.attn_qk_norm:
            self.q_norm = RMSNorm(cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.rms_norm_eps)
        self._layer = layer
        self._nq, self._nkv, self._hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self._gated = cfg.attn_output_gate
        q_rows, kv_rows = self._nq * self._hd, self._nkv * self._hd
        self._split = [q_rows, kv_rows, kv_rows] + ([q_rows] if self._gated else [])

    @property
    def expected_rows(self) -> int:
        return sum(self._split)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]                                              # x [N, H]
        parts = self.qkv_proj(x).split(self._split, dim=-1)
        q = parts[0].reshape(n, self._nq, self._hd)
        k = parts[1].reshape(n, self._nkv, self._hd)
        v = parts[2].reshape(n, self._nkv, self._hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = batch.rope["cos"], batch.rope["sin"]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        out = torch.empty_like(q)                                   # [N, nq, hd]
        for seg in batch.segments:
            k_cache, v_cache = seg.state.kv[self._layer]            # [capacity, nkv, hd] each
            if batch.static:                                        # one token, its position on the device
                pos = batch.positions[seg.rows]
                k_cache.index_copy_(0, pos, k[seg.rows])
                v_cache.index_copy_(0, pos, v[seg.rows])
                out[seg.rows] = masked_decode_attention(q[seg.rows], k_cache, v_cache, pos)
                continue
            end = seg.past + seg.num_tokens
            k_cache[seg.past:end] = k[seg.rows]
            v_cache[seg.past:end] = v[seg.rows]
            out[seg.rows] = causal_attention(q[seg.rows], k_cache[:end], v_cache[:end], seg.past)
        out = out.reshape(n, self._nq * self._hd)
        if self._gated:
            out = out * torch.sigmoid(parts[3])
        return self.o_proj(out)


# Not cuDNN: its SDPA builds an execution plan per new key length, i.e. at every decode step (63 ms of host time per
# call on an H200 with torch 2.11, against ~0.1 ms for flash / memory-efficient attention).
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q [T, nq, hd]; k, v [past + T, nkv, hd] -> [T, nq, hd]; query i attends keys 0..past+i."""
    if q.is_cuda:
        with sdpa_kernel(_BACKENDS):
            return _sdpa(q, k, v, past)
    return _sdpa(q, k, v, past)


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One query token: q [1, nq, hd]; k, v [capacity, nkv, hd]; pos [1] (device) -> [1, nq, hd], attending to
    rows 0..pos. Shapes never depend on pos (graph-capturable). The r = nq / nkv query heads of a KV group are laid out
    as r query rows of that group, so GQA needs no copy of k / v."""
    cap, nkv, hd = k.shape
    r = q.shape[1] // nkv
    qh = q[0].reshape(nkv, r, hd).unsqueeze(0)                          # [1, nkv, r, hd]: head g*r + j -> group g
    kh, vh = (a.transpose(0, 1).unsqueeze(0) for a in (k, v))           # [1, nkv, cap, hd], strided views
    mask = (torch.arange(cap, device=q.device) <= pos).view(1, 1, 1, cap)
    ctx = sdpa_kernel(_BACKENDS[1:]) if q.is_cuda else contextlib.nullcontext()  # flash takes no mask
    with ctx:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=hd ** -0.5)
    return o[0].reshape(1, nkv * r, hd)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    t, s = q.shape[0], k.shape[0]
    qh, kh, vh = (a.transpose(0, 1).unsqueeze(0) for a in (q, k, v))    # [1, heads, len, hd]
    scale = q.shape[-1] ** -0.5
    if t == 1:
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    elif past == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Bottom-right aligned causal mask: row i may see columns <= past + i.
        mask = torch.arange(s, device=q.device)[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
