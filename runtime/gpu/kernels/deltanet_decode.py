"""Gated DeltaNet decode step (B sequences, one token each) as two Triton kernels.

The math is `ft.runtime.layers.deltanet`'s (module docstring there); `GatedDeltaNet.__call__`'s torch code is the
reference. Per sequence b, after the projections:

    mixed [B, C] (C = 2·Hk·dk + Hv·dv, channels q | k | v before the conv), z [B, Hv·dv], b/a [B, Hv]
    conv state  [C, K-1]    compute dtype (= mixed's), at address tables[0, b], shifted in place
    rec. state  [Hv, dk, dv] fp32,                     at address tables[1, b], updated in place, 16-byte aligned

Kernel 1 `_conv_kernel`, grid (B, 2·Hk + Hv): program (b, p) owns the channels of one head, p < Hk a q head,
Hk <= p < 2Hk a k head, else value head p - 2Hk. For each channel c: window = [state[c, 0..K-2], x[c]],
y = silu(Σ_j w[c, j]·window[j]) (fp32, rounded to the compute dtype like the torch conv's output), then for q/k heads
y · rsqrt(Σ_head y² + 1e-6) (· dk^-½ for q); writes fp32 `qkv [B, C]` and shifts the conv state: state[c, j] <-
state[c, j+1], state[c, K-2] <- x[c]. Every channel belongs to exactly one program, and one thread reads and then
writes a channel's state (the same 1-D layout throughout), so the in-place shift is race-free without a barrier.
The conv has to finish before any q/k head is shared: value heads j·r … j·r+r-1 (r = Hv/Hk) all read key head j.

Kernel 2 `_recurrent_kernel`, grid (B, Hv): program (b, h), key head j = h // r, loads q_j, k_j [dk] and v_h [dv]
from `qkv`, β = σ(b) (rounded to the compute dtype, as torch's sigmoid of a bf16 tensor is), g = -exp(A_log)·
softplus(a + dt_bias) (fp32), the state tile S [dk, dv] once (the dominant traffic: Hv·dk·dv·4 bytes per sequence,
2 MiB for Qwen3.6), then in registers S <- e^g·S; δ = β·(v - Sᵀk); S <- S + k δᵀ; o = Sᵀq, writes S back once, and
finishes with RMSNormGated over the head: o rounded to the compute dtype, o·rsqrt(mean(o²) + eps)·w·silu(z),
stored in the compute dtype -> core [B, Hv·dv], ready for out_proj. The program holds the whole dv row of the head so
the norm needs no second pass.

Nothing in a launch depends on host values that change per step (addresses come from `tables` on the device; the
grid depends on B and the geometry only), so both kernels replay from a CUDA graph. Padded rows of a graph all point
at one scratch state: their programs race on it, harmlessly (every value written is a finite state; outputs are
ignored). Tile and warp choices: `DECODE_CONFIG`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_wait

# num_warps of each kernel. The recurrent program holds an fp32 [dk, dv] tile (64 KiB at 128x128) in registers: at
# dk = dv = 128 on sm_90 that takes ~210 registers a thread with 4 warps, ~175 with 8, ~105 with 16, none spilling.
DECODE_CONFIG = {"conv_warps": 4, "rec_warps": 8}


@triton.jit
def _round(v, dt: tl.constexpr, BITS: tl.constexpr):
    # fp32 -> dt (round to nearest even) -> fp32. Triton's interpreter truncates a plain fp32 -> bf16 cast, so there
    # (BITS) bf16 is rounded on the bits first and the cast is then exact; compiled code rounds natively.
    if BITS:
        u = v.to(tl.uint32, bitcast=True)
        v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(dt).to(tl.float32)


@triton.jit
def _conv_kernel(mixed, m_stride, conv_w, qkv, tables, q_scale,
                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
                 BLOCK: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    bi = tl.program_id(0)
    p = tl.program_id(1)
    KEY: tl.constexpr = HK * DK
    C: tl.constexpr = 2 * KEY + HV * DV
    is_qk = p < 2 * HK
    base = tl.where(is_qk, p * DK, 2 * KEY + (p - 2 * HK) * DV)
    width = tl.where(is_qk, DK, DV)
    i = tl.arange(0, BLOCK)
    m = i < width
    c = (base + i).to(tl.int64)                                      # [BLOCK] channels of this head
    x = tl.load(mixed + bi.to(tl.int64) * m_stride + c, mask=m, other=0.0)     # compute dtype
    state = tl.load(tables + bi).to(tl.pointer_type(mixed.dtype.element_ty)) + c * (K - 1)   # row c of [C, K-1]
    # y = Σ_j w[c, j]·window[c, j] tap by tap in fp32, window = [state[c, 0..K-2], x[c]]
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K - 1):
        acc += tl.load(conv_w + c * K + j, mask=m, other=0.0).to(tl.float32) * \
            tl.load(state + j, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(conv_w + c * K + (K - 1), mask=m, other=0.0).to(tl.float32) * x.to(tl.float32)
    # shift the window in place (this thread read these very elements above)
    for j in tl.static_range(K - 2):
        tl.store(state + j, tl.load(state + j + 1, mask=m, other=0.0), mask=m)
    tl.store(state + (K - 2), x, mask=m)
    y = _round(acc * tl.sigmoid(acc), mixed.dtype.element_ty, BITS)          # silu, rounded like the torch conv
    inv = tl.where(is_qk, tl.rsqrt(tl.sum(y * y, axis=0) + 1e-6), 1.0)      # l2 norm of q/k heads only
    scale = tl.where(p < HK, q_scale, 1.0)
    tl.store(qkv + bi.to(tl.int64) * C + c, (y * inv) * scale, mask=m)


@triton.jit
def _recurrent_kernel(qkv, z, z_stride, bb, b_stride, aa, a_stride, A_log, dt_bias, norm_w, out, tables, t_stride,
                      eps, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    bi = tl.program_id(0)
    h = tl.program_id(1)
    KEY: tl.constexpr = HK * DK
    C: tl.constexpr = 2 * KEY + HV * DV
    j = h // (HV // HK)
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    km = kk < DK
    vm = vv < DV
    row = qkv + bi.to(tl.int64) * C
    q = tl.load(row + j * DK + kk, mask=km, other=0.0)               # [BK] fp32, normalised and scaled
    k = tl.load(row + KEY + j * DK + kk, mask=km, other=0.0)
    v = tl.load(row + 2 * KEY + h * DV + vv, mask=vm, other=0.0)     # [BV]
    dt = out.dtype.element_ty
    b_ = tl.load(bb + bi.to(tl.int64) * b_stride + h).to(tl.float32)
    beta = _round(tl.sigmoid(b_), dt, BITS)
    x = tl.load(aa + bi.to(tl.int64) * a_stride + h).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))   # torch's threshold 20
    decay = tl.exp(-tl.exp(tl.load(A_log + h).to(tl.float32)) * softplus)
    # state tile [BK, BV] of head h: read once, updated in registers, written once
    # 16-byte aligned (module docstring): lets the tile load and store as 128-bit vectors; without the hint an address
    # read from memory is assumed unaligned, every fp32 moves alone and the pointer tile alone overflows the registers
    base = tl.multiple_of(tl.load(tables + t_stride + bi).to(tl.pointer_type(tl.float32)), 16) + h * (DK * DV)
    offs = kk[:, None] * DV + vv[None, :]
    sm = km[:, None] & vm[None, :]
    s = tl.load(base + offs, mask=sm, other=0.0) * decay
    kv = tl.sum(s * k[:, None], axis=0)                              # Sᵀk [BV]
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)                               # Sᵀq [BV]
    tl.store(base + offs, s, mask=sm)
    # RMSNormGated over the head's dv: o as the compute dtype, w · o · rsqrt(mean(o²) + eps) · silu(z)
    o = _round(o, dt, BITS)
    rstd = tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)
    zz = tl.load(z + bi.to(tl.int64) * z_stride + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
    w = tl.load(norm_w + vv, mask=vm, other=0.0).to(tl.float32)
    y = (o * rstd) * w * (zz * tl.sigmoid(zz))
    tl.store(out + bi.to(tl.int64) * (HV * DV) + h * DV + vv, _round(y, dt, BITS).to(dt), mask=vm)


def _rows(t: torch.Tensor, name: str) -> int:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with unit stride along its last dim, got {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0)


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               tables: torch.Tensor, *, hk: int, hv: int, dk: int, dv: int,
               config: dict | None = None) -> torch.Tensor:
    """One decode step of a Gated DeltaNet layer for B sequences (module docstring).

    mixed [B, C] and z [B, Hv·dv] (compute dtype), b, a [B, Hv] (row-strided views are fine, unit stride along the
    last dim); conv_weight [C, K]; A_log, dt_bias [Hv]; norm_weight [dv]; tables int64 [2, B] (this layer's rows of
    `ForwardBatch.tables`: conv state and recurrent state addresses, both states updated in place; the conv state's
    dtype is mixed's). Returns core [B, Hv·dv] in the compute dtype (RMSNormGated applied), for out_proj."""
    cfg = {**DECODE_CONFIG, **(config or {})}
    n, c = mixed.shape
    kernel = conv_weight.shape[1]
    if c != 2 * hk * dk + hv * dv or hv % hk or kernel < 2:
        raise ValueError(f"gdn_decode: mixed width {c}, conv kernel {kernel} do not fit hk={hk} hv={hv} dk={dk} "
                         f"dv={dv}")
    if tables.shape != (2, n) or tables.dtype != torch.int64 or tables.stride(1) != 1:
        raise ValueError(f"gdn_decode: tables must be int64 [2, {n}] with unit stride along B, got "
                         f"{tuple(tables.shape)} {tables.dtype}")
    m_stride, z_stride = _rows(mixed, "mixed"), _rows(z, "z")
    b_stride, a_stride = _rows(b, "b"), _rows(a, "a")
    conv_weight = conv_weight.contiguous()
    qkv = torch.empty(n, c, dtype=torch.float32, device=mixed.device)
    out = torch.empty(n, hv * dv, dtype=mixed.dtype, device=mixed.device)
    if n == 0:
        return out
    bits = mixed.dtype == torch.bfloat16 and mixed.device.type == "cpu"     # interpreted: see _round
    _conv_kernel[(n, 2 * hk + hv)](
        mixed, m_stride, conv_weight, qkv, tables, dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv, K=kernel,
        BLOCK=triton.next_power_of_2(max(dk, dv)), BITS=bits, num_warps=cfg["conv_warps"], **pdl_args(qkv.device))
    _recurrent_kernel[(n, hv)](
        qkv, z, z_stride, b, b_stride, a, a_stride, A_log, dt_bias, norm_weight, out, tables, tables.stride(0),
        float(eps), HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv), BITS=bits,
        num_warps=cfg["rec_warps"], **pdl_args(qkv.device))
    return out
