"""NVFP4 quantization exactly as NVIDIA ModelOpt does it (non-TensorRT path); bytes defined in ft.formats.quant.nvfp4.

For `W [out, in]` (`in % 16 == 0`):
  1. `s2 = amax(|W|) / (6 * 448)`  (float32 per-tensor global; the caller may pass its own `scale_2`, e.g. the joint
     amax of a gate/up pair, which mimics ModelOpt's `sync_moe_gate_up_amax`).
  2. Per 16-element block: `bs = block_amax / (6 * s2)`, all-zero blocks get 1.0, cast to float8_e4m3fn.
  3. `x = W / (float32(bs) * s2)`.
  4. E2M1 magnitude = number of thresholds [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] strictly below `|x|`, plus one when
     `|x|` is exactly 0.75, 1.75 or 3.5 (round half to even on the E2M1 grid; |x| > 5 saturates to 6);
     code = sign << 3 | magnitude, the sign taken from `x < 0`.
  5. Pack two codes per byte, element 2j in the low nibble.
"""

from __future__ import annotations

import torch

from ft.formats.quant.nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX, pack_nibbles

_THRESHOLDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_ROUND_UP_TIES = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor weight_scale_2 = amax(|W|) / 2688 as a float32 0-dim tensor."""
    return (w.detach().abs().amax().float() / (E2M1_MAX * E4M3_MAX)).reshape(())


def joint_global_scale(*ws: torch.Tensor) -> torch.Tensor:
    """One weight_scale_2 for linears ModelOpt fuses (gate/up of an expert, q/k/v): amax over all of them / 2688."""
    return torch.stack([global_scale(w) for w in ws]).amax()


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their block scale -> uint8 E2M1 codes (round half to even, saturating)."""
    a = x.abs()
    mag = torch.searchsorted(_THRESHOLDS.to(x.device), a.contiguous(), right=False).to(torch.uint8)
    mag += torch.isin(a, _ROUND_UP_TIES.to(x.device)).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def quantize(w: torch.Tensor, scale_2: torch.Tensor | float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (weight u8 [out, in/2], weight_scale e4m3 [out, in/16], weight_scale_2 f32 0-dim).

    `scale_2` defaults to ModelOpt's amax/2688. A larger value is always valid; a smaller one saturates block scales
    at 448 (and then E2M1 codes at 6).
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"NVFP4 quantize needs a 2-D weight with in % {BLOCK} == 0, got {tuple(w.shape)}")
    w32 = w.detach().float()
    s2 = global_scale(w32) if scale_2 is None else torch.as_tensor(scale_2, dtype=torch.float32).reshape(())
    if not torch.isfinite(s2) or s2 <= 0:
        s2 = torch.tensor(1.0, dtype=torch.float32)  # all-zero tensor: any positive global dequantizes to 0
    blocks = w32.unflatten(1, (-1, BLOCK))  # [out, in/16, 16]
    bs = blocks.abs().amax(dim=-1) / (E2M1_MAX * s2)
    # all-zero blocks get 1.0 (ModelOpt); so do blocks whose scale underflows e4m3 (< 2**-9): their values are
    # < 2**-9 * 6 * s2 and quantize to code 0 instead of ModelOpt's inf/0 -> the dequantized block is 0 either way
    bs = bs.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    bs = torch.where(bs == 0, torch.ones_like(bs), bs)
    x = blocks / (bs * s2).unsqueeze(-1)
    codes = e2m1_codes(x).flatten(1)
    return pack_nibbles(codes), bs.to(torch.float8_e4m3fn), s2.clone()


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
