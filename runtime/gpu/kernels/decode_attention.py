"""Full-attention decode: one fused Triton kernel per layer (q/k norm + RoPE + KV write + split-K attention) that
reads only each sequence's live KV rows.

A decode batch (runtime/layers/batch.py) holds B sequences with one token each. This layer's `tables` [2, B] int64
gives sequence b's k / v buffer addresses (each [capacity, nkv, hd] contiguous, compute dtype; row p at
+ p * nkv * hd elements) and `positions` [B] int64 its token's position p_b. The grid depends on (B, nq, nkv, S) only
and every address and length is read on the device, so a captured CUDA graph replays any step of any set of sequences.

`decode_attention`, grid (S, B * nkv), from qkv [B, (nq + 2 nkv [+ nq gate]) * hd]: split-K flash decoding over keys
lo..p_b (lo = 0, or on a sliding-window layer max(0, p_b + 1 - window); GQA: q head h reads kv head h // r,
r = nq / nkv). Program (s, b, g) covers keys [lo + s c, min(lo + (s + 1) c, n)) with n = p_b + 1 and
c = max(cdiv(cdiv(n - lo, S), BLOCK_N) * BLOCK_N, min_chunk), for the r query heads of kv head g at once (one
[R, hd] x [hd, BLOCK_N] tl.dot, R = r padded to >= 16 rows), so each key block is read once per kv head.
Splits s >= n_live = cdiv(n - lo, c) are empty: they do nothing but, when n_live > 1, count themselves in (below).
1. Prep, in registers. Every program computes its own q tile, q_h = rope(norm_q(q_h)) (redundant across splits,
   cheap; its loads go out with the position's). The one holding key p_b (s = n_live - 1) first writes
   k_g = rope(norm_k(k_g)) and v_g to row p_b of sequence b's buffers, then a CTA barrier (a CTA's global stores are
   visible to its own threads after it), so its key loop reads that row like any other; no other program reads it.
   norm(x) = (w * x * rsqrt(mean(x^2) + eps)) in fp32, cast to the compute dtype (layers/norm.py RMSNorm).
   rope(x)_i = x_i cos_i + rot(x)_i sin_i for i < rd = cos.shape[1], rot = rotate_half (-x_{i+rd/2} for i < rd/2,
   x_{i-rd/2} after); dims >= rd pass through. Each product and the sum are rounded to the compute dtype, as
   layers/rope.py `apply_rotary` does in torch.
2. Online softmax in fp32 in base 2 (scores times scale * log2 e): o_s = sum_j 2^(x_j - m) v_j / l,
   lse_s = m + log2 l.
3. Finish: out = o cast to the compute dtype; with a gate (the last nq * hd columns of qkv), times sigmoid(gate)
   rounded to the compute dtype and the product rounded again (the torch path's `out * torch.sigmoid(gate)`).
   n_live == 1 (n <= c: short contexts): program 0 finishes alone from its registers; no counter, no partials.
   n_live > 1: live splits write o_s (fp32 [r, hd]) and lse_s to scratch, and the last block reduces: after its
   stores (a CTA barrier, then thread 0's acq_rel gpu-scope atomic) each program increments counter[b, g]; the one
   that reads S - 1 is the last, its acquire makes every partial visible, and it merges them:
   o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s over the live splits (split 0 always holds key
   lo, so M is finite), loading [CB, r, hd] partials per step. It then sets counter[b, g] back to 0, so the
   module-level zeroed counter buffer (`_counters`) is ready for the next call, graph replays included.
   Sinks (gpt_oss): head h's sink logit joins the softmax denominator only, as 2^(sink_h log2 e - m) (or - M in the
   merge), so its probability is dropped as in `layers.sink_attention.sink_attention`.
   Work per step: O(p_b - lo) KV rows per sequence, plus O(B nq S hd) fp32 partials; never O(capacity).
S (splits) comes from the SM count so that B * nkv * S programs fill the GPU (`CONFIG`), a function of shapes only.

Dots run on bf16 tensor cores with fp32 accumulation; probabilities enter the P V dot rounded to the compute dtype
(the usual flash-attention trade). fp32 inputs (CPU tests) and Triton's CPU interpreter (which mis-multiplies bf16
dots) use exact fp32 dots instead; there (bf16) RNE_BITS rounds to nearest even before each cast, which the
interpreter truncates. The reference (`decode_attention_ref.py`) is a plain per-sequence torch loop over explicit
buffers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_wait
from ft.runtime.gpu.kernels.fused_ops import _cast, _rne_bits

# Tiles per head_dim ("default" for others), programs per SM that pick S, and bounds on S. Swept by
# tools/bench_attention.py on the H200.
CONFIG = {
    "tiles": {128: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
              256: {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
              "default": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}},
    "programs_per_sm": 1, "min_splits": 1, "max_splits": 64,
    # keys per split at least this (rounded up to BLOCK_N; 0 = just cdiv(length, S)): fewer live splits, fewer
    # partials to merge; fp32 elements the merging program loads per step ([CB, r, hd]); smallest counter buffer
    "min_chunk": 0, "combine_elems": 8192, "min_counters": 1024,
}
_SMS: dict[int, int] = {}
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


@triton.jit
def _load_head(head, hm, w, cos_row, sin_row, NORM: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """`_norm_rope`'s loads, apart from its math so that they all go out at once (before the norm's reduction).
    head [M, 1]: pointers to M heads' first dims in a qkv row, hm [M, 1] their mask; w the norm weight [HD] (NORM);
    cos_row / sin_row [RD] -> x fp32 [M, BLOCK_D], its rotate_half partners xp, w at d and at the partner, cos, sin
    (fp32 [1, BLOCK_D]; placeholders where unused)."""
    d = tl.arange(0, BLOCK_D)[None, :]
    x = tl.load(head + d, mask=hm & (d < HD), other=0.0).to(tl.float32)
    xp, wd, wp, c, sn = x, 1.0, 1.0, 1.0, 0.0
    if NORM:
        wd = tl.load(w + d, mask=d < HD, other=0.0)
    if RD > 0:
        HALF: tl.constexpr = RD // 2
        partner = tl.where(d < HALF, d + HALF, d - HALF)        # the partner of dim d < RD
        pm = d < RD
        xp = tl.load(head + partner, mask=hm & pm, other=0.0).to(tl.float32)
        c = tl.load(cos_row + d, mask=pm, other=0.0).to(tl.float32)
        sn = tl.load(sin_row + d, mask=pm, other=0.0).to(tl.float32)
        if NORM:
            wp = tl.load(w + partner, mask=pm, other=0.0)
    return x, xp, wd, wp, c, sn


@triton.jit
def _norm_rope(x, xp, wd, wp, c, sn, eps, dt: tl.constexpr, NORM: tl.constexpr, HD: tl.constexpr,
               RD: tl.constexpr, BLOCK_D: tl.constexpr, RNE_BITS: tl.constexpr):
    """rope(norm(x)) [M, BLOCK_D] in the compute dtype dt (step 1), from `_load_head`'s loads."""
    d = tl.arange(0, BLOCK_D)[None, :]
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HD + eps)[:, None]
        x = _cast(x * rstd * wd, dt, RNE_BITS).to(tl.float32)
        xp = _cast(xp * rstd * wp, dt, RNE_BITS).to(tl.float32)
    if RD > 0:
        rot = tl.where(d < RD // 2, -xp, xp)
        y = _cast(x * c, dt, RNE_BITS).to(tl.float32) + _cast(rot * sn, dt, RNE_BITS).to(tl.float32)
        x = tl.where(d < RD, y, x)
    return _cast(x, dt, RNE_BITS)


@triton.jit
def _finish(o, gt, out, heads, hm, d, HD: tl.constexpr, GATE: tl.constexpr, RNE_BITS: tl.constexpr):
    """o fp32 [M, BLOCK_D]: the attention of query heads `heads` [M] (mask hm) of one sequence, gt their gate (fp32,
    used when GATE); out points at that sequence's output row -> stores the gated output (step 3)."""
    dt = out.dtype.element_ty
    y = _cast(o, dt, RNE_BITS)
    if GATE:
        y = _cast(y.to(tl.float32) * _cast(1.0 / (1.0 + tl.exp(-gt)), dt, RNE_BITS).to(tl.float32), dt, RNE_BITS)
    tl.store(out + heads[:, None] * HD + d[None, :], y, mask=hm[:, None] & (d < HD)[None, :])


@triton.jit
def _decode_kernel(qkv, row_stride, gate_off, qw, kw, eps, cos, sin, cs_stride, tables, tab_s0, tab_s1, positions,
                   o_part, lse_part, counters, out, qk_scale, sinks,
                   NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr, R: tl.constexpr,
                   R_PAD: tl.constexpr, R2: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, MIN_CHUNK: tl.constexpr, CB: tl.constexpr, Q_NORM: tl.constexpr,
                   K_NORM: tl.constexpr, GATE: tl.constexpr, DOT_F32: tl.constexpr, RNE_BITS: tl.constexpr,
                   PDL: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr):
    pdl_wait(PDL)
    s = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // NKV
    g = bg % NKV
    dt = qkv.dtype.element_ty
    # The q prep doesn't depend on p_b: its loads go out with the position's and the buffer addresses' (one round
    # trip, not two), and every program computes its q tile (empty splits too: none waits on the position first).
    pos = tl.load(positions + b)
    kbuf = tl.load(tables + b * tab_s1).to(tl.pointer_type(dt))
    vbuf = tl.load(tables + tab_s0 + b * tab_s1).to(tl.pointer_type(dt))
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    row = qkv + b.to(tl.int64) * row_stride                     # this token's [q | k | v | gate] row
    cos_row = cos + b.to(tl.int64) * cs_stride
    sin_row = sin + b.to(tl.int64) * cs_stride
    rows = tl.arange(0, R_PAD)                                  # query heads g*R + rows, rows >= R are padding
    rm = rows < R
    heads = g * R + rows
    qx, qxp, qwd, qwp, c, sn = _load_head(row + (heads * HD)[:, None], rm[:, None], qw, cos_row, sin_row,
                                          Q_NORM, HD, RD, BLOCK_D)
    if GATE:    # for split 0, the only one that may finish alone (below)
        gt = tl.load(row + gate_off + heads[:, None] * HD + d[None, :],
                     mask=(rows < tl.where(s == 0, R, 0))[:, None] & dm[None, :], other=0.0).to(tl.float32)
    else:
        gt = 0.0
    qt = _norm_rope(qx, qxp, qwd, qwp, c, sn, eps, dt, Q_NORM, HD, RD, BLOCK_D, RNE_BITS)   # [R_PAD, BD]
    length = (pos + 1).to(tl.int32)
    if WINDOW > 0:                                              # keys (p_b - WINDOW, p_b]
        lo = tl.maximum(length - WINDOW, 0)
    else:
        lo = length * 0
    if SINKS:                                                   # each head's sink logit, in base 2 (-inf: padding)
        sink = tl.load(sinks + heads, mask=rm, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    else:
        sink = tl.full((R_PAD,), float("-inf"), tl.float32)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(length - lo, S), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    n_live = tl.cdiv(length - lo, chunk)                        # splits 0 .. n_live - 1 hold keys
    start = lo + s * chunk
    out_row = out + b.to(tl.int64) * NQ * HD
    base = bg.to(tl.int64) * S                                  # partial row (bg * S + s) * R + head-in-group
    if start < length:
        if s == n_live - 1:                                     # holds key p_b: write its k and v first
            kx, kxp, kwd, kwp, c, sn = _load_head(row + (NQ + g) * HD + tl.zeros((1, 1), tl.int32),
                                                  tl.arange(0, 1)[:, None] < 1, kw, cos_row, sin_row,
                                                  K_NORM, HD, RD, BLOCK_D)
            v_new = tl.load(row + (NQ + NKV + g) * HD + d, mask=dm)
            k_new = _norm_rope(kx, kxp, kwd, kwp, c, sn, eps, dt, K_NORM, HD, RD, BLOCK_D, RNE_BITS)  # [1, BD]
            at = (pos * NKV + g) * HD + d
            tl.store(kbuf + at[None, :], k_new, mask=dm[None, :])
            tl.store(vbuf + at, v_new, mask=dm)
            tl.debug_barrier()                                  # the key loop below reads row p_b back
        end = tl.minimum(start + chunk, length)
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
        if n_live == 1:                                         # the sink joins the denominator only
            _finish(acc / (l + tl.exp2(sink - m))[:, None], gt, out_row, heads, rm, d, HD, GATE, RNE_BITS)
        else:
            part = (base + s) * R + rows
            o = acc / l[:, None]                                # l > 0 on every row: the split holds a live key
            tl.store(o_part + part[:, None] * HD + d[None, :], o, mask=rm[:, None] & dm[None, :])
            tl.store(lse_part + part, m + tl.log2(l), mask=rm)
    if n_live > 1:
        # Last block reduces: every program of (b, g) counts itself in; the barrier orders all of this CTA's partial
        # stores before the (thread-0) release of the atomic, and the one that sees S - 1 acquires them all.
        tl.debug_barrier()
        count = tl.atomic_add(counters + bg, 1, sem="acq_rel", scope="gpu")
        if count == S - 1:
            r2 = tl.arange(0, R2)
            r2m = r2 < R
            heads2 = g * R + r2
            sp = tl.arange(0, S)
            lse = tl.load(lse_part + (base + sp)[:, None] * R + r2[None, :],
                          mask=(sp < n_live)[:, None] & r2m[None, :], other=float("-inf"),
                          cache_modifier=".cg")                                                # [S, R2]
            big_m = tl.where(r2m, tl.max(lse, axis=0), 0.0)     # split 0 holds key lo: finite on real rows
            if SINKS:
                sink2 = tl.load(sinks + heads2, mask=r2m, other=float("-inf")).to(tl.float32) * 1.4426950408889634
            else:
                sink2 = tl.full((R2,), float("-inf"), tl.float32)
            den = tl.where(r2m, tl.sum(tl.exp2(lse - big_m[None, :]), axis=0) + tl.exp2(sink2 - big_m), 1.0)
            if GATE:                                            # loaded before the partials' loop, not after
                gt2 = tl.load(row + gate_off + heads2[:, None] * HD + d[None, :], mask=r2m[:, None] & dm[None, :],
                              other=0.0).to(tl.float32)
            else:
                gt2 = 0.0
            acc2 = tl.zeros((CB, R2, BLOCK_D), tl.float32)      # summed over its CB axis once, after the loop
            for s0 in range(0, n_live, CB):                     # CB splits x R heads x hd per load
                sc = s0 + tl.arange(0, CB)
                pm = (sc < n_live)[:, None] & r2m[None, :]
                idx = (base + sc)[:, None] * R + r2[None, :]                                   # [CB, R2]
                w = tl.exp2(tl.load(lse_part + idx, mask=pm, other=float("-inf"), cache_modifier=".cg")
                            - big_m[None, :])
                o2 = tl.load(o_part + idx[:, :, None] * HD + d[None, None, :],
                             mask=pm[:, :, None] & dm[None, None, :], other=0.0, cache_modifier=".cg")
                acc2 += w[:, :, None] * o2                                                     # [CB, R2, BD]
            _finish(tl.sum(acc2, axis=0) / den[:, None], gt2, out_row, heads2, r2m, d, HD, GATE, RNE_BITS)
            tl.store(counters + bg, 0)                          # ready for the next call (next kernel on the stream)


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


def split_counts() -> list[int]:
    """Every S `num_splits` can pick, whatever the batch and the SM count: its clamp of each power of two."""
    lo, hi = CONFIG["min_splits"], CONFIG["max_splits"]
    return sorted({max(lo, min(hi, 1 << i)) for i in range(hi.bit_length() + 1)})


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


def decode_attention(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                     cos: torch.Tensor | None, sin: torch.Tensor | None, tables: torch.Tensor, positions: torch.Tensor,
                     *, nq: int, nkv: int, hd: int, scale: float, gated: bool, splits: int | None = None,
                     tile: dict | None = None, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """qkv [B, rows] (rows = [q | k | v | gate if gated], unit column stride; the gate is the last nq * hd columns);
    q_norm / k_norm fp32 [hd] or None; cos / sin [B, rd] or None; tables int64 [2, B]; positions int64 [B] -> out
    [B, nq * hd] in qkv's dtype (module docstring). Writes k and v at row positions[b] of sequence b's buffers.
    `splits` (a power of two) and `tile` ({BLOCK_N, num_warps, num_stages[, min_chunk]}) override `num_splits` and
    CONFIG (tests, benchmark sweeps). One launch; it uses a module-level counter buffer (`_counters`), so calls on one
    device must not run concurrently on different streams. `sinks` [nq] (any float dtype) or None: gpt_oss's per-head
    sink logits; `window` > 0: sequence b attends keys (p_b - window, p_b] only (sliding-window layers)."""
    B, width = qkv.shape
    assert qkv.stride(1) == 1 and nq % nkv == 0 and width >= (nq + 2 * nkv + nq * gated) * hd, (qkv.shape, nq, nkv)
    rd = 0 if cos is None else cos.shape[1]
    if rd:
        assert cos.shape == sin.shape == (B, rd) and cos.stride() == sin.stride() and cos.stride(1) == 1 and rd % 2 == 0
    assert sinks is None or (tuple(sinks.shape) == (nq,) and sinks.is_contiguous()), (None if sinks is None
                                                                                      else sinks.shape)
    assert window >= 0, window
    r = nq // nkv
    S = splits or num_splits(B, nkv, qkv.device)
    assert S & (S - 1) == 0, S
    t = tile or CONFIG["tiles"].get(hd, CONFIG["tiles"]["default"])
    bn = t["BLOCK_N"]
    min_chunk = triton.cdiv(t.get("min_chunk", CONFIG["min_chunk"]), bn) * bn    # a multiple of BLOCK_N (0: none)
    bd = triton.next_power_of_2(hd)
    r2 = triton.next_power_of_2(r)
    cb = max(1, min(S, CONFIG["combine_elems"] // (r2 * bd)))
    o_part = torch.empty(B * nkv * S * r, hd, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(B * nkv * S * r, dtype=torch.float32, device=qkv.device)
    out = torch.empty(B, nq * hd, dtype=qkv.dtype, device=qkv.device)
    _decode_kernel[(S, B * nkv)](
        qkv, qkv.stride(0), width - nq * hd, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm,
        float(eps), qkv if cos is None else cos, qkv if sin is None else sin, 0 if cos is None else cos.stride(0),
        tables, tables.stride(0), tables.stride(1), positions, o_part, lse, _counters(B * nkv, qkv.device), out,
        float(scale) * math.log2(math.e), qkv if sinks is None else sinks,
        NQ=nq, NKV=nkv, HD=hd, RD=rd, R=r, R_PAD=max(16, r2), R2=r2, S=S, BLOCK_N=bn, BLOCK_D=bd,
        MIN_CHUNK=min_chunk, CB=cb, Q_NORM=q_norm is not None, K_NORM=k_norm is not None, GATE=gated,
        DOT_F32=qkv.dtype == torch.float32 or not qkv.is_cuda, RNE_BITS=_rne_bits(qkv), WINDOW=int(window),
        SINKS=sinks is not None, num_warps=t["num_warps"],
        num_stages=t["num_stages"], **pdl_args(qkv.device))
    return out
