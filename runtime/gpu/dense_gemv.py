"""Triton GEMV for dense (unquantized) linears at decode: `y = x @ W.T (+ bias)` for a few rows of x.

    y[t, n] = sum_k x[t, k] * W[n, k] (+ b[n])     x [T, K] (T <= 8), W [N, K] contiguous, y [T, N], all one dtype

One launch, grid `cdiv(N, BLOCK_N)` from the shapes alone (CUDA-graph capturable), no split-K and no second kernel.
Each program reads BLOCK_N whole weight rows, BLOCK_K columns per step (16-byte vector loads; the rows of the tile
are independent loads in flight; `UNROLL` steps of the K loop are unrolled so their loads issue together), multiplies
each tile against each of the T rows of x (the same for every program, so they come from L1/L2), reducing each
token's products along K per step (warps split the rows) into fp32. So the weight is read from HBM once whatever T
is. Rows past N and tokens past T are clamped to the last valid one on load (no masks on the weight stream) and
masked on store; K not a multiple of BLOCK_K masks the columns (EVEN_K drops that mask).

Tile configs: `CONFIGS`, keyed by shape class (`shape_class`: by N, K); small N gets small BLOCK_N so the router
(N = 256, 1 MB) still spreads over >= 64 programs (one wave; latency bound either way). `reference` is the PyTorch
reference (fp32 `F.linear`, cast to x's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_TOKENS = 8
# shape class -> (BLOCK_N, BLOCK_K for 2-byte dtypes (fp32: half), num_warps, UNROLL)
CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 256, 4, 2),     # N <= 512: router [256, 2048], in_proj_ba [64, 2048], shared_expert_gate [1, 2048]
    "small": (4, 256, 4, 2),    # N <= 4096: o_proj / out_proj [2048, 4096], shared gate_up [1024, 2048], down
    "medium": (8, 256, 4, 2),   # N <= 16384: qkv [5120, 2048], q/k/v/gate [9216, 2048], in_proj_qkvz [12288, 2048]
    "large": (16, 256, 8, 1),   # lm_head [151936, 2048]
}
SWEEP = [(2, 256, 4, 1), (2, 256, 4, 2), (4, 256, 4, 1), (4, 256, 4, 2), (4, 256, 4, 4), (8, 256, 4, 1),
         (8, 256, 4, 2), (8, 512, 4, 1), (16, 256, 8, 1), (16, 512, 8, 1)]  # tools/bench_dense_gemv.py (no spills)


def shape_class(n: int, k: int) -> str:
    if n <= 512:
        return "tiny"
    if n <= 4096:
        return "small"
    return "medium" if n <= 16384 else "large"


@triton.jit
def _gemv_kernel(x, w, b, y, T, N, K, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UNROLL: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    # All tensors are 2D [BLOCK_N, *] in the weight tile's layout (no layout conversions): each token's dot is reduced
    # along K per step, within a warp (warps split the rows), into its column of acc [BLOCK_N, T_PAD].
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ld = tl.minimum(rows, N - 1)
    ts = tl.arange(0, T_PAD)
    kk = tl.arange(0, BLOCK_K)
    w_ptr = w + rows_ld.to(tl.int64)[:, None] * K + kk[None, :]
    acc = tl.zeros((BLOCK_N, T_PAD), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
        if EVEN_K:
            wv = tl.load(w_ptr + k0, eviction_policy="evict_first").to(tl.float32)
        else:
            k_mask = k0 + kk < K
            wv = tl.load(w_ptr + k0, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
        for t in tl.static_range(T_PAD):
            t_ld = tl.minimum(T - 1, t)
            if EVEN_K:
                xv = tl.load(x + t_ld * K + k0 + kk[None, :]).to(tl.float32)
            else:
                xv = tl.load(x + t_ld * K + k0 + kk[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
            part = tl.sum(wv * xv, axis=1)
            if T_PAD == 1:
                acc += part[:, None]
            else:
                acc += tl.where(ts[None, :] == t, part[:, None], 0.0)
    if HAS_BIAS:
        acc += tl.load(b + rows_ld).to(tl.float32)[:, None]
    mask = (ts < T)[None, :] & (rows < N)[:, None]
    tl.store(y + ts[None, :] * N + rows[:, None], acc.to(y.dtype.element_ty), mask=mask)


def pick_config(n: int, k: int, dtype: torch.dtype, config: tuple[int, int, int, int] | None = None):
    """(BLOCK_N, BLOCK_K, num_warps, UNROLL) for an [n, k] weight of `dtype` (config overrides the table)."""
    bn, bk, warps, unroll = config or CONFIGS[shape_class(n, k)]
    if dtype.itemsize == 4:
        bk //= 2  # keep 16-byte vectors per thread with the same lane count along K
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    return min(bn, triton.next_power_of_2(n)), bk, warps, unroll


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [T, K] (T <= MAX_TOKENS, contiguous), weight [N, K] contiguous, bias [N] or None, one dtype -> y [T, N]."""
    T, K = x.shape
    N = weight.shape[0]
    if T > MAX_TOKENS or T < 1 or weight.shape[1] != K or x.dtype != weight.dtype:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("gemv: x and weight must be contiguous")
    bn, bk, warps, unroll = pick_config(N, K, x.dtype, config)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, weight if bias is None else bias, y, T, N, K, T_PAD=triton.next_power_of_2(T), BLOCK_N=bn,
        BLOCK_K=bk, UNROLL=unroll, EVEN_K=K % bk == 0, HAS_BIAS=bias is not None, num_warps=warps, num_stages=1)
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 F.linear cast to x's dtype: what `gemv` computes up to fp32 summation order."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
