"""Attention with per-head sinks and a sliding window (gpt_oss): prefill and the eager reference.

Query i at position p = past + i attends keys j with p - w < j <= p (w = 0: no window); with sinks, each head's
softmax row gets one more logit `sinks[h]` whose probability is dropped (transformers' eager_attention_forward for
gpt_oss). `sink_attention` is the reference (PyTorch, bounded blocks of queries); on CUDA `windowed_attention` runs
one flash-attention call instead (`sink_flash`), once a small probe has shown that flash computes the same thing on
this device, dtype and geometry.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("ft.runtime")


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, sinks: torch.Tensor | None,
                       window: int) -> torch.Tensor:
    """`sink_attention`'s contract; on CUDA one flash call (`sink_flash`) once a probe has shown that flash computes
    it on this device, dtype and geometry (`_sink_flash_ok`), else `sink_attention` itself."""
    if q.is_cuda and _sink_flash_ok(q, k, sinks):
        return sink_flash(q, k, v, sinks, window)
    return sink_attention(q, k, v, past, sinks, window)


SINK_QUERY_BLOCK = 256  # query rows per block of `sink_attention` at most ...
SINK_SCORE_ELEMENTS = 1 << 24  # ... and fewer (not under 16) where its [nq, rows, keys] scores would pass this size


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, sinks: torch.Tensor | None,
                   window: int) -> torch.Tensor:
    """q [T, nq, hd]; k, v [past + T, nkv, hd]; sinks [nq] or None; window 0 (none) or w -> [T, nq, hd].
    Query i (position p = past + i) attends keys j with p - w < j <= p; with sinks, each head's softmax row gets the
    extra logit `sinks[h]`, whose probability is dropped (transformers' eager_attention_forward for gpt_oss)."""
    t, nq, hd = q.shape
    nkv = k.shape[1]
    r = nq // nkv
    out = torch.empty_like(q)
    keys = min(past + t, window + SINK_QUERY_BLOCK) if window else past + t   # a block's keys at most
    block = min(SINK_QUERY_BLOCK, max(16, SINK_SCORE_ELEMENTS // (nq * keys)))
    sink = None if sinks is None else sinks.view(nkv, r, 1, 1)                # head g * r + j -> [g, j]
    for a in range(0, t, block):
        b = min(t, a + block)
        n = b - a
        lo = max(0, past + a - window + 1) if window else 0          # first key any query of the block sees
        kb, vb = (x[lo:past + b].transpose(0, 1) for x in (k, v))    # [nkv, S, hd]: cache views, not expanded
        # the r query heads of a kv head folded into rows: [nkv, r * n, hd], row j * n + i = head g * r + j, token i
        qb = q[a:b].reshape(n, nkv, r, hd).permute(1, 2, 0, 3).reshape(nkv, r * n, hd)
        scores = (torch.matmul(qb, kb.transpose(1, 2)) * hd ** -0.5).view(nkv, r, n, -1)  # [nkv, r, n, S]
        qpos = torch.arange(past + a, past + b, device=q.device)[:, None]
        kpos = torch.arange(lo, past + b, device=q.device)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)              # [n, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        if sink is not None:
            scores = torch.cat([scores, sink.to(scores.dtype).expand(nkv, r, n, 1)], dim=-1)
        scores = scores - scores.amax(-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)[..., :kb.shape[1]]       # the sink's column dropped
        o = torch.matmul(probs.reshape(nkv, r * n, -1).to(vb.dtype), vb)                    # [nkv, r * n, hd]
        out[a:b] = o.view(nkv, r, n, hd).permute(2, 0, 1, 3).reshape(n, nq, hd)
    return out


def _cuda_flash_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, T, nq, hd], k, v [1, S, nkv, hd] (flash's layout; nkv divides nq: no kv copy) -> output [1, T, nq, hd],
    fp32 LSE [1, nq, >= T]. Causal, bottom-right aligned (query row i is position S - T + i and sees keys <= it);
    window w > 0: only keys j > position - w (flash's window_size_left = w - 1)."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False,
                                                  scale=scale, window_size_left=window - 1 if window else -1,
                                                  window_size_right=0)
    return out[0], out[1]


def sink_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, window: int,
               flash=_cuda_flash_local) -> torch.Tensor:
    """`sink_attention` (q [T, nq, hd], k, v [past + T, nkv, hd]) as one flash call: with S = exp(lse) the row's
    mass over its visible keys, the sink's softmax gives the keys S / (S + exp(sink)) of it, so the output is flash's
    output times sigmoid(lse - sink) (computed in fp32, rounded once, in place). `flash`: `_cuda_flash_local` or
    (tests) a stand-in with its contract."""
    t, nq, hd = q.shape
    o, lse = flash(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), window, hd ** -0.5)
    o = o[0]                                                               # [T, nq, hd]
    if sinks is not None:
        keep = torch.sigmoid(lse[0, :, :t].transpose(0, 1) - sinks.float())  # [T, nq] fp32
        o.mul_(keep.unsqueeze(-1))
    return o


# (device index, dtype, nq, nkv, hd, sinks?) -> whether `sink_flash` matched `sink_attention` on a probe.
_SINK_FLASH_OK: dict[tuple, bool] = {}
SINK_PROBE = (7, 13, 5)  # probe queries, past keys and window: the window cuts into the past, the chunk is not square


def _sink_flash_ok(q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor | None, flash=_cuda_flash_local) -> bool:
    """Once per device, dtype and geometry: `sink_flash` against `sink_attention` on a small random problem (a
    misaligned window, a refused dtype or head size, or an older torch without flash's window arguments turn it off
    for good, with a warning)."""
    nq, hd = q.shape[1:]
    nkv = k.shape[1]
    key = (q.device.index, q.dtype, nq, nkv, hd, sinks is not None)
    if key not in _SINK_FLASH_OK:
        t, past, window = SINK_PROBE
        g = torch.Generator(device=q.device).manual_seed(0)
        pq = torch.randn(t, nq, hd, device=q.device, generator=g).to(q.dtype)
        pk, pv = (torch.randn(past + t, nkv, hd, device=q.device, generator=g).to(q.dtype) for _ in range(2))
        ps = None if sinks is None else torch.randn(nq, device=q.device, generator=g).to(sinks.dtype)
        ref = [a.float() if a is not None else None for a in (pq, pk, pv, ps)]  # the reference in fp32
        try:
            ok = all(torch.allclose(sink_flash(pq, pk, pv, ps, w, flash).float(),
                                    sink_attention(ref[0], ref[1], ref[2], past, ref[3], w), atol=2e-2, rtol=2e-2)
                     for w in (window, 0))
            why = "it disagreed with the reference on a probe"
        except (RuntimeError, TypeError) as e:  # flash refused (dtype, head size, arch) or has no window arguments
            ok, why = False, f"{type(e).__name__}: {e}"[:200]
        if not ok:
            log.warning("attention with sinks / a window: flash attention off for %s, nq %d, hd %d (%s); the "
                        "blocked PyTorch path runs instead", q.dtype, nq, hd, why)
        _SINK_FLASH_OK[key] = ok
    return _SINK_FLASH_OK[key]
