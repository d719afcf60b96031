"""Decode-time MoE routing in one Triton launch: the router GEMV, softmax, top-k and renorm (and the shared expert's
gate GEMV), which the layer code runs as two or three launches (cuBLAS GEMV, `fused_ops.route_topk`, cuBLAS GEMV).

  router_topk(x [T, H], weight [E, H], k, renormalize, extra [1, H] | None, bias [E] | None)
      -> (ids int64 [T, k], weights fp32 [T, k], extra_logit [T, 1] in x.dtype | None)
  logits = cast(x · weightᵀ + bias) (fp32 accumulation, rounded once to x.dtype as F.linear returns it), then
  `layers/moe.py route(logits, k, renormalize)`: p = softmax(fp32(logits)), the k largest p in descending order (ties
  by ascending expert id, as `fused_ops.route_topk`), divided by their sum iff renormalize;
  extra_logit = cast(x · extraᵀ) (the shared expert gate's logit, `shared_expert_gate(x)`).
Results equal `router_topk_ref` up to fp32 summation order (the dot over H, the softmax sum) and the last ulp of exp;
so the rounded logits, and with them ids and extra_logit, match exactly except where a sum lands on a rounding edge.
With `sigmoid` (glm4_moe, glm_moe_dsa) the logits are F.linear(fp32(x), fp32(weight)), kept in fp32, and the selection
is `sigmoid_topk._sigmoid_topk` (layers/moe.py `route_sigmoid`); there is no extra row.

Kernel (grid (cdiv(E + has_extra, BLOCK_E), T), a function of shapes only, so it can be captured in a CUDA graph):
  1. Program (i, t) takes weight rows [i BLOCK_E, (i + 1) BLOCK_E) (row E is `extra`) against token row t, with
     `dense_gemv.fma_rows`: the K loop over H accumulates x ⊙ w in an fp32 [1, BLOCK_E, BK] block and reduces it once
     at the end. The T programs of a weight block read it once from HBM and T - 1 times from L2 (1 MB of router
     weight). Rows < E go to an fp32 scratch [T, E] (softmax: the values rounded to x.dtype), row E to extra_logit.
  2. Last block reduces, per token: a CTA barrier orders the program's scratch stores before thread 0's acq_rel
     gpu-scope atomic increment of token t's counter; the program that reads n_programs - 1 sees every other store
     to row t, loads it (.cg: not from a stale L1) and runs `fused_ops._softmax_topk` (or `_sigmoid_topk`) on it,
     writes ids / weights and stores 0 back into the counter. So the T top-ks run on T CTAs at once, not one after
     another on one (a top-k of k rounds of block-wide max is latency, not work).
The counters are one zeroed int32 [MAX_TOKENS] per device (`_counter`), kept for the process lifetime and left zeroed
by every call, so graph replays need no reset; calls on one device must therefore not run concurrently on different
streams.

Bounds: T <= MAX_TOKENS (decode; larger T is a prefill, where the GEMM path is the right one) and E <= MAX_EXPERTS;
outside them `router_topk` returns the reference. Under the Triton interpreter (CPU tensors, tests) the bf16 rounding
is done on the bits (`fused_ops._cast`). Tiles: `TILES` (swept by tools/bench_router.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.dense_gemv import fma_rows
from ft.runtime.gpu.kernels.fused_ops import _cast, _rne_bits, _softmax_topk
from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_wait
from ft.runtime.gpu.kernels.sigmoid_topk import NO_SIGMOID, SigmoidRoute, _sigmoid_topk
from ft.runtime.layers.moe import route, route_sigmoid

MAX_TOKENS = 16
MAX_EXPERTS = 4096
# Tiles for E = 256, H = 2048, bf16 (1 MB of weight) on the H200: a program takes BLOCK_E = 4 weight rows whole (64
# programs per token of 16 KB, one K step, 16-byte loads); acc_elems caps the [1, BLOCK_E, BK] accumulator (BK
# shrinks where BLOCK_E grows). The T = 1 winner of tools/bench_router.py's sweep, which every T now runs per token
# (not re-swept since); measured there (CUDA-graph replays, per call): T = 1 5.1-5.3 us against 7.9 us for F.linear
# + fused_ops.route_topk and 11.8 us with the shared gate's F.linear. About 1 us of it is the launch, 1.2 us the
# GEMV, 0.7 us the atomic and 2.4 us the reducing program's load and top-k.
TILES = {"BLOCK_E": 4, "BLOCK_K": 2048, "num_warps": 4, "acc_elems": 8192}
_COUNTERS: dict[str, torch.Tensor] = {}


@triton.jit
def _router_kernel(x, sx, w, extra, scratch, extra_out, ids, wts, counters, E, H, n_programs, bias, scale, gate_bias,
                   K: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr, RNE_BITS: tl.constexpr,
                   GATE_BIAS: tl.constexpr,
                   SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_TOPK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    dt = x.dtype.element_ty
    tok = tl.program_id(1)
    x += tok * sx                                                                  # this program's token row
    scratch += tok * E
    one = tl.arange(0, 1)
    r = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)                        # weight rows; row E: extra
    wrow = tl.where(r < E, w + r.to(tl.int64) * H, extra)                          # [BE] row pointers
    rm = r < E + HAS_EXTRA
    logit = fma_rows(wrow, rm, x, sx, one, one < 1, H, 1, BLOCK_E, BLOCK_K)                        # [1, BE] fp32
    if GATE_BIAS:  # the router's own bias (gpt-oss), added before the one rounding, as F.linear does
        logit += tl.load(gate_bias + r[None, :], mask=(r < E)[None, :], other=0.0).to(tl.float32)
    if not SIGMOID:  # F.linear's rounding to x.dtype (the sigmoid router's logits stay fp32, as its layer's)
        logit = _cast(logit, dt, RNE_BITS)
    tl.store(scratch + r[None, :], logit.to(tl.float32), mask=(r < E)[None, :])
    if HAS_EXTRA:
        tl.store(extra_out + tok + 0 * r[None, :], logit, mask=(r == E)[None, :])
    # Last block reduces: the barrier orders all of this CTA's scratch stores before thread 0's release of the
    # atomic; the program that sees n_programs - 1 acquires every program's stores to this token's row.
    tl.debug_barrier()
    count = tl.atomic_add(counters + tok, 1, sem="acq_rel", scope="gpu")
    if count == n_programs - 1:
        e = tl.arange(0, BLOCK_R)[None, :]
        j = tl.arange(0, BLOCK_TOPK)[None, :]
        z = tl.load(scratch + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")     # [1, BLOCK_R]
        if SIGMOID:
            top_w, top_i = _sigmoid_topk(z, e < E, bias, scale, E, K, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_G,
                                         BLOCK_TOPK)
        else:
            top_w, top_i = _softmax_topk(z, e < E, K, RENORM, BLOCK_TOPK)
        tl.store(wts + tok * K + j, top_w, mask=j < K)
        tl.store(ids + tok * K + j, top_i.to(tl.int64), mask=j < K)
        tl.store(counters + tok, 0)                            # ready for the next call (next kernel on the stream)


def _counter(device: torch.device) -> torch.Tensor:
    """The zeroed int32 [MAX_TOKENS] counters of `device`, kept for the process lifetime (module docstring)."""
    buf = _COUNTERS.get(str(device))
    if buf is None:
        buf = _COUNTERS[str(device)] = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=device)
    return buf


def launch_tiles(H: int, tiles: dict | None = None) -> dict:
    """{BLOCK_E, BLOCK_K, num_warps, acc_elems}: TILES with `tiles` over it, and BLOCK_K as launched: at most
    acc_elems / BLOCK_E (the fp32 accumulator), at least 16, at most next_power_of_2(H)."""
    unknown = set(tiles or {}) - set(TILES)
    if unknown:
        raise ValueError(f"unknown router tile keys {sorted(unknown)}; known: {sorted(TILES)}")
    t = {**TILES, **(tiles or {})}
    t["BLOCK_K"] = max(16, min(t["BLOCK_K"], t["acc_elems"] // t["BLOCK_E"], triton.next_power_of_2(H)))
    return t


def router_topk(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, extra: torch.Tensor | None = None,
                tiles: dict | None = None, sigmoid: SigmoidRoute | None = None, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, H] (last dim contiguous), weight [E, H] and extra [1, H] or None (contiguous, x's dtype) -> (ids int64
    [T, k], weights fp32 [T, k], extra_logit [T, 1] in x.dtype or None), one launch (module docstring). `tiles`
    overrides entries of TILES (benchmark sweeps; `launch_tiles`). `sigmoid`: glm4_moe's routing on fp32 logits
    (`sigmoid_topk.py`; weight in any float dtype, no extra). `bias` [E]: the router's own bias (gpt-oss; softmax
    routing only), added to the fp32 dot before its rounding. Outside the bounds (T > MAX_TOKENS, E > MAX_EXPERTS,
    k not in [1, E], a grouping `SigmoidRoute.supported` refuses): the reference."""
    T, H = x.shape
    E = weight.shape[0]
    assert weight.shape == (E, H) and weight.is_contiguous(), (weight.shape, x.shape)
    assert sigmoid is not None or weight.dtype == x.dtype, (weight.dtype, x.dtype)
    if extra is not None:
        assert sigmoid is None, "the sigmoid router has no shared expert gate"
        assert extra.shape == (1, H) and extra.dtype == x.dtype and extra.is_contiguous(), extra.shape
    if bias is not None:
        assert sigmoid is None and bias.shape == (E,) and bias.is_contiguous(), bias.shape
    if T > MAX_TOKENS or E > MAX_EXPERTS or not 0 < k <= E or not (sigmoid is None or sigmoid.supported(E, k)):
        return router_topk_ref(x, weight, k, renormalize, extra, sigmoid, bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    extra_logit = None if extra is None else torch.empty(T, 1, dtype=x.dtype, device=x.device)
    if T == 0:
        return ids, weights, extra_logit
    t = launch_tiles(H, tiles)
    n_programs = triton.cdiv(E + (extra is not None), t["BLOCK_E"])
    scratch = torch.empty(T, E, dtype=torch.float32, device=x.device)
    routing = (sigmoid or NO_SIGMOID).launch_args(scratch)
    _router_kernel[(n_programs, T)](
        x, x.stride(0), weight, weight if extra is None else extra, scratch,
        weights if extra_logit is None else extra_logit, ids, weights, _counter(x.device), E, H, n_programs,
        gate_bias=scratch if bias is None else bias, GATE_BIAS=bias is not None,
        K=k, RENORM=bool(renormalize), HAS_EXTRA=extra is not None, RNE_BITS=_rne_bits(x),
        SIGMOID=sigmoid is not None, **routing, BLOCK_E=t["BLOCK_E"], BLOCK_K=t["BLOCK_K"],
        BLOCK_R=triton.next_power_of_2(E), BLOCK_TOPK=triton.next_power_of_2(k), num_warps=t["num_warps"],
        **pdl_args(x.device))
    return ids, weights, extra_logit


def router_topk_ref(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool,
                    extra: torch.Tensor | None = None, sigmoid: SigmoidRoute | None = None,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The layer code's ops: `route(F.linear(x, weight), k, renormalize)` and `F.linear(x, extra)`; with `sigmoid`,
    `route_sigmoid(F.linear(fp32(x), fp32(weight)), ...)`."""
    if sigmoid is not None:
        ids, weights = route_sigmoid(F.linear(x.float(), weight.float()), sigmoid.bias, k, sigmoid.n_group,
                                     sigmoid.topk_group, renormalize, sigmoid.scale)
        return ids, weights, None
    ids, weights = route(F.linear(x, weight, bias), k, renormalize)
    return ids, weights, None if extra is None else F.linear(x, extra)
