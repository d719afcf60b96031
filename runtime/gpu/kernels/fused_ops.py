"""Fused Triton kernels for a decoder layer's small elementwise ops, and the PyTorch references they match.

Each function computes what the layer code computes with several PyTorch ops (each op a launch, an fp32 temporary and
a trip through memory), in one launch:

  rms_norm(x [..., D], w [D], eps) -> y [..., D]
      y = cast(w * (xf * rsqrt(mean(xf^2) + eps))), xf = fp32(x)                 (layers/norm.py `rms_norm`)
  add_rms_norm(x [..., D], delta [..., D], w, eps) -> (s, y)
      s = cast(fp32(x) + fp32(delta)) (the rounded residual sum, as `x + delta` in the compute dtype), y = rms_norm(s)
  route_topk(logits [T, E], k, renormalize) -> (ids int64 [T, k], weights fp32 [T, k])
      p = softmax(fp32(logits)); the k largest p in descending order; divided by their sum iff renormalize
                                                                                  (layers/moe.py `route`)
      with `sigmoid` (SigmoidRoute): glm4_moe's sigmoid, correction-bias, group-limited selection
                                                                    (`sigmoid_topk.py`, layers/moe.py `route_sigmoid`)
  silu_mul(gate_up [..., 2I]) -> act [..., I]
      act = cast(fp32(cast(silu(g))) * fp32(u)), [g | u] = gate_up                  (layers/mlp.py)
  sigmoid_gate_add(y [..., H], gate [..., 1], shared [..., H]) -> y + cast(cast(sigmoid(gate)) * shared), rounded
                                                                                  (layers/moe.py shared expert)
      gate None: y + shared, rounded once (an ungated shared expert)
`cast` is the round-to-nearest-even conversion to the input dtype. Every intermediate the PyTorch ops round to the
compute dtype is rounded here too, so results equal the references up to fp32 summation order (the mean over D, the
softmax sum) and the last ulp of exp/rsqrt.

Ties in route_topk: among equal probabilities the lowest expert id is taken first, so the ids come out in descending
probability, ties by ascending id. torch.topk's order among ties is unspecified, so where a tie straddles the k-th
place the two may pick different ids of equal weight; the weights always match.

Launches depend on shapes only (no host reads of data), so every function can be captured in a CUDA graph. Inputs
must have their last dim contiguous (others are copied); outputs are new contiguous tensors. Under the Triton
interpreter (CPU tensors, tests) a plain fp32 -> bf16 cast truncates, so there the rounding is done on the bits
(`_cast`). Tile and warp choices: `TILES`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_wait
from ft.runtime.gpu.kernels.sigmoid_topk import NO_SIGMOID, SigmoidRoute, _sigmoid_topk
from ft.runtime.layers.moe import route as route_topk_ref
from ft.runtime.layers.moe import route_sigmoid
from ft.runtime.layers.norm import rms_norm as rms_norm_ref

TILES = {
    "norm_elems": 4096,          # x elements per norm program: rows per program = max(1, norm_elems // BLOCK_D)
    "norm_max_rows": 16,         # ... at most this many (small D: q/k norms over head_dim)
    "norm_elems_per_warp": 1024,  # warps = clamp(elements / this, 4, 16)
    "norm_max_d": 32768,         # larger rows fall back to the reference (one pass keeps the row in registers)
    "route_elems_per_warp": 512,  # one program per token row, all E logits in registers; warps = E / this in
                                  # [1, 8] (E = 256: one warp, so the 2K reductions are warp shuffles, no barriers)
    "route_max_e": 4096,
    "elem_block": 1024,          # silu_mul / sigmoid_gate_add: columns per program
    "elem_warps": 4,
}


@triton.jit
def _cast(v, dtype: tl.constexpr, RNE_BITS: tl.constexpr):
    # fp32 -> dtype with round-to-nearest-even; RNE_BITS (interpreter, bf16 output) rounds the bits first, after which
    # the truncating cast is exact
    if RNE_BITS:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    # fp32 -> dtype -> fp32 (round to nearest even) for an intermediate that torch rounds: bf16 on the bits, so the
    # rounding survives even where a compiler would fold a conversion there and back (and contract what follows)
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x, sxa, sxb, d, sda, w, s_out, y, R, B, D, eps,
                     HAS_DELTA: tl.constexpr, RNE_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    # rows r in [0, R) of x viewed as [R // B, B, D]: row r at (r // B) * sxa + (r % B) * sxb (q/k norms read the
    # heads of a strided qkv split in place); delta rows at r * sda; s and y contiguous [R, D]
    pdl_wait(PDL)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)          # [BR]
    c = tl.arange(0, BLOCK_D)                                                      # [BD]
    mask = (r < R)[:, None] & (c < D)[None, :]
    xv = tl.load(x + ((r // B) * sxa + (r % B) * sxb)[:, None] + c[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        dv = tl.load(d + (r * sda)[:, None] + c[None, :], mask=mask, other=0.0)
        xv = _cast(xv.to(tl.float32) + dv.to(tl.float32), s_out.dtype.element_ty, RNE_BITS)  # torch's rounded add
        tl.store(s_out + (r * D)[:, None] + c[None, :], xv, mask=mask)
    xf = xv.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)                         # [BR]
    wv = tl.load(w + c, mask=c < D, other=0.0).to(tl.float32)
    out = (xf * inv[:, None]) * wv[None, :]
    tl.store(y + (r * D)[:, None] + c[None, :], _cast(out, y.dtype.element_ty, RNE_BITS), mask=mask)


@triton.jit
def _softmax_topk(z, valid, K: tl.constexpr, RENORM: tl.constexpr, BLOCK_K: tl.constexpr):
    # z fp32 [R, BE] logits (-inf where not valid; every row holds a valid lane) -> (top_w fp32 [R, BK], top_i int32
    # [R, BK]): softmax over each row, then K rounds of (max and the lowest id holding it, knock it out); lanes >= K
    # hold 0. Shared by _route_kernel and runtime/gpu/kernels/router.py.
    e = tl.arange(0, z.shape[1])[None, :]
    ex = tl.exp(z - tl.max(z, axis=1)[:, None])                                    # invalid lanes: exp(-inf) = 0
    p = ex / tl.sum(ex, axis=1)[:, None]
    p = tl.where(valid, p, -1.0)                                                   # invalid lanes never win
    j = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((z.shape[0], BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((z.shape[0], BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(K):
        best, idx = tl.max(p, axis=1, return_indices=True, return_indices_tie_break_left=True)  # ties: lowest id
        top_w = tl.where(j == i, best[:, None], top_w)
        top_i = tl.where(j == i, idx[:, None], top_i)
        p = tl.where(e == idx[:, None], -2.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]                             # lanes >= K hold 0
    return top_w, top_i


@triton.jit
def _route_kernel(logits, stride, ids, wts, E, bias, scale, K: tl.constexpr, RENORM: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # one token row per program, as a [1, BLOCK_E] block for _softmax_topk / _sigmoid_topk
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)[None, :]
    z = tl.load(logits + row * stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        top_w, top_i = _sigmoid_topk(z, e < E, bias, scale, E, K, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_G,
                                     BLOCK_K)
    else:
        top_w, top_i = _softmax_topk(z, e < E, K, RENORM, BLOCK_K)
    j = tl.arange(0, BLOCK_K)[None, :]
    tl.store(wts + row * K + j, top_w, mask=j < K)
    tl.store(ids + row * K + j, top_i.to(tl.int64), mask=j < K)


@triton.jit
def _silu_mul_kernel(gu, stride, out, I, RNE_BITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # out[t, n] = cast(cast(silu(g)) * u), g = gu[t, n], u = gu[t, I + n]; program (t, column block)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < I
    g = tl.load(gu + t * stride + n, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + t * stride + I + n, mask=m, other=0.0).to(tl.float32)
    a = _rounded(tl.math.div_rn(g, 1.0 + tl.exp(-g)), out.dtype.element_ty)  # F.silu's rounded output
    tl.store(out + t * I + n, _cast(a * u, out.dtype.element_ty, RNE_BITS), mask=m)


@triton.jit
def _sigmoid_gate_add_kernel(yp, sy, gp, sg, sp, ss, out, H, GATE: tl.constexpr, RNE_BITS: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    # out[t, n] = cast(y + cast(cast(sigmoid(g[t])) * s[t, n])), without GATE cast(y + s); program (t, column block)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < H
    dt = out.dtype.element_ty
    s = tl.load(sp + t * ss + n, mask=m, other=0.0).to(tl.float32)
    y = tl.load(yp + t * sy + n, mask=m, other=0.0).to(tl.float32)
    if GATE:
        g = tl.load(gp + t * sg).to(tl.float32)
        gate = _rounded(tl.math.div_rn(1.0, 1.0 + tl.exp(-g)), dt)
        s = _rounded(gate * s, dt)
    tl.store(out + t * H + n, _cast(y + s, dt, RNE_BITS), mask=m)


# ---- launchers ---------------------------------------------------------------------------------------------------
def _rne_bits(t: torch.Tensor) -> bool:
    return t.device.type != "cuda" and t.dtype == torch.bfloat16


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] -> [R, D] with a contiguous last dim (a view where possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _norm_launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    D = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1 and delta is None:   # [A, B, D] heads of a strided split: read in place
        xs, B, sxa, sxb = x, x.shape[1], x.stride(0), x.stride(1)
    else:
        xs = _rows(x)
        B, sxa, sxb = 1, xs.stride(0), 0
    R = x.numel() // D if D else 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if delta is not None else y
    ds = _rows(delta) if delta is not None else xs
    if R == 0:
        return s, y
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(TILES["norm_elems"] // block_d, TILES["norm_max_rows"], triton.next_power_of_2(R)))
    warps = min(16, max(4, block_r * block_d // TILES["norm_elems_per_warp"]))
    _rms_norm_kernel[(triton.cdiv(R, block_r),)](
        xs, sxa, sxb, ds, ds.stride(0), weight, s, y, R, B, D, eps,
        HAS_DELTA=delta is not None, RNE_BITS=_rne_bits(x), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
        **pdl_args(y.device))
    return s, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (any float dtype), weight [D] (fp32) -> y [..., D] in x.dtype (module docstring)."""
    if x.shape[-1] > TILES["norm_max_d"]:
        return rms_norm_ref(x, weight, eps)
    return _norm_launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., D] of one dtype -> (s = x + delta, y = rms_norm(s)), both [..., D] in x.dtype."""
    if x.dtype != delta.dtype or x.shape != delta.shape or x.shape[-1] > TILES["norm_max_d"]:
        return add_rms_norm_ref(x, delta, weight, eps)
    return _norm_launch(x, delta, weight, eps)


def route_topk(logits: torch.Tensor, k: int, renormalize: bool,
               sigmoid: SigmoidRoute | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids int64 [T, k], weights fp32 [T, k]), descending; ties by ascending id (docstring).
    `sigmoid`: glm4_moe's routing instead of the softmax (`sigmoid_topk.py`; logits fp32, as the layer computes
    them)."""
    T, E = logits.shape
    if sigmoid is not None and (E > TILES["route_max_e"] or not sigmoid.supported(E, k)):
        return route_sigmoid(logits.float(), sigmoid.bias, k, sigmoid.n_group, sigmoid.topk_group, renormalize,
                             sigmoid.scale)
    if E > TILES["route_max_e"] or not 0 < k <= E:
        return route_topk_ref(logits, k, renormalize)
    logits = _rows(logits)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        block_e = triton.next_power_of_2(E)
        routing = (sigmoid or NO_SIGMOID).launch_args(logits)
        _route_kernel[(T,)](logits, logits.stride(0), ids, weights, E, K=k, RENORM=bool(renormalize),
                            SIGMOID=sigmoid is not None, **routing, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
                            num_warps=min(8, max(1, block_e // TILES["route_elems_per_warp"])),
                            **pdl_args(logits.device))
    return ids, weights


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(g) * u [..., I] in gate_up.dtype (g: the first I columns)."""
    I = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and I:
        block = min(TILES["elem_block"], triton.next_power_of_2(I))
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(I, block))](
            gu, gu.stride(0), out, I, RNE_BITS=_rne_bits(gu), BLOCK=block, num_warps=TILES["elem_warps"],
            **pdl_args(out.device))
    return out


def sigmoid_gate_add(y: torch.Tensor, gate: torch.Tensor | None, shared: torch.Tensor) -> torch.Tensor:
    """y, shared [..., H], gate [..., 1] of one dtype -> y + sigmoid(gate) * shared (rounded as torch does); gate None:
    y + shared (an ungated shared expert, glm4_moe)."""
    if (y.dtype != shared.dtype or y.shape != shared.shape
            or (gate is not None and (gate.dtype != y.dtype or gate.shape[-1] != 1))):
        return sigmoid_gate_add_ref(y, gate, shared)
    H = y.shape[-1]
    y2, s2 = _rows(y), _rows(shared)
    g2 = y2 if gate is None else _rows(gate)
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if y2.shape[0] and H:
        block = min(TILES["elem_block"], triton.next_power_of_2(H))
        _sigmoid_gate_add_kernel[(y2.shape[0], triton.cdiv(H, block))](
            y2, y2.stride(0), g2, g2.stride(0), s2, s2.stride(0), out, H, GATE=gate is not None,
            RNE_BITS=_rne_bits(y), BLOCK=block, num_warps=TILES["elem_warps"], **pdl_args(out.device))
    return out


# ---- references (the PyTorch ops of the layer code, composed as the layers compose them) ------------------------
def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + delta
    return s, rms_norm_ref(s, weight, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def sigmoid_gate_add_ref(y: torch.Tensor, gate: torch.Tensor | None, shared: torch.Tensor) -> torch.Tensor:
    return y + shared if gate is None else y + torch.sigmoid(gate) * shared
