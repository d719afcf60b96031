"""Gated DeltaNet chunked prefill (one segment of T tokens) as two Triton kernels.

Computes `ft.runtime.layers.deltanet.chunk_gated_delta_rule` (the reference; its docstring has the chunk algebra) for
one sequence, with key heads not repeated: value head h reads key head j = h // r (r = Hv/Hk). Per chunk of BT tokens
with cumulative log-decay G (G_i = g_1 + … + g_i within the chunk), D[i, m] = exp(G_i − G_m) for m <= i (else 0) and
A = tril₋₁((β k) kᵀ ∘ D):

Kernel 1 `_prep_kernel`, grid (chunks, Hv), chunk-parallel: T = (I + A)⁻¹ by forward substitution in registers
(row i of T is e_i − Σ_{m<i} A[i, m]·T[m, :], BT steps over a [BT, BT] tile), then u = T (β v) [BT, dv] and
w = T (β k e^G) [BT, dk], written with G to fp32 scratch of ceil(T/BT)·BT rows per head. Rows past T have k = v =
β = g = 0, so they add nothing and G stays at the last real token's value there.

Kernel 2 `_state_kernel`, grid (Hv, dv / BV): the state tile S [dk, BV] stays in registers while the program walks the
chunks in order: δ = u − w S;  o = (q e^G) S + ((q kᵀ) ∘ D) δ;  S ← e^{G_last} S + (k e^{G_last − G})ᵀ δ. The state
is read from and written back to the caller's [Hv, dk, dv] fp32 buffer once per call (in place).

All exponents are <= 0. The matrix products run as `tl.dot` with `PREFILL_CONFIG["precision"]` ("tf32": tensor-core
TF32 on the GPU, ~1e-3 relative, below the bf16 rounding of the layer's inputs; "ieee" for full fp32). tl.dot needs
every dimension >= 16: dk, BV, BT >= 16 (dk and dv are padded to powers of two, masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# BT: chunk length; BV: dv tile of the state kernel (its grid is Hv x dv/BV programs, each holding S [dk, BV] fp32:
# BV 32 gives 128 programs for Qwen3.6's 32 heads of dv 128). One stage: the chunk loop's fp32 tiles fill ~150 KiB of
# shared memory at dk 128, BT 64, with no room to double-buffer them (at sm_90 the state kernel still spills a few
# hundred bytes per thread; the prep kernel needs 8 warps not to).
PREFILL_CONFIG = {"BT": 64, "BV": 32, "prep_warps": 8, "state_warps": 4, "state_stages": 1, "precision": "tf32"}


@triton.jit
def _prep_kernel(k, k_st, v, v_st, g, beta, gb_st, w_out, u_out, g_out, T, T_PAD,
                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    j = h // (HV // HK)
    r = tl.arange(0, BT)
    t = c * BT + r
    tm = t < T
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BDV)
    t64 = t.to(tl.int64)
    kt = tl.load(k + t64[:, None] * k_st + j * DK + kk[None, :], mask=tm[:, None] & (kk < DK)[None, :], other=0.0)
    vt = tl.load(v + t64[:, None] * v_st + h * DV + vv[None, :], mask=tm[:, None] & (vv < DV)[None, :], other=0.0)
    bt = tl.load(beta + t64 * gb_st + h, mask=tm, other=0.0)
    G = tl.cumsum(tl.load(g + t64 * gb_st + h, mask=tm, other=0.0), axis=0)          # [BT]
    kb = kt * bt[:, None]
    lower = r[:, None] > r[None, :]
    A = tl.dot(kb, tl.trans(kt), input_precision=PREC)                              # [BT, BT]
    A = tl.where(lower, A * tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)                               # T = (I + A)^-1, row by row
    for i in range(1, BT):
        a_i = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)                     # A[i, :] (zero from i on)
        inv = tl.where(r[:, None] == i, inv - tl.sum(a_i[:, None] * inv, axis=0)[None, :], inv)
    u = tl.dot(inv, vt * bt[:, None], input_precision=PREC)                         # [BT, BDV]
    w = tl.dot(inv, kb * tl.exp(G)[:, None], input_precision=PREC)                   # [BT, BK]
    row = h.to(tl.int64) * T_PAD + c * BT + r                                        # scratch rows of this chunk
    tl.store(u_out + row[:, None] * DV + vv[None, :], u, mask=(vv < DV)[None, :])
    tl.store(w_out + row[:, None] * DK + kk[None, :], w, mask=(kk < DK)[None, :])
    tl.store(g_out + row, G)


@triton.jit
def _state_kernel(q, q_st, k, k_st, w_in, u_in, g_in, o, o_st, state, T, T_PAD,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    h = tl.program_id(0)
    j = h // (HV // HK)
    r = tl.arange(0, BT)
    kk = tl.arange(0, BK)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    km = kk < DK
    vm = vv < DV
    s_ptr = state + h.to(tl.int64) * (DK * DV) + kk[:, None] * DV + vv[None, :]
    s = tl.load(s_ptr, mask=km[:, None] & vm[None, :], other=0.0)                   # [BK, BV]
    causal = r[:, None] >= r[None, :]
    for c0 in range(0, T, BT):
        t = c0 + r
        tm = t < T
        t64 = t.to(tl.int64)
        row = h.to(tl.int64) * T_PAD + c0 + r
        qt = tl.load(q + t64[:, None] * q_st + j * DK + kk[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        kt = tl.load(k + t64[:, None] * k_st + j * DK + kk[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        wt = tl.load(w_in + row[:, None] * DK + kk[None, :], mask=km[None, :], other=0.0)
        ut = tl.load(u_in + row[:, None] * DV + vv[None, :], mask=vm[None, :], other=0.0)
        G = tl.load(g_in + row)
        g_last = tl.load(g_in + h.to(tl.int64) * T_PAD + c0 + BT - 1)
        delta = ut - tl.dot(wt, s, input_precision=PREC)                            # [BT, BV]
        qk = tl.dot(qt, tl.trans(kt), input_precision=PREC)                         # [BT, BT]
        qk = tl.where(causal, qk * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
        # the decays scale rows of results (e^G ∘ (q S)) and of δ (kᵀ (e^{G_last − G} ∘ δ)) rather than the loaded
        # q, k tiles: those then go to the tensor cores straight from shared memory, which keeps registers free
        ot = tl.exp(G)[:, None] * tl.dot(qt, s, input_precision=PREC) + tl.dot(qk, delta, input_precision=PREC)
        tl.store(o + t64[:, None] * o_st + h * DV + vv[None, :], ot, mask=tm[:, None] & vm[None, :])
        dd = delta * tl.exp(g_last - G)[:, None]                                      # [BT, BV]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(kt), dd, input_precision=PREC)
    tl.store(s_ptr, s, mask=km[:, None] & vm[None, :])


def _rows(x: torch.Tensor) -> torch.Tensor:
    # [T, heads, d] with each row's heads contiguous (a row-strided view is fine); anything else is copied
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def gdn_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """One segment's gated delta rule (module docstring), the state updated in place.

    q, k [T, Hk, dk] fp32 (q l2-normalised and scaled, k l2-normalised; key head j serves value heads j·r … j·r+r-1);
    v [T, Hv, dv] fp32; g, beta [T, Hv] fp32; state [Hv, dk, dv] fp32 contiguous. Row-strided views are used as
    they are, other layouts copied.
    Returns o [T, Hv, dv] fp32."""
    cfg = {**PREFILL_CONFIG, **(config or {})}
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != n or hv % hk or g.shape != (n, hv) or beta.shape != (n, hv) \
            or state.shape != (hv, dk, dv) or not state.is_contiguous():
        raise ValueError(f"gdn_chunk_prefill: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} state {tuple(state.shape)} do not fit")
    if any(t.dtype != torch.float32 for t in (q, k, v, g, beta, state)):
        raise ValueError("gdn_chunk_prefill: every input is fp32")
    if g.stride(1) != 1 or beta.stride() != g.stride():
        g, beta = g.contiguous(), beta.contiguous()
    q, k, v = _rows(q), _rows(k), _rows(v)
    o = torch.empty(n, hv, dv, dtype=torch.float32, device=q.device)
    if n == 0:
        return o
    bt, bv = cfg["BT"], min(cfg["BV"], max(16, triton.next_power_of_2(dv)))
    bk, bdv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    chunks = triton.cdiv(n, bt)
    t_pad = chunks * bt
    w = torch.empty(hv, t_pad, dk, dtype=torch.float32, device=q.device)
    u = torch.empty(hv, t_pad, dv, dtype=torch.float32, device=q.device)
    gc = torch.empty(hv, t_pad, dtype=torch.float32, device=q.device)
    geom = dict(HK=hk, HV=hv, DK=dk, DV=dv, BT=bt, BK=bk, PREC=cfg["precision"])
    _prep_kernel[(chunks, hv)](k, k.stride(0), v, v.stride(0), g, beta, g.stride(0), w, u, gc, n, t_pad,
                               BDV=bdv, **geom, num_warps=cfg["prep_warps"])
    _state_kernel[(hv, triton.cdiv(dv, bv))](q, q.stride(0), k, k.stride(0), w, u, gc, o, hv * dv, state, n, t_pad,
                                             BV=bv, **geom, num_warps=cfg["state_warps"],
                                             num_stages=cfg["state_stages"])
    return o
