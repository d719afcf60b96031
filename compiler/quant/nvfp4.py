"""NVFP4 quantization exactly as NVIDIA ModelOpt does it (non-TensorRT path); bytes defined in ft.formats.quant.nvfp4.

For `W [out, in]` (`in % 16 == 0`):
  1. `s2 = amax(|W|) / (6 * 448)`  (float32 per-tensor global; the caller may pass its own `scale_2`, e.g. the joint
     amax of a gate/up pair, which mimics ModelOpt's `sync_moe_gate_up_amax`).
  2. Per 16-element block: `bs = block_amax / (6 * s2)`, all-zero blocks get 1.0, cast to float8_e4m3fn.
  3. `x = W / (float32(bs) * s2)`.
  4. E2M1 magnitude = number of thresholds [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] strictly below `|x|`, plus one when
     `|x|` is exactly 0.75, 1.75 or 3.5 (round half to even on the E2M1 grid; |x| > 5 saturates to 6);
     code = sign << 3 | magnitude, the sign taken from `x < 0` (so -0.0 gets code 0, a negative x that rounds to
     zero code 8).
  5. Pack two codes per byte, element 2j in the low nibble.

How (the bytes are those of the rule above, checked against a literal reference in tests/compiler/
test_quantize_fast.py): the weight is processed in row chunks of about `CHUNK_ELEMS` elements, so that the float32
working copy and its integer temporaries stay in the core's cache and no float32 copy of a whole weight exists
(bf16 / fp16 weights are converted chunk by chunk); the chunk loop is TorchScript (`_scripted`), so one call per
weight runs without the GIL and expert workers (`ft.compiler.expert_jobs`) scale over cores. Block amax is a
max-pool of |x| over windows of 16. The magnitude (the E2M1 code index, i.e. |x| rounded half to even on the grid)
is computed without a search:
  * |x| >= 1: the E2M1 grid there is "1 mantissa bit", so rounding the float32 bits of |x| to 1 mantissa bit (add
    0x1FFFFF plus the kept bit, shift right by 22) gives `(biased exponent << 1 | mantissa bit)`, and the code is that
    minus 252 (1.0 = 127 << 1 -> 2, ..., 6.0 -> 7); anything larger saturates at 7;
  * |x| < 1: the grid is 0, 0.5, 1 (codes 0, 1, 2) = rint(2|x|) half to even, read off the float32 bits of
    `2 min(|x|, 1) + 2**23` (one correctly rounded addition of an exact value);
  * the larger of the two is the code (each one is below the true code outside its own range);
  * the sign: bit 31 of `x + 0.0` (which turns -0.0 into +0.0, so that it is exactly `x < 0`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from ft.formats.quant.nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX

CHUNK_ELEMS = 1 << 16  # elements per row chunk: 256 KiB of float32 plus temporaries, within a core's L2


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor weight_scale_2 = amax(|W|) / 2688 as a float32 0-dim tensor (|W| and its max are exact
    in W's own dtype, so a bf16 W needs no float32 copy)."""
    if w.numel() == 0:
        return torch.tensor(0.0)
    mn, mx = torch.aminmax(w.detach())  # max |w| = max(max, -min): exact, one pass, no |w| copy
    return (torch.maximum(mx, mn.neg()).float() / (E2M1_MAX * E4M3_MAX)).reshape(())


def joint_global_scale(*ws: torch.Tensor) -> torch.Tensor:
    """One weight_scale_2 for linears ModelOpt fuses (gate/up of an expert, q/k/v): amax over all of them / 2688."""
    return torch.stack([global_scale(w) for w in ws]).amax()


class _Scratch:
    """Reusable buffers for one row chunk of `n` elements: x, a float32 (xb: x's bits as int32), t, sign int32
    (t64: t as int64 pairs)."""

    def __init__(self, n: int) -> None:
        n += n & 1  # t64 needs an even length
        self.x, self.a = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        self.t, self.sign = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
        self.xb, self.t64 = self.x.view(torch.int32), self.t.view(torch.int64)


if (BLOCK, E4M3_MAX) != (16, 448.0):  # written as literals in the TorchScript below
    raise ImportError("ft.compiler.quant.nvfp4 assumes blocks of 16 and an e4m3 maximum of 448")


def _codes_into(x: torch.Tensor, xb: torch.Tensor, t: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """float32 x [n] and its bits xb (int32 view of x; both overwritten) -> int32 E2M1 codes in t [n] (module doc,
    step 4); `sign` [n] int32 scratch."""
    x.add_(0.0)  # -0.0 + 0.0 = +0.0: from here on the sign bit is `x < 0`
    torch.bitwise_right_shift(xb, 31, out=sign).bitwise_and_(8)  # 8 where x < 0
    xb.bitwise_and_(0x7FFFFFFF)  # |x|
    torch.bitwise_right_shift(xb, 22, out=t)
    t.bitwise_and_(1).add_(0x1FFFFF).add_(xb).bitwise_right_shift_(22).sub_(252)  # |x| >= 1: exp << 1 | mantissa
    x.clamp_(max=1.0).mul_(2.0).add_(8388608.0)  # 2 min(|x|, 1) + 2**23: rounded half to even to an integer
    lo = xb.sub_(0x4B000000)  # |x| < 1: rint(2|x|) (0x4B000000: the float32 bits of 2**23)
    torch.maximum(t, lo, out=t)
    return t.clamp_(max=7).bitwise_or_(sign)


def _quantize_loop(w: torch.Tensor, six_s2: torch.Tensor, s2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   x: torch.Tensor, xb: torch.Tensor, a: torch.Tensor, t: torch.Tensor, t64: torch.Tensor,
                   sign: torch.Tensor, rows: int) -> None:
    """w [out, in] (any float dtype) -> packed codes q [out, in/2] and e4m3 block scales scale [out, in/16], `rows`
    rows at a time through the scratch buffers (see _Scratch)."""
    out, n = w.shape[0], w.shape[1]
    for r0 in range(0, out, rows):
        r1 = min(out, r0 + rows)
        r, m = r1 - r0, (r1 - r0) * n
        xs = x[:m]
        xs.copy_(w[r0:r1].reshape(-1))  # exact widening to float32
        amax = torch.nn.functional.max_pool1d(torch.abs(xs, out=a[:m]).view(1, 1, m), 16).view(r, n // 16)
        bs = amax.div_(six_s2)  # block amax / (6 s2), step 2
        # all-zero blocks get 1.0 (ModelOpt); so do blocks whose scale underflows e4m3 (< 2**-9): their values are
        # < 2**-9 * 6 * s2 and quantize to code 0 instead of ModelOpt's inf/0 -> the dequantized block is 0 anyway
        bs = bs.clamp_(max=448.0).to(torch.float8_e4m3fn).float()
        bs.masked_fill_(bs == 0, 1.0)
        scale[r0:r1].copy_(bs)  # exact: bs is an e4m3 value
        xs.view(r, n // 16, 16).div_(bs.mul_(s2).unsqueeze(-1))  # step 3
        _codes_into(xs, xb[:m], t[:m], sign[:m])
        # pack: two int32 codes as one little-endian int64 (low word = element 2j) -> c[2j] | c[2j+1] << 4
        pair = t64[: m // 2]
        q[r0:r1].view(-1).copy_(pair.bitwise_right_shift(28).bitwise_or_(pair).bitwise_and_(0xFF))


@functools.cache
def _scripted() -> tuple[Callable, Callable]:
    """(_codes_into, _quantize_loop) as TorchScript: one call runs every op of every chunk of a weight in C++ with
    the GIL released, so that `ExpertJobs` workers scale over cores instead of queueing for the interpreter between
    small ops (about 40 per chunk). Callers run them with optimization off: exactly these eager ops, in this order.
    A torch without TorchScript gets the same functions run eagerly (same bytes; threads then scale less)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated, not removed
            return torch.jit.script(_codes_into), torch.jit.script(_quantize_loop)
    except Exception:  # noqa: BLE001 - any TorchScript failure falls back to the identical eager code
        return _codes_into, _quantize_loop


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their block scale -> uint8 E2M1 codes (round half to even, saturating)."""
    n = x.numel()
    sc = _Scratch(n)
    sc.x[:n].copy_(x.detach().reshape(-1))
    with torch.jit.optimized_execution(False):
        codes = _scripted()[0](sc.x, sc.xb, sc.t, sc.sign)
    return codes[:n].to(torch.uint8).reshape(x.shape)


def quantize(w: torch.Tensor, scale_2: torch.Tensor | float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (weight u8 [out, in/2], weight_scale e4m3 [out, in/16], weight_scale_2 f32 0-dim).

    `scale_2` defaults to ModelOpt's amax/2688. A larger value is always valid; a smaller one saturates block scales
    at 448 (and then E2M1 codes at 6). W may be float32, bfloat16 or float16 (the same bytes as W.float()).
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"NVFP4 quantize needs a 2-D weight with in % {BLOCK} == 0, got {tuple(w.shape)}")
    if not w.dtype.is_floating_point or w.dtype.itemsize < 2:
        raise ValueError(f"NVFP4 quantize needs a float32/bfloat16/float16 weight, got {w.dtype}")
    w = w.detach().contiguous()
    s2 = global_scale(w) if scale_2 is None else torch.as_tensor(scale_2, dtype=torch.float32).reshape(())
    if not torch.isfinite(s2) or s2 <= 0:
        s2 = torch.tensor(1.0, dtype=torch.float32)  # all-zero tensor: any positive global dequantizes to 0
    out, n = w.shape
    q = torch.empty((out, n // 2), dtype=torch.uint8)
    scale = torch.empty((out, n // BLOCK), dtype=torch.float8_e4m3fn)
    rows = max(1, CHUNK_ELEMS // max(1, n))
    six_s2 = E2M1_MAX * s2
    sc = _Scratch(min(out, rows) * n)
    with torch.jit.optimized_execution(False):
        _scripted()[1](w, six_s2, s2, q, scale, sc.x, sc.xb, sc.a, sc.t, sc.t64, sc.sign, rows)
    return q, scale, s2.clone()


def quantize_rows(*ws: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Linears that share one weight_scale_2 (an expert's gate and up: ModelOpt's joint amax) -> each in the
    compiler's row-wise NVFP4 form {"weight" u8 [out, in/2], "weight_scale" e4m3 [out, in/16],
    "weight_scale_2" f32 [out]} (the 0-dim global repeated per row, as `ft.compiler.linear.load` does)."""
    s2 = joint_global_scale(*ws)
    out = []
    for w in ws:
        q, s, g = quantize(w, s2)
        out.append({"weight": q, "weight_scale": s, "weight_scale_2": g.expand(w.shape[0]).contiguous()})
    return out
