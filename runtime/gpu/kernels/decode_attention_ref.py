"""The PyTorch reference of `decode_attention.py`'s fused decode kernel, over explicit per-sequence buffers."""

from __future__ import annotations

import torch

from ft.runtime.layers.norm import rms_normalize
from ft.runtime.layers.rope import apply_rotary


def decode_attention_ref(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                         cos: torch.Tensor | None, sin: torch.Tensor | None,
                         kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, *, nq: int, nkv: int,
                         hd: int, scale: float, gated: bool, sinks: torch.Tensor | None = None,
                         window: int = 0) -> torch.Tensor:
    """Torch reference of `decode_attention`, with kv[b] = sequence b's (k, v) buffers in place of `tables`: the
    layer's eager ops, then fp32 softmax attention per sequence over rows 0..positions[b] (the last `window` of
    them when window > 0), with each head's sink logit in the denominator when given."""
    B, dtype = qkv.shape[0], qkv.dtype
    q = qkv[:, : nq * hd].reshape(B, nq, hd)
    k = qkv[:, nq * hd:(nq + nkv) * hd].reshape(B, nkv, hd)
    v = qkv[:, (nq + nkv) * hd:(nq + 2 * nkv) * hd].reshape(B, nkv, hd)
    if q_norm is not None:
        q = (rms_normalize(q, eps) * q_norm).to(dtype)
    if k_norm is not None:
        k = (rms_normalize(k, eps) * k_norm).to(dtype)
    if cos is not None:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    r = nq // nkv
    out = torch.empty(B, nq * hd, dtype=dtype, device=qkv.device)
    for b, p in enumerate(positions.tolist()):
        kv[b][0][p] = k[b]
        kv[b][1][p] = v[b]
        lo = max(0, p + 1 - window) if window else 0
        kb, vb = (t[lo: p + 1].float().repeat_interleave(r, dim=1) for t in kv[b])          # [keys, nq, hd]
        logits = torch.einsum("hd,lhd->hl", q[b].float(), kb) * scale
        if sinks is not None:
            logits = torch.cat([logits, sinks.float()[:, None]], dim=1)
        w = logits.softmax(-1)[:, : kb.shape[0]]
        out[b] = torch.einsum("hl,lhd->hd", w, vb).reshape(-1).to(dtype)
    return out * torch.sigmoid(qkv[:, -nq * hd:]) if gated else out
