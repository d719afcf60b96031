"""Dense linear layers: plain weights, or quantized per `manifest.quant.linears`.

`y = x @ W.T (+ bias)` with `W [out, in]`. Quantized schemes (specs/families.md, "Quantized linears"):
* `nvfp4`: `weight` u8 [out, in/2], `weight_scale` f8_e4m3 [out, in/16], `weight_scale_2` f32 [out];
* `fp8_row`: `weight` f8_e4m3 [out, in], `weight_scale` f32 [out].
Dense quantized linears are dequantized once, at `prepare`, into the compute dtype (exact up to that dtype's
rounding); only expert banks must stay quantized in memory, and those never pass through this class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.formats.quant import fp8, nvfp4
from ft.runtime.layers.base import REQUIRED, Op

PLAIN_SCHEMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANT_SCHEMES = ("nvfp4", "fp8_row")


class Linear(Op):
    optional = ("bias", "weight_scale", "weight_scale_2")

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED

    def prepare(self, name: str, scheme: str | None, dtype: torch.dtype, device: torch.device) -> None:
        """Check the bound tensors against `scheme` (None = plain) and put the weight on `device` in `dtype`.

        Plain weights keep their storage when dtype and device already match (CPU: the zero-copy mmap view)."""
        siblings = {"weight_scale": self.weight_scale, "weight_scale_2": self.weight_scale_2}
        if scheme is None or scheme in PLAIN_SCHEMES:
            extra = [k for k, v in siblings.items() if v is not None]
            if extra:
                raise ValueError(f"{name}: has {extra} but manifest.quant.linears lists no quantized scheme for it")
            if not self.weight.is_floating_point():
                raise ValueError(f"{name}.weight is {self.weight.dtype} but the linear is not quantized")
            weight = self.weight
        elif scheme == "nvfp4":
            weight = self._dequant_nvfp4(name)
        elif scheme == "fp8_row":
            weight = self._dequant_fp8_row(name)
        else:
            raise ValueError(f"{name}: unsupported linear scheme {scheme!r}; supported: "
                             f"{sorted(PLAIN_SCHEMES) + list(QUANT_SCHEMES)}")
        self.weight = weight.to(device=device, dtype=dtype)
        self.weight_scale = self.weight_scale_2 = None
        if self.bias is not None:
            if self.bias.shape != (self.weight.shape[0],):
                raise ValueError(f"{name}.bias has shape {tuple(self.bias.shape)}, expected ({self.weight.shape[0]},)")
            self.bias = self.bias.to(device=device, dtype=dtype)

    def _dequant_nvfp4(self, name: str) -> torch.Tensor:
        if self.weight_scale is None or self.weight_scale_2 is None:
            raise ValueError(f"{name}: nvfp4 needs weight, weight_scale and weight_scale_2")
        return nvfp4.dequantize(self.weight, self.weight_scale, self.weight_scale_2)

    def _dequant_fp8_row(self, name: str) -> torch.Tensor:
        if self.weight_scale is None or self.weight_scale_2 is not None:
            raise ValueError(f"{name}: fp8_row needs exactly weight and weight_scale")
        if self.weight_scale.shape != (self.weight.shape[0],):
            raise ValueError(f"{name}: fp8_row wants weight_scale [out] = ({self.weight.shape[0]},), "
                             f"got {tuple(self.weight_scale.shape)}")
        return fp8.dequantize(self.weight, self.weight_scale)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
