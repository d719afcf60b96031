"""Fused FP4 MoE (W4A16) in Triton, reading FTW expert records straight from a pool of slots (NVFP4, and MXFP4 with
gpt-oss's biases and clamped SwiGLU: `fp4_format.py`, constexprs from `RecordLayout.kernel_args`).

Shapes: T tokens, k = top-k, P = T*k (token, expert) pairs, pair p = t*k + j. The pool is uint8 [S, stride]: slot s
holds one expert record (layout in `record_layout.py`). A plan groups the pairs by slot into blocks of BLOCK_M rows:
    sorted_pairs int32 [NB * BLOCK_M]  pair ids, each block's rows one slot's pairs, padded with the sentinel P
    block_slot   int32 [NB]            the block's slot; < 0 = no record (dead pairs, or an unused block)
`host_plan.plan_blocks` builds it on the host; `prefill_plan.plan_blocks_device` on the device, with NB a fixed bound
(unused blocks: slot -1, all rows P). Both kernels run a 1-D grid of NB * (N tiles) programs, the N tile varying
fastest, so consecutive programs share the block's activation rows and its expert's record (hot in L2):
    gate_up: act[r, n]  = bf16(act(x[t] . gate_n, x[t] . up_n))          r = padded row of the block, t = p // k
    down:    out[p, n]  = weight[p] * (act[r] . down_n)                     fp32 [P, H], the caller sums over k
(with biases: + gate_n's / up_n's bias inside act, + down_n's bias before the weight).
A block with slot < 0 exits at once in gate_up; in down, slot -1 writes 0 to its live rows (pairs whose expert has no
slot: a device plan puts them there) and exits, so `out` needs no zero fill; slot SKIP = -2 writes nothing (a
pipelined prefill runs one plan several times, each call giving slots to some experts' blocks only). The sum over k
runs afterwards in a fixed order (torch), no atomics: results are deterministic, and a pair's row does not depend on
the other rows of its block (an output row of a dot is its own row of A times B), so plans that differ only in block
order and padding compute every pair alike under the same tiles.

Dequantization happens in registers, from bits, with no lookup table in memory:
* E2M1 nibble `s eee`  -> fp16 bits `s 0 0 e e e 0...` equals the E2M1 value times 2^-14 (subnormal 0.5 included);
* e4m3 byte `s eeee mmm` -> fp16 bits `s 0 eeee mmm 0...` equals the e4m3 value times 2^-8 (an MXFP4 E8M0 byte:
  its power of two times 2^-8, `fp4_format._scale_shifted`);
* their product has at most 5 significant bits, so it is exact in bf16; the dot runs bf16 x bf16 -> fp32 and the
  per-row fp32 `scale_2` (times 2^22 to undo both shifts; 2^22 alone without one) is applied once to the fp32
  accumulator.
So the kernel differs from the exact reference only by fp32 summation order. `_weight_tile_k` gives a K tile in
natural K order: codes loaded as [BN, BK/2] bytes viewed as [BN, BK/16, 8], one block scale per 16 columns (MXFP4:
two groups load the same byte) decoded once and broadcast, low / high nibbles joined back into [BN, BK]. So each K
step is one dot over BK against a contiguous activation tile.

Tiles (`TILE_CONFIGS`, picked by rows per expert in `pick_blocks`): every M block of an expert dequantizes its
weight tiles again (~8-13 SASS instructions per weight element on sm_90), which at BLOCK_M = 128 issues longer than
the block's wgmma work, so BLOCK_M should be near the rows per expert (prefill of 4k tokens, top-8 of 256: ~128).
SWAP=1 computes the transposed product (weights as the dot's first operand, [BN, BM] accumulators): for few rows.

Kernels compile at first use (one per tile configuration, about a second each), not yet ahead into FTW `kernels/`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .fp4_format import _e2m1_shifted, _gated, _row_bias, _row_scale, _scale_shifted
from ..record_layout import RecordLayout

_UNSHIFT = 4194304.0  # 2^22 = 2^14 (E2M1 shift) * 2^8 (e4m3 shift)


@triton.jit
def _mma(a, b_t, acc, DOT_F32: tl.constexpr):
    # acc += a @ b_t.T. Triton's CPU interpreter mis-multiplies bf16 dots, so it runs them as exact fp32 (the
    # operands are bf16-exact either way); compiled kernels use bf16 tensor cores.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b_t), acc)


@triton.jit
def _to_bf16(v, DOT_F32: tl.constexpr):
    # fp32 -> bf16 with round-to-nearest-even. The interpreter truncates on a plain cast, so there the rounding is
    # done on the bits first (the cast of an already-bf16 value is then exact).
    if DOT_F32:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _weight_tile_k(rec, OFF_W: tl.constexpr, OFF_S: tl.constexpr, rows, row_mask, K: tl.constexpr, k0,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GPS: tl.constexpr, E8M0: tl.constexpr):
    # rows [BN] output rows -> bf16 [BN, BK] = W[rows, k0:k0+BK] * 2^-22, natural K order
    # The codes are loaded as a 2-D [BN, BK/2] tile (contiguous along K, so lanes run along K) and only then split
    # into scale groups. A 3-D load puts the lanes along rows, and Triton 3.6 then fails to build a wgmma B operand
    # from the joined tile ("Illegal shared layout" in TritonGPUOptimizeDotOperands) or stores it with 2-byte writes.
    g = tl.arange(0, BLOCK_K // 16)  # 16-column groups of the tile: 8 code bytes each, GPS groups per scale byte
    j = tl.arange(0, BLOCK_K // 2)
    c = tl.load(rec + OFF_W + rows[:, None] * (K // 2) + (k0 // 2 + j)[None, :], mask=row_mask[:, None], other=0)
    c = tl.reshape(c.to(tl.uint16), (BLOCK_N, BLOCK_K // 16, 8))  # [BN, BK/16, 8]
    sc = tl.load(rec + OFF_S + rows[:, None] * (K // (16 * GPS)) + ((k0 // 16 + g) // GPS)[None, :],
                 mask=row_mask[:, None], other=0)
    s = _scale_shifted(sc.to(tl.uint16), E8M0)[:, :, None]  # [BN, BK/16, 1]
    lo = (_e2m1_shifted(c & 15) * s).to(tl.bfloat16)  # element 2j of byte j
    hi = (_e2m1_shifted(c >> 4) * s).to(tl.bfloat16)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # [BN, BK/16, 8, 2] -> [BN, BK]


@triton.jit
def _block_rows(sorted_pairs, block_slot, pid, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # program pid -> (slot, padded rows r [BM] int64, pair ids [BM], output columns n [BN]); N tiles vary fastest
    nt: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // nt
    slot = tl.load(block_slot + pid_m)
    r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs + r)
    n = (pid % nt) * BLOCK_N + tl.arange(0, BLOCK_N)
    return slot, r, pairs, n


@triton.jit
def _outer(vm, vn, SWAP: tl.constexpr):
    # per-row [BM] and per-column [BN] vectors broadcast against the accumulator: [BM, 1] and [1, BN], or
    # [1, BM] and [BN, 1] when SWAP ([BN, BM] accumulators)
    if SWAP:  # if / else, not an early return: the compiler would also build the code after a constexpr return
        vm_b, vn_b = vm[None, :], vn[:, None]
    else:
        vm_b, vn_b = vm[:, None], vn[None, :]
    return vm_b, vn_b


@triton.jit
def _tile_dot(a, w, acc, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    # a [BM, BK] activation rows, w [BN, BK] weights: acc [BM, BN] += a @ w.T, or acc [BN, BM] += w @ a.T when SWAP
    if SWAP:
        acc = _mma(w, a, acc, DOT_F32)
    else:
        acc = _mma(a, w, acc, DOT_F32)
    return acc


@triton.jit
def _gate_up_kernel(
    pool, slot_stride, x, act, sorted_pairs, block_slot, num_pairs,
    TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    OFF_GU: tl.constexpr, OFF_GUS: tl.constexpr, OFF_GUS2: tl.constexpr, OFF_GUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr,
    GPS: tl.constexpr, E8M0: tl.constexpr, S2: tl.constexpr, BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    # act[r, n] = bf16(act(g, u)), g = row n, u = row I + n of gate_up applied to x[pair // TOPK] (+ biases);
    # act [NB*BM, I]
    slot, r, pairs, n = _block_rows(sorted_pairs, block_slot, tl.program_id(0), I, BLOCK_M, BLOCK_N)
    if slot < 0:  # no record: dead pairs (down writes their zeros) or an unused block
        return
    rec = pool + slot.to(tl.int64) * slot_stride
    m_mask = pairs < num_pairs  # padding rows (sentinel P) are never read nor written
    tok = (pairs // TOPK).to(tl.int64)
    n_mask = n < I
    kk = tl.arange(0, BLOCK_K)
    if SWAP:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for k0 in range(0, H, BLOCK_K):
        xt = tl.load(x + tok[:, None] * H + k0 + kk[None, :], mask=m_mask[:, None], other=0.0)  # [BM, BK]
        wg = _weight_tile_k(rec, OFF_GU, OFF_GUS, n, n_mask, H, k0, BLOCK_N, BLOCK_K, GPS, E8M0)  # [BN, BK]
        acc_g = _tile_dot(xt, wg, acc_g, SWAP, DOT_F32)
        wu = _weight_tile_k(rec, OFF_GU, OFF_GUS, I + n, n_mask, H, k0, BLOCK_N, BLOCK_K, GPS, E8M0)
        acc_u = _tile_dot(xt, wu, acc_u, SWAP, DOT_F32)
    # rows and columns again rather than kept live over the loop: fewer registers (no spill on Triton 3.6)
    _, r, pairs, n = _block_rows(sorted_pairs, block_slot, tl.program_id(0), I, BLOCK_M, BLOCK_N)
    m_mask = pairs < num_pairs
    n_mask = n < I
    r_b, n_b = _outer(r, n, SWAP)
    mm_b, nm_b = _outer(m_mask, n_mask, SWAP)
    g = acc_g * _row_scale(rec, OFF_GUS2, n_b, nm_b, S2) + _row_bias(rec, OFF_GUB, n_b, nm_b, BIAS)
    u = acc_u * _row_scale(rec, OFF_GUS2, I + n_b, nm_b, S2) + _row_bias(rec, OFF_GUB, I + n_b, nm_b, BIAS)
    a = _gated(g, u, SWIGLU, ALPHA, LIMIT)
    tl.store(act + r_b * I + n_b, _to_bf16(a, DOT_F32), mask=mm_b & nm_b)


@triton.jit
def _down_kernel(
    pool, slot_stride, act, out, pair_weight, sorted_pairs, block_slot, num_pairs,
    H: tl.constexpr, I: tl.constexpr, OFF_D: tl.constexpr, OFF_DS: tl.constexpr, OFF_DS2: tl.constexpr,
    OFF_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr,
    GPS: tl.constexpr, E8M0: tl.constexpr, S2: tl.constexpr, BIAS: tl.constexpr,
):
    # out[p, n] = weight[p] * ((down row n) . act[r] + bias[n])   (fp32 [P, H]); 0 for the live rows of a block of
    # slot -1
    slot, r, pairs, n = _block_rows(sorted_pairs, block_slot, tl.program_id(0), H, BLOCK_M, BLOCK_N)
    m_mask = pairs < num_pairs
    p64 = pairs.to(tl.int64)
    n_mask = n < H
    if slot < 0:  # -1: the pairs' rows are 0; SKIP (-2): another call of the same plan writes them
        if slot == -1:
            tl.store(out + p64[:, None] * H + n[None, :], tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                     mask=m_mask[:, None] & n_mask[None, :])
        return
    rec = pool + slot.to(tl.int64) * slot_stride
    kk = tl.arange(0, BLOCK_K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        at = tl.load(act + r[:, None] * I + k0 + kk[None, :], mask=m_mask[:, None], other=0.0)  # [BM, BK]
        wd = _weight_tile_k(rec, OFF_D, OFF_DS, n, n_mask, I, k0, BLOCK_N, BLOCK_K, GPS, E8M0)  # [BN, BK]
        acc = _tile_dot(at, wd, acc, SWAP, DOT_F32)
    _, r, pairs, n = _block_rows(sorted_pairs, block_slot, tl.program_id(0), H, BLOCK_M, BLOCK_N)  # as in gate_up
    m_mask = pairs < num_pairs
    p64 = pairs.to(tl.int64)
    n_mask = n < H
    s2 = _row_scale(rec, OFF_DS2, n, n_mask, S2)
    w_b, s2_b = _outer(tl.load(pair_weight + pairs, mask=m_mask, other=0.0), s2, SWAP)
    _, bias_b = _outer(m_mask, _row_bias(rec, OFF_DB, n, n_mask, BIAS), SWAP)
    p_b, n_b = _outer(p64, n, SWAP)
    mm_b, nm_b = _outer(m_mask, n_mask, SWAP)
    tl.store(out + p_b * H + n_b, (acc * s2_b + bias_b) * w_b, mask=mm_b & nm_b)


# Tile configurations by name (values in TILE_KEYS order); `PICK` maps rows per expert (upper bound) to a name.
# BLOCK_K is fitted down to a power of two dividing H and I; num_warps / num_stages are launch options.
TILE_KEYS = ("BLOCK_M", "BLOCK_N_GU", "BLOCK_N_D", "BLOCK_K", "SWAP", "num_warps", "num_stages")
TILE_CONFIGS: dict[str, dict[str, int]] = {name: dict(zip(TILE_KEYS, v)) for name, v in {
    "decode": (16, 32, 64, 128, 0, 4, 2),
    "small": (32, 64, 64, 64, 0, 4, 3),
    "medium": (64, 64, 128, 64, 0, 4, 3),
    "large": (128, 64, 128, 64, 0, 8, 3),
}.items()}
PICK: tuple[tuple[float, str], ...] = ((16, "decode"), (40, "small"), (96, "medium"), (math.inf, "large"))
LAUNCH_DEFAULTS = {"SWAP": 0, "num_warps": 4, "num_stages": 2}  # for `blocks` dicts that name tile sizes only


def pick_blocks(num_rows_per_expert: float, hidden: int, inter: int) -> dict[str, int]:
    """The `TILE_CONFIGS` entry for this many rows per expert (a copy; hidden / inter fit BLOCK_K at launch)."""
    return dict(TILE_CONFIGS[next(name for bound, name in PICK if num_rows_per_expert <= bound)])


def _fit_block_k(block_k: int, *dims: int) -> int:
    # largest power of two <= block_k (and >= 32) dividing every reduction dim; H and I are multiples of 32
    while block_k > 32 and any(d % block_k for d in dims):
        block_k //= 2
    return block_k


def moe_blocks(pool: torch.Tensor, layout: RecordLayout, x: torch.Tensor, topk: int, sorted_pairs: torch.Tensor,
               block_slot: torch.Tensor, pair_weight: torch.Tensor, out: torch.Tensor, blocks: dict) -> None:
    """Run both kernels over a plan (host or device built; see the module docstring), all tensors on one device.

    x bf16 [T, H] contiguous; pair_weight fp32 [P] (P = T * topk); out fp32 [P, H]: the rows of pairs in blocks are
    written (0 where the block's slot is < 0), other rows are left untouched. Host work depends on shapes only.
    """
    b = {**LAUNCH_DEFAULTS, **blocks}
    H, I = layout.hidden, layout.inter
    P = out.shape[0]
    bm = b["BLOCK_M"]
    nb = block_slot.shape[0]
    if nb == 0:
        return
    if sorted_pairs.shape[0] != nb * bm:
        raise ValueError(f"plan of {nb} blocks of {bm} rows needs {nb * bm} sorted pairs, got {sorted_pairs.shape[0]}")
    interp = x.device.type != "cuda"  # only the interpreter runs kernels on CPU tensors
    act = torch.empty(nb * bm, I, dtype=torch.bfloat16, device=x.device)  # by padded row: down reads it in blocks
    launch = {"num_warps": b["num_warps"], "num_stages": b["num_stages"]}
    bk_gu, bk_d = _fit_block_k(b["BLOCK_K"], H), _fit_block_k(b["BLOCK_K"], I)
    _gate_up_kernel[(nb * triton.cdiv(I, b["BLOCK_N_GU"]),)](
        pool, layout.stride, x, act, sorted_pairs, block_slot, P, topk, H, I,
        layout.off_gate_up, layout.off_gate_up_scale, BLOCK_M=bm, BLOCK_N=b["BLOCK_N_GU"], BLOCK_K=bk_gu,
        SWAP=b["SWAP"], DOT_F32=interp, **layout.kernel_args("gate_up"), **launch,
    )
    _down_kernel[(nb * triton.cdiv(H, b["BLOCK_N_D"]),)](
        pool, layout.stride, act, out, pair_weight, sorted_pairs, block_slot, P, H, I,
        layout.off_down, layout.off_down_scale, BLOCK_M=bm, BLOCK_N=b["BLOCK_N_D"], BLOCK_K=bk_d,
        SWAP=b["SWAP"], DOT_F32=interp, **layout.kernel_args("down"), **launch,
    )
