"""Full-attention decode: two fused Triton kernels per layer (prep, then one attention launch) that read only each
sequence's live KV rows.

A decode batch (runtime/layers/batch.py) holds B sequences with one token each. This layer's `tables` [2, B] int64
gives sequence b's k / v buffer addresses (each [capacity, nkv, hd] contiguous, compute dtype; row p at
+ p * nkv * hd elements) and `positions` [B] int64 its token's position p_b. Grids depend on (B, nq, nkv, S) only and
every address and length is read on the device, so a captured CUDA graph replays any step of any set of sequences.

1. `prep_decode`, grid (B, nq + nkv), one head per program, from qkv [B, (nq + 2 nkv [+ nq gate]) * hd]:
     q_h = rope(norm_q(q_h)) -> q [B, nq, hd];   k_g = rope(norm_k(k_g)), v_g -> row p_b of sequence b's buffers.
   norm(x) = (w * x * rsqrt(mean(x^2) + eps)) in fp32, cast to the compute dtype (layers/norm.py RMSNorm).
   rope(x)_i = x_i cos_i + rot(x)_i sin_i for i < rd = cos.shape[1], rot = rotate_half (-x_{i+rd/2} for i < rd/2,
   x_{i-rd/2} after); dims >= rd pass through. Each product and the sum are rounded to the compute dtype, as
   layers/rope.py `apply_rotary` does in torch. The gate rows stay in qkv.
2. `decode_attention`: split-K flash decoding over keys 0..p_b (GQA: q head h reads kv head h // r, r = nq / nkv),
   one kernel, grid (S, B * nkv). Program (s, b, g) covers keys [s c, min((s + 1) c, p_b + 1)) with
   c = max(cdiv(cdiv(p_b + 1, S), BLOCK_N) * BLOCK_N, min_chunk), for the r query heads of kv head g at once (one
   [R, hd] x [hd, BLOCK_N] tl.dot, R = r padded to >= 16 rows), so each key block is read once per kv head. Splits
   s >= cdiv(p_b + 1, c) are empty and do nothing but count themselves in (below): short contexts cost little.
   Online softmax in fp32 in base 2 (scores times scale * log2 e); a non-empty split writes the partial
   o_s = sum_j 2^(x_j - m) v_j / l (fp32 [r, hd]) and lse_s = m + log2 l to scratch.
   Last block reduces: after its stores (a CTA barrier, then thread 0's acq_rel gpu-scope atomic) each program
   increments counter[b, g]; the one that reads S - 1 is the last, its acquire makes every partial visible, and it
   merges them: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s over the live splits (split 0
   always holds key 0, so M is finite), loading [CB, r, hd] partials per step; cast to the compute dtype; with a
   gate, times sigmoid(gate) rounded to the compute dtype and the product rounded again (the torch path's
   `out * torch.sigmoid(gate)`). It then sets counter[b, g] back to 0, so the module-level zeroed counter buffer
   (`_counters`) is ready for the next call, graph replays included.
   Work per step: O(p_b) KV rows per sequence, plus O(B nq S hd) fp32 partials; never O(capacity).
S (splits) comes from the SM count so that B * nkv * S programs fill the GPU (`CONFIG`), a function of shapes only.

Dots run on bf16 tensor cores with fp32 accumulation; probabilities enter the P V dot rounded to the compute dtype
(the usual flash-attention trade). fp32 inputs (CPU tests) and Triton's CPU interpreter (which mis-multiplies bf16
dots) use exact fp32 dots instead. The references below are plain per-sequence torch loops over explicit buffers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ft.runtime.layers.norm import rms_normalize
from ft.runtime.layers.rope import apply_rotary

# Tiles per head_dim ("default" for others), programs per SM that pick S, and bounds on S. Swept by
# tools/bench_attention.py on the H200.
CONFIG = {
    "tiles": {128: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
              256: {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
              "default": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}},
    "programs_per_sm": 1, "min_splits": 1, "max_splits": 64,
    "prep_warps": 1,
    # keys per split at least this (rounded up to BLOCK_N; 0 = just cdiv(length, S)): fewer live splits, fewer
    # partials to merge; fp32 elements the merging program loads per step ([CB, r, hd]); smallest counter buffer
    "min_chunk": 0, "combine_elems": 8192, "min_counters": 1024,
}
_SMS: dict[int, int] = {}
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


@triton.jit
def _prep_kernel(qkv, row_stride, q_out, qw, kw, eps, cos, sin, cs_stride, tables, tab_s0, tab_s1, positions,
                 NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr, BLOCK_D: tl.constexpr,
                 Q_NORM: tl.constexpr, K_NORM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)                     # < NQ: q head h; else kv head h - NQ (k at the same offset h * HD)
    dt = q_out.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    HALF: tl.constexpr = RD // 2
    partner = tl.where(d < HALF, d + HALF, d - HALF)          # rotate_half partner of dim d < RD
    pm = d < RD
    row = qkv + b.to(tl.int64) * row_stride + h * HD
    x = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=pm, other=0.0).to(tl.float32)
    is_q = h < NQ
    if Q_NORM or K_NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
        w = tl.full((BLOCK_D,), 1.0, tl.float32)
        wp = tl.full((BLOCK_D,), 1.0, tl.float32)
        if Q_NORM:
            w = tl.where(is_q, tl.load(qw + d, mask=dm, other=0.0), w)
            wp = tl.where(is_q, tl.load(qw + partner, mask=pm, other=0.0), wp)
        if K_NORM:
            w = tl.where(is_q, w, tl.load(kw + d, mask=dm, other=0.0))
            wp = tl.where(is_q, wp, tl.load(kw + partner, mask=pm, other=0.0))
        if Q_NORM and K_NORM:
            normed = h >= 0
        elif Q_NORM:
            normed = is_q
        else:
            normed = h >= NQ
        x = tl.where(normed, (x * rstd * w).to(dt).to(tl.float32), x)
        xp = tl.where(normed, (xp * rstd * wp).to(dt).to(tl.float32), xp)
    y = x
    if RD > 0:
        c = tl.load(cos + b.to(tl.int64) * cs_stride + d, mask=pm, other=0.0).to(tl.float32)
        s = tl.load(sin + b.to(tl.int64) * cs_stride + d, mask=pm, other=0.0).to(tl.float32)
        rot = tl.where(d < HALF, -xp, xp)
        ry = (x * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)
        y = tl.where(pm, ry, x)
    if h < NQ:
        tl.store(q_out + (b.to(tl.int64) * NQ + h) * HD + d, y.to(dt), mask=dm)
    else:
        g = h - NQ
        pos = tl.load(positions + b)
        kbuf = tl.load(tables + b * tab_s1).to(tl.int64).to(tl.pointer_type(dt))
        vbuf = tl.load(tables + tab_s0 + b * tab_s1).to(tl.int64).to(tl.pointer_type(dt))
        off = (pos.to(tl.int64) * NKV + g) * HD + d
        tl.store(kbuf + off, y.to(dt), mask=dm)
        tl.store(vbuf + off, tl.load(row + NKV * HD + d, mask=dm), mask=dm)


@triton.jit
def _decode_kernel(q, tables, tab_s0, tab_s1, positions, o_part, lse_part, counters, out, gate, gate_stride,
                   qk_scale,
                   NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                   R2: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   MIN_CHUNK: tl.constexpr, CB: tl.constexpr, GATE: tl.constexpr, DOT_F32: tl.constexpr):
    s = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // NKV
    g = bg % NKV
    dt = q.dtype.element_ty
    length = (tl.load(positions + b) + 1).to(tl.int32)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(length, S), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = s * chunk
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    base = bg.to(tl.int64) * S                                  # partial row (bg * S + s) * R + head-in-group
    # The buffer addresses don't depend on the position: load them alongside it (one round trip, not two).
    kaddr = tl.load(tables + b * tab_s1)
    vaddr = tl.load(tables + tab_s0 + b * tab_s1)
    if start < length:                                          # an empty split only counts itself in (below)
        end = tl.minimum(start + chunk, length)
        rows = tl.arange(0, R_PAD)                              # query heads g*R + rows, rows >= R are padding
        rm = rows < R
        heads = (b * NQ + g * R + rows).to(tl.int64)
        qt = tl.load(q + heads[:, None] * HD + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)  # [R_PAD, BD]
        kbuf = kaddr.to(tl.int64).to(tl.pointer_type(dt))
        vbuf = vaddr.to(tl.int64).to(tl.pointer_type(dt))
        m = tl.full((R_PAD,), float("-inf"), tl.float32)
        l = tl.zeros((R_PAD,), tl.float32)
        acc = tl.zeros((R_PAD, BLOCK_D), tl.float32)
        n = tl.arange(0, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + n
            km = keys < end
            off = (keys.to(tl.int64) * NKV + g)[:, None] * HD + d[None, :]                    # [BN, BD]
            kt = tl.load(kbuf + off, mask=km[:, None] & dm[None, :], other=0.0)
            vt = tl.load(vbuf + off, mask=km[:, None] & dm[None, :], other=0.0)
            if DOT_F32:
                x = tl.dot(qt.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                x = tl.dot(qt, tl.trans(kt))
            x = tl.where(km[None, :], x * qk_scale, float("-inf"))                            # [R_PAD, BN]
            m_new = tl.maximum(m, tl.max(x, axis=1))            # finite: every block holds a live key
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(x - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(dt), vt)
            acc = acc * alpha[:, None] + pv
            m = m_new
        part = (base + s) * R + rows                            # l > 0 on every row: the split holds a live key
        tl.store(o_part + part[:, None] * HD + d[None, :], acc / l[:, None], mask=rm[:, None] & dm[None, :])
        tl.store(lse_part + part, m + tl.log2(l), mask=rm)
    # Last block reduces: every program of (b, g) counts itself in; the barrier orders all of this CTA's partial
    # stores before the (thread-0) release of the atomic, and the one that sees S - 1 acquires them all.
    tl.debug_barrier()
    count = tl.atomic_add(counters + bg, 1, sem="acq_rel", scope="gpu")
    if count == S - 1:
        n_live = tl.cdiv(length, chunk)                         # splits 0 .. n_live - 1 wrote partials
        r2 = tl.arange(0, R2)
        r2m = r2 < R
        sp = tl.arange(0, S)
        lse = tl.load(lse_part + (base + sp)[:, None] * R + r2[None, :], mask=(sp < n_live)[:, None] & r2m[None, :],
                      other=float("-inf"), cache_modifier=".cg")                               # [S, R2]
        big_m = tl.where(r2m, tl.max(lse, axis=0), 0.0)         # split 0 holds key 0: finite on real rows
        den = tl.where(r2m, tl.sum(tl.exp2(lse - big_m[None, :]), axis=0), 1.0)
        om = r2m[:, None] & dm[None, :]
        if GATE:                                                # loaded before the partials' loop, not after
            gt = tl.load(gate + b.to(tl.int64) * gate_stride + (g * R + r2)[:, None] * HD + d[None, :], mask=om,
                         other=0.0).to(tl.float32)
        acc = tl.zeros((CB, R2, BLOCK_D), tl.float32)          # summed over its CB axis once, after the loop
        for s0 in range(0, n_live, CB):                         # CB splits x R heads x hd per load
            sc = s0 + tl.arange(0, CB)
            pm = (sc < n_live)[:, None] & r2m[None, :]
            idx = (base + sc)[:, None] * R + r2[None, :]                                       # [CB, R2]
            w = tl.exp2(tl.load(lse_part + idx, mask=pm, other=float("-inf"), cache_modifier=".cg")
                        - big_m[None, :])
            o = tl.load(o_part + idx[:, :, None] * HD + d[None, None, :], mask=pm[:, :, None] & dm[None, None, :],
                        other=0.0, cache_modifier=".cg")                                        # [CB, R2, BD]
            acc += w[:, :, None] * o
        y = (tl.sum(acc, axis=0) / den[:, None]).to(dt)
        heads2 = (b * NQ + g * R + r2).to(tl.int64)
        if GATE:
            sg = (1.0 / (1.0 + tl.exp(-gt))).to(dt).to(tl.float32)
            y = (y.to(tl.float32) * sg).to(dt)
        tl.store(out + heads2[:, None] * HD + d[None, :], y, mask=om)
        tl.store(counters + bg, 0)                              # ready for the next call (next kernel on the stream)


def prep_decode(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                cos: torch.Tensor | None, sin: torch.Tensor | None, tables: torch.Tensor, positions: torch.Tensor,
                *, nq: int, nkv: int, hd: int) -> torch.Tensor:
    """qkv [B, rows] (rows = [q | k | v | gate?], unit column stride); q_norm / k_norm fp32 [hd] or None; cos / sin
    [B, rd] or None; tables int64 [2, B]; positions int64 [B] -> q [B, nq, hd] (module docstring, kernel 1). Writes k
    and v at row positions[b] of sequence b's buffers."""
    B = qkv.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] >= (nq + 2 * nkv) * hd, (qkv.shape, nq, nkv, hd)
    q = torch.empty(B, nq, hd, dtype=qkv.dtype, device=qkv.device)
    rd = 0 if cos is None else cos.shape[1]
    if rd:
        assert cos.shape == sin.shape == (B, rd) and cos.stride(1) == sin.stride(1) == 1 and rd % 2 == 0
        assert sin.stride(0) == cos.stride(0)
    _prep_kernel[(B, nq + nkv)](
        qkv, qkv.stride(0), q, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, float(eps),
        qkv if cos is None else cos, qkv if sin is None else sin, 0 if cos is None else cos.stride(0),
        tables, tables.stride(0), tables.stride(1), positions,
        NQ=nq, NKV=nkv, HD=hd, RD=rd, BLOCK_D=triton.next_power_of_2(hd),
        Q_NORM=q_norm is not None, K_NORM=k_norm is not None, num_warps=CONFIG["prep_warps"])
    return q


def num_splits(batch: int, nkv: int, device: torch.device) -> int:
    """S for a decode batch: a power of two with batch * nkv * S >= programs_per_sm * SMs, within the CONFIG bounds
    (a function of shapes and the device only, so fixed per captured graph)."""
    if device.type != "cuda":
        sms = 4
    else:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SMS:
            _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        sms = _SMS[idx]
    want = triton.cdiv(CONFIG["programs_per_sm"] * sms, batch * nkv)
    return max(CONFIG["min_splits"], min(CONFIG["max_splits"], triton.next_power_of_2(want)))


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 [>= n] counter buffer for `device`, one per (device, size), kept for the process lifetime: every
    call leaves it zeroed again, so CUDA graphs that captured it replay with no reset of their own. Sized to a power
    of two >= CONFIG["min_counters"], so growing the batch rarely allocates a new one (that happens at capture)."""
    size = max(CONFIG["min_counters"], triton.next_power_of_2(n))
    key = (str(device), size)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


def decode_attention(q: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, *, nkv: int, scale: float,
                     gate: torch.Tensor | None = None, splits: int | None = None,
                     tile: dict | None = None) -> torch.Tensor:
    """q [B, nq, hd] (contiguous); tables int64 [2, B]; positions int64 [B]; gate [B, nq * hd] (unit column stride)
    or None -> out [B, nq * hd] in q's dtype (module docstring, kernel 2). `splits` (a power of two) and `tile`
    ({BLOCK_N, num_warps, num_stages[, min_chunk]}) override `num_splits` and CONFIG (tests, benchmark sweeps).
    One launch; it uses a module-level counter buffer (`_counters`), so calls on one device must not run
    concurrently on different streams."""
    B, nq, hd = q.shape
    assert q.is_contiguous() and nq % nkv == 0, (q.shape, nkv)
    r = nq // nkv
    S = splits or num_splits(B, nkv, q.device)
    assert S & (S - 1) == 0, S
    t = tile or CONFIG["tiles"].get(hd, CONFIG["tiles"]["default"])
    bn = t["BLOCK_N"]
    min_chunk = t.get("min_chunk", CONFIG["min_chunk"])
    min_chunk = triton.cdiv(min_chunk, bn) * bn                 # a multiple of BLOCK_N (0: cdiv(length, S) rounded)
    bd = triton.next_power_of_2(hd)
    r2 = triton.next_power_of_2(r)
    cb = max(1, min(S, CONFIG["combine_elems"] // (r2 * bd)))
    o_part = torch.empty(B * nkv * S * r, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(B * nkv * S * r, dtype=torch.float32, device=q.device)
    out = torch.empty(B, nq * hd, dtype=q.dtype, device=q.device)
    if gate is not None:
        assert gate.shape == (B, nq * hd) and gate.stride(1) == 1, gate.shape
    _decode_kernel[(S, B * nkv)](
        q, tables, tables.stride(0), tables.stride(1), positions, o_part, lse, _counters(B * nkv, q.device), out,
        out if gate is None else gate, 0 if gate is None else gate.stride(0), float(scale) * math.log2(math.e),
        NQ=nq, NKV=nkv, HD=hd, R=r, R_PAD=max(16, r2), R2=r2, S=S, BLOCK_N=bn, BLOCK_D=bd, MIN_CHUNK=min_chunk,
        CB=cb, GATE=gate is not None, DOT_F32=q.dtype == torch.float32 or not q.is_cuda,
        num_warps=t["num_warps"], num_stages=t["num_stages"])
    return out


def prep_decode_ref(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, kv: list[tuple[torch.Tensor, torch.Tensor]],
                    positions: torch.Tensor, *, nq: int, nkv: int, hd: int) -> torch.Tensor:
    """Torch reference of `prep_decode`, with kv[b] = sequence b's (k, v) buffers in place of `tables`."""
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
    for b, p in enumerate(positions.tolist()):
        kv[b][0][p] = k[b]
        kv[b][1][p] = v[b]
    return q.contiguous()


def decode_attention_ref(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, *,
                         nkv: int, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `decode_attention` (fp32 softmax attention per sequence over rows 0..positions[b])."""
    B, nq, hd = q.shape
    r = nq // nkv
    out = torch.empty(B, nq * hd, dtype=q.dtype, device=q.device)
    for b, p in enumerate(positions.tolist()):
        k, v = (t[: p + 1].float().repeat_interleave(r, dim=1) for t in kv[b])      # [p + 1, nq, hd]
        w = (torch.einsum("hd,lhd->hl", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", w, v).reshape(-1).to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate)
