"""Per-tensor FP8 (e4m3fn) quantization as ModelOpt's FP8 export does it; bytes defined in ft.formats.quant.fp8.

`weight_scale = amax(|W|) / 448` (float32 0-dim; the caller may pass its own), `weight = cast_e4m3(W / weight_scale)`
with round-to-nearest-even and saturation at +-448.
"""

from __future__ import annotations

import torch

from ft.formats.quant.fp8 import E4M3_MAX


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """amax(|W|) / 448 as a float32 0-dim tensor."""
    return (w.detach().abs().amax().float() / E4M3_MAX).reshape(())


def quantize(w: torch.Tensor, scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., in] float -> (weight float8_e4m3fn, same shape; weight_scale float32 0-dim)."""
    w32 = w.detach().float()
    s = global_scale(w32) if scale is None else torch.as_tensor(scale, dtype=torch.float32).reshape(())
    if not torch.isfinite(s) or s <= 0:
        s = torch.tensor(1.0, dtype=torch.float32)  # all-zero tensor
    q = (w32 / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s.clone()


def quantize_rows(w: torch.Tensor, chunk_elems: int = 1 << 24) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (weight float8_e4m3fn [out, in], weight_scale float32 [out]): one scale per output row,
    amax(|row|) / 448 (1.0 for an all-zero row), codes rounded to nearest even; rows in chunks of `chunk_elems`
    elements so the float32 temporaries stay bounded. FTW's `fp8_row` scheme (`ft checkpoint --quantize-dense fp8`)."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"FP8 row quantization needs a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    out, n = w.shape
    q = torch.empty((out, n), dtype=torch.float8_e4m3fn)
    scale = torch.empty(out, dtype=torch.float32)
    step = max(1, chunk_elems // max(1, n))
    for a in range(0, out, step):
        w32 = w[a:a + step].detach().float()
        s = w32.abs().amax(dim=1) / E4M3_MAX
        s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
        q[a:a + step] = (w32 / s[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scale[a:a + step] = s
    return q, scale
