"""Causal GQA attention over a per-sequence KV cache.

Fused projection rows `[q (nq·hd) | k (nkv·hd) | v (nkv·hd) | gate (nq·hd), only if gated]`, optional bias.
Per head: optional RMSNorm of q and k over head_dim (before RoPE), then (partial) RoPE. Each segment writes its k/v
rows into its cache at positions `[past, past + T)` and its queries attend to cache rows `[0, past + T)`, query i
seeing keys up to `past + i`. Gated attention multiplies the attention output by `sigmoid(gate)` before `o_proj`.
gpt_oss adds two things (`sink_attention.py`): per-head sinks (`sinks [nq]`, one more logit in each softmax row whose
probability is dropped) and, on `sliding_attention` layers, a window: query i sees keys `(past + i - window, past + i]`.
The cache still keeps every row (the window only masks). Their prefill takes one flash-attention call on CUDA
(`sink_attention.py`: the window is flash's local mask, the sink rescales the output by its log-sum-exp), the
blocked PyTorch reference elsewhere; their decode batches take the fused kernel like any other layer (it handles sinks
and the window).

Decode batches (`batch.decode`, one token per segment, `past` taken from `batch.positions`): with `_fused` set, one
Triton kernel (`gpu.kernels.decode_attention`) does norm + RoPE + the KV write and split-K attention over each
sequence's live rows only, finding buffers through `batch.tables` and lengths through `batch.positions` on the
device (CUDA-graph replayable). Without `_fused` (CPU), the eager per-segment path below is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ft.formats.config import ModelConfig
from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.batch import ForwardBatch
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.norm import RMSNorm
from ft.runtime.layers.rope import apply_rotary
from ft.runtime.layers.sink_attention import windowed_attention


class Attention(Op):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.qkv_proj = Linear()
        self.o_proj = Linear()
        if cfg.attn_qk_norm:
            self.q_norm = RMSNorm(cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.rms_norm_eps)
        if cfg.attn_sinks:
            self.sinks: torch.Tensor = REQUIRED            # [nq], compute dtype
        self._window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else 0
        self._eager = cfg.attn_sinks or self._window > 0  # prefill: sink_attention (decode: the fused kernel)
        self._layer = layer
        self._eps = cfg.rms_norm_eps
        self._nq, self._nkv, self._hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self._gated = cfg.attn_output_gate
        q_rows, kv_rows = self._nq * self._hd, self._nkv * self._hd
        self._split = [q_rows, kv_rows, kv_rows] + ([q_rows] if self._gated else [])

    @property
    def expected_rows(self) -> int:
        return sum(self._split)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]                                              # x [N, H]
        qkv = self.qkv_proj(x)                                      # [N, rows]
        if batch.decode and self._fused:
            return self.o_proj(self._fused_decode(qkv, batch))
        parts = qkv.split(self._split, dim=-1)
        q = parts[0].reshape(n, self._nq, self._hd)
        k = parts[1].reshape(n, self._nkv, self._hd)
        v = parts[2].reshape(n, self._nkv, self._hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = batch.rope["cos"], batch.rope["sin"]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        out = torch.empty_like(q)                                   # [N, nq, hd]
        pasts = batch.positions.tolist() if batch.decode else None  # reference decode: positions on the host
        for seg in batch.segments:
            k_cache, v_cache = seg.state.kv[self._layer]            # [capacity, nkv, hd] each
            past = pasts[seg.start] if batch.decode else seg.past
            end = past + seg.num_tokens
            k_cache[past:end] = k[seg.rows]
            v_cache[past:end] = v[seg.rows]
            if self._eager:
                out[seg.rows] = windowed_attention(q[seg.rows], k_cache[:end], v_cache[:end], past,
                                                   getattr(self, "sinks", None), self._window)
            else:
                out[seg.rows] = causal_attention(q[seg.rows], k_cache[:end], v_cache[:end], past)
        out = out.reshape(n, self._nq * self._hd)
        if self._gated:
            out = out * torch.sigmoid(parts[3])
        return self.o_proj(out)

    def _fused_decode(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """qkv [B, rows] of a decode batch -> attention output [B, nq·hd] (gated), via the one decode kernel."""
        from ft.runtime.gpu.kernels.decode_attention import decode_attention

        norm = hasattr(self, "q_norm")
        return decode_attention(qkv, self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                                self._eps, batch.rope["cos"], batch.rope["sin"], batch.tables[self._layer],
                                batch.positions, nq=self._nq, nkv=self._nkv, hd=self._hd, scale=self._hd ** -0.5,
                                gated=self._gated, sinks=getattr(self, "sinks", None), window=self._window)


# Not cuDNN: its SDPA builds an execution plan per new key length, i.e. at every decode step (63 ms of host time per
# call on an H200 with torch 2.11, against ~0.1 ms for flash / memory-efficient attention).
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q [T, nq, hd]; k, v [past + T, nkv, hd] -> [T, nq, hd]; query i attends keys 0..past+i."""
    if q.is_cuda:
        if past > 0 and q.shape[0] > 1:
            o = _chunked_flash(q, k, v, past)
            if o is not None:
                return o
        with sdpa_kernel(_BACKENDS):
            return _sdpa(q, k, v, past)
    return _sdpa(q, k, v, past)


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


MERGE_BLOCK_BYTES = 16 << 20  # fp32 bytes per temporary of `merge_attention` (it runs over o's rows in blocks)


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Combine attention over two disjoint key sets: o [..., hd] with its log-sum-exp lse [...] (natural log of
    sum(exp(scale·q·k)) over that part's keys) -> attention over the union, computed in fp32, written into `out`
    (default: a new tensor like o1; `out` may be o1 itself).

    o = (o1·e^(lse1-m) + o2·e^(lse2-m)) / (e^(lse1-m) + e^(lse2-m)), m = max(lse1, lse2); the weights are written
    as sigmoid(±(lse1 - lse2)), the same quantity, stable for any gap. Each part must have at least one key per row
    (finite lse). Blocks of o's first dimension keep the fp32 temporaries under MERGE_BLOCK_BYTES each: a 4096-token
    prefill chunk's [T, nq, hd] in fp32 is 64 MiB at 32 x 128, more than the activation reserve allows for it."""
    out = torch.empty_like(o1) if out is None else out
    rows = max(1, MERGE_BLOCK_BYTES // (4 * max(1, o1[:1].numel())))
    for a in range(0, o1.shape[0], rows):
        b = slice(a, a + rows)
        d = (lse1[b].float() - lse2[b].float()).unsqueeze(-1)
        acc = o1[b] * torch.sigmoid(d)                  # fp32 (type promotion); a new tensor even when o1 is fp32
        out[b] = acc.add_(o2[b] * torch.sigmoid(-d))
    return out


# (device index, dtype, head_dim) -> False once flash attention refused it; then the masked SDPA path is used.
_FLASH_OK: dict[tuple, bool] = {}


def _chunked_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor | None:
    """Chunked-prefill attention (past > 0, T > 1) on CUDA as two flash-attention calls merged by their LSE: the
    T queries against the past keys [0, past) with no mask, and against their own keys [past, past + T) with a
    (square) causal mask. None when flash attention does not take these inputs (dtype, head_dim, GPU)."""
    key = (q.device.index, q.dtype, q.shape[-1])
    if not _FLASH_OK.get(key, True):
        return None
    try:
        o = _flash_split(q, k, v, past)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:                                    # flash attention's own checks (dtype, head_dim, arch)
        _FLASH_OK[key] = False
        return None
    _FLASH_OK[key] = True
    return o


def _cuda_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Lq, hd], k, v [B, H, Lk, hd] (same H) -> output [B, H, Lq, hd], fp32 LSE [B, H, Lq] (natural log of
    sum over keys of exp(scale·q·k)). Causal is top-left aligned. Raises RuntimeError where flash can't run."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _flash_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, flash=_cuda_flash) -> torch.Tensor:
    """The two-part computation of `_chunked_flash`; `flash` is `_cuda_flash` or (tests) a stand-in with its
    contract."""
    t, nq, hd = q.shape
    nkv = k.shape[1]
    r = nq // nkv
    scale = hd ** -0.5
    # Past part, no mask: fold the r query heads of each kv head into the query length, [1, nkv, r·T, hd] (row
    # j·T + i is head g·r + j, token i), against [1, nkv, past, hd] cache views (no kv copy).
    qp = q.reshape(t, nkv, r, hd).permute(1, 2, 0, 3).reshape(1, nkv, r * t, hd)
    kp, vp = (a[:past].transpose(0, 1).unsqueeze(0) for a in (k, v))
    o1, lse1 = flash(qp, kp, vp, False, scale)                           # [1, nkv, r·T, hd], [1, nkv, r·T]
    del qp  # each [T, nq, hd] copy freed once used: the activation reserve (`sizing.activation_reserve`) counts 6
    o1 = o1[0].reshape(nkv, r, t, hd).permute(2, 0, 1, 3).reshape(t, nq, hd)
    lse1 = lse1[0, :, :r * t].reshape(nkv, r, t).permute(2, 0, 1).reshape(t, nq)
    # Own part, causal (T x T, so top-left = bottom-right alignment): kv heads expanded to nq (T rows only).
    qc = q.transpose(0, 1).unsqueeze(0)                                   # [1, nq, T, hd]
    kc, vc = (a[past:past + t].repeat_interleave(r, dim=1).transpose(0, 1).unsqueeze(0) for a in (k, v))
    o2, lse2 = flash(qc, kc, vc, True, scale)                            # [1, nq, T, hd], [1, nq, T]
    del kc, vc
    return merge_attention(o1, lse1, o2[0].transpose(0, 1), lse2[0, :, :t].transpose(0, 1), out=o1)
