"""Dense linear layers: plain weights, or quantized per `manifest.quant.linears`.

`y = x @ W.T (+ bias)` with `W [out, in]`. Quantized schemes (specs/families.md, "Quantized linears"):
* `nvfp4`: `weight` u8 [out, in/2], `weight_scale` f8_e4m3 [out, in/16], `weight_scale_2` f32 [out];
* `fp8_row`: `weight` f8_e4m3 [out, in], `weight_scale` f32 [out].
By default a quantized linear is dequantized once, at `prepare`, into the compute dtype (exact up to that dtype's
rounding). With `keep_quantized` (on the GPU, `OffloadConfig(dense="quantized")`, which `--dense-weights auto`
chooses at budgets that cannot hold every expert: the weights take 2-4x less room, which goes to the expert cache) the
stored bytes move to the device as they are. On CUDA, calls of at most `GEMV_MAX_TOKENS` bf16 rows (decode) run a
dequantizing GEMV that reads the stored bytes once (`gpu.kernels.dense_quant`);
other calls dequantize a chunk of weight rows at a time into the same compute-dtype values the default path holds
and multiply by them (the same results, for a transient of one chunk and one extra pass over the weight; on CUDA one
`gpu.kernels.dense_dequant` launch per chunk).
Plain bf16 / fp16 weights on a GEMV device (decided at `prepare`: `_gemv`) run calls of at most `dense_gemv.MAX_TOKENS`
rows through `gpu.kernels.dense_gemv` (one launch streaming the weight once) when the op is `_fused`; the stacked
weights of `stack_rows` go through `linear` the same way. The results equal `F.linear` up to fp32 summation order.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ft.formats.quant import fp8, nvfp4
from ft.runtime.layers.base import REQUIRED, Op, place

PLAIN_SCHEMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANT_SCHEMES = ("nvfp4", "fp8_row")
CHUNK_BYTES = 16 << 20  # fp32 dequantization transient per chunk of rows (keep_quantized)
# what `_chunked` holds at once beyond x and y: NVFP4's int64 codes and fp32 values, the scaled fp32 chunk and its
# compute-dtype copy (about 4.5 chunks); the VRAM split reserves it when dense linears stay quantized
DEQUANT_TRANSIENT = 5 * CHUNK_BYTES
GEMV_MAX_TOKENS = 8  # keep_quantized: rows of x up to which the dequantizing GEMV runs (= dense_quant.MAX_TOKENS)
DENSE_GEMV_MAX_TOKENS = 16  # plain weights: rows of x up to which the dense GEMV runs (= dense_gemv.MAX_TOKENS)
GEMV_DEVICES = ["cuda"]  # where the GEMVs run (tests add "cpu" under TRITON_INTERPRET=1; emptied if one fails to run)
DENSE_GEMV_DTYPES = (torch.bfloat16, torch.float16)  # plain weights the dense GEMV takes (fp32: cuBLAS)
log = logging.getLogger("ft.runtime")


class Linear(Op):
    optional = ("bias", "weight_scale", "weight_scale_2")

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED
        self._scheme: str | None = None  # set when the weight stays quantized (keep_quantized)
        self._dtype = torch.float32
        self._gemv = False  # plain weight that `linear` may run through the dense GEMV (`gemv_eligible`, at prepare)
        self._mma_from: int | None = None  # keep_quantized: rows of x from which the tensor-core product runs

    def prepare(self, name: str, scheme: str | None, dtype: torch.dtype, device: torch.device, *,
                keep_quantized: bool = False) -> None:
        """Check the bound tensors against `scheme` (None = plain) and put the weight on `device` in `dtype`, or,
        with `keep_quantized` and a quantized scheme, the stored tensors as they are (see the module docstring).

        Plain weights keep their storage when dtype and device already match (CPU: the zero-copy mmap view)."""
        siblings = {"weight_scale": self.weight_scale, "weight_scale_2": self.weight_scale_2}
        if scheme is None or scheme in PLAIN_SCHEMES:
            extra = [k for k, v in siblings.items() if v is not None]
            if extra:
                raise ValueError(f"{name}: has {extra} but manifest.quant.linears lists no quantized scheme for it")
            if not self.weight.is_floating_point():
                raise ValueError(f"{name}.weight is {self.weight.dtype} but the linear is not quantized")
        elif scheme == "nvfp4":
            if self.weight_scale is None or self.weight_scale_2 is None:
                raise ValueError(f"{name}: nvfp4 needs weight, weight_scale and weight_scale_2")
            nvfp4.check_shapes(self.weight, self.weight_scale, self.weight_scale_2)
        elif scheme == "fp8_row":
            if self.weight_scale is None or self.weight_scale_2 is not None:
                raise ValueError(f"{name}: fp8_row needs exactly weight and weight_scale")
            if self.weight_scale.shape != (self.weight.shape[0],):
                raise ValueError(f"{name}: fp8_row wants weight_scale [out] = ({self.weight.shape[0]},), "
                                 f"got {tuple(self.weight_scale.shape)}")
        else:
            raise ValueError(f"{name}: unsupported linear scheme {scheme!r}; supported: "
                             f"{sorted(PLAIN_SCHEMES) + list(QUANT_SCHEMES)}")
        self._dtype = dtype
        if scheme in QUANT_SCHEMES and keep_quantized:
            self._scheme = scheme
            if scheme == "nvfp4":  # codes and scales in one allocation: the GEMV finds the scales by their offset
                w, s = self.weight, self.weight_scale
                buf = torch.empty(w.numel() + s.numel(), dtype=torch.uint8, device=device)
                buf[:w.numel()].copy_(w.reshape(-1))
                buf[w.numel():].copy_(s.reshape(-1).view(torch.uint8))
                self.weight = buf[:w.numel()].view(w.shape)
                self.weight_scale = buf[w.numel():].view(s.dtype).view(s.shape)
            else:
                self.weight, self.weight_scale = self.weight.to(device), self.weight_scale.to(device)
            if self.weight_scale_2 is not None:
                self.weight_scale_2 = self.weight_scale_2.to(device)
        else:
            self.weight = place(self._dequant(0, self.weight.shape[0], scheme), device, dtype)
            self.weight_scale = self.weight_scale_2 = None
        if self.bias is not None:
            if self.bias.shape != (self.weight.shape[0],):
                raise ValueError(f"{name}.bias has shape {tuple(self.bias.shape)}, expected ({self.weight.shape[0]},)")
            self.bias = place(self.bias, device, dtype)
        self._gemv = self._scheme is None and gemv_eligible(self.weight, self.bias)
        if self._scheme is not None and torch.device(device).type in GEMV_DEVICES:
            self._mma_from = mma_rows(self._scheme, *self.weight_shape, dtype)

    def _dequant(self, r0: int, r1: int, scheme: str | None) -> torch.Tensor:
        """Weight rows [r0, r1): float32 for the quantized schemes (exact), the stored tensor otherwise."""
        w = self.weight[r0:r1]
        if scheme == "nvfp4":
            s2 = self.weight_scale_2
            return nvfp4.dequantize(w, self.weight_scale[r0:r1], s2 if s2.numel() == 1 else s2[r0:r1])
        if scheme == "fp8_row":
            return fp8.dequantize(w, self.weight_scale[r0:r1])
        return w

    @property
    def stays_quantized(self) -> bool:
        return self._scheme is not None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def weight_shape(self) -> tuple[int, int]:
        """(out, in) of the weight the layer applies, whether it is stored dequantized or not."""
        out, k = self.weight.shape
        return out, k * 2 if self._scheme == "nvfp4" else k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._scheme is None:
            return linear(x, self.weight, self.bias, gemv=self._gemv and self._fused)
        out, k = self.weight_shape
        picked = quantized_kernel(self._scheme, k, x.numel() // k, x.dtype, self._mma_from) \
            if self.weight.device.type in GEMV_DEVICES else None
        if picked is not None:
            kernel, what = picked
            try:
                y = kernel(self._scheme, x.reshape(-1, k).contiguous(), self.weight, self.weight_scale,
                           self.weight_scale_2)
            except Exception as e:  # noqa: BLE001 - e.g. a Triton build failure: same results, slower path
                log.warning("quantized %s failed (%s: %s); dense linears use chunked dequantization",
                            what, type(e).__name__, str(e)[:200])
                GEMV_DEVICES.clear()
            else:
                y = y if self.bias is None else y + self.bias
                return y.reshape(*x.shape[:-1], out)
        return self._chunked(x)

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias) with W dequantized a chunk of rows at a time (keep_quantized): on a GEMV device by one
        kernel straight into the compute dtype, else by PyTorch ops (the same values: `dense_dequant`'s docstring).
        A kernel that fails (e.g. a Triton build failure) sends this call and every later one to the PyTorch ops,
        whose chunks are sized for them."""
        if self.weight.device.type in GEMV_DEVICES:
            from ft.runtime.gpu.kernels.dense_dequant import dequantize_rows

            def rows(r0: int, r1: int) -> torch.Tensor:
                try:
                    return dequantize_rows(self._scheme, self.weight, self.weight_scale, self.weight_scale_2, r0, r1,
                                           self._dtype)
                except Exception as e:  # noqa: BLE001 - told apart from F.linear's errors below
                    raise _NoKernel from e

            try:
                return self._by_chunks(x, rows, kernel=True)
            except _NoKernel as e:
                log.warning("row dequantization kernel failed (%s: %s); dense linears dequantize with PyTorch ops",
                            type(e.__cause__).__name__, str(e.__cause__)[:200])
                GEMV_DEVICES.clear()
        return self._by_chunks(x, lambda r0, r1: self._dequant(r0, r1, self._scheme).to(self._dtype), kernel=False)

    def _by_chunks(self, x: torch.Tensor, rows, *, kernel: bool) -> torch.Tensor:
        """x @ W.T (+ bias), `rows(r0, r1)` giving W's rows in the compute dtype, over `dequant_chunks`."""
        out, k = self.weight_shape
        chunks = dequant_chunks(out, k, self._dtype, kernel)
        if len(chunks) == 1:
            return F.linear(x, rows(0, out), self.bias)
        y = x.new_empty(*x.shape[:-1], out)
        for r0, r1 in chunks:
            y[..., r0:r1] = F.linear(x, rows(r0, r1), None if self.bias is None else self.bias[r0:r1])
        return y


class _NoKernel(Exception):
    """`Linear._chunked`: the row dequantization kernel failed (the cause is chained)."""


def mma_rows(scheme: str, n: int, k: int, dtype: torch.dtype) -> int | None:
    """Rows of x from which a kept-quantized [n, k] linear computing in `dtype` runs the tensor-core product (None:
    never); decided once, at prepare (`dense_quant_mma.rows_from`)."""
    if dtype != torch.bfloat16:
        return None
    from ft.runtime.gpu.kernels import dense_quant_mma

    return dense_quant_mma.rows_from(scheme, n, k)


def quantized_kernel(scheme: str, k: int, rows: int, dtype: torch.dtype, mma_from: int | None):
    """(kernel, its name in logs) a kept-quantized linear's call of `rows` rows of x runs on a GEMV device, or None
    for the chunked dequantization: the tensor-core product from `mma_from` rows up to its MAX_TOKENS, else the
    dequantizing GEMV up to GEMV_MAX_TOKENS. `ft kernels build` replays the same choice (`launches.dense`)."""
    from ft.runtime.gpu.kernels import dense_quant, dense_quant_mma

    if mma_from is not None and mma_from <= rows <= dense_quant_mma.MAX_TOKENS and dtype == torch.bfloat16:
        return dense_quant_mma.quantized_mma, "tensor-core product"
    if rows <= GEMV_MAX_TOKENS and dense_quant.supported(scheme, k, dtype):
        return dense_quant.quantized_gemv, "GEMV"
    return None


def dequant_chunks(out: int, k: int, dtype: torch.dtype, kernel: bool) -> list[tuple[int, int]]:
    """The weight row ranges a kept-quantized [out, k] linear dequantizes one at a time for a call past the GEMV: on a
    GEMV device (`kernel`) DEQUANT_TRANSIENT bytes of `dtype` rows, else CHUNK_BYTES of fp32 rows (`ft kernels build`
    replays the kernel's chunks)."""
    rows = max(1, DEQUANT_TRANSIENT // (dtype.itemsize * k) if kernel else CHUNK_BYTES // (4 * k))
    return [(r0, min(out, r0 + rows)) for r0 in range(0, out, rows)]


def gemv_eligible(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(..., gemv=True)` may take the dense GEMV for this plain weight [out, in] (and bias [out]):
    bf16 / fp16, contiguous, on a GEMV device, bias (if any) contiguous in the same dtype. Decided once, at load."""
    return (weight.dtype in DENSE_GEMV_DTYPES and weight.is_contiguous() and weight.device.type in GEMV_DEVICES
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           gemv: bool = False) -> torch.Tensor:
    """F.linear(x [..., in], weight [out, in], bias); with `gemv` (the weight passed `gemv_eligible`, the op runs
    fused kernels) calls of at most dense_gemv.MAX_TOKENS rows in weight's dtype run `dense_gemv` (module docstring)."""
    k = weight.shape[1]
    if gemv and x.numel() <= DENSE_GEMV_MAX_TOKENS * k and x.dtype == weight.dtype and GEMV_DEVICES:
        from ft.runtime.gpu.kernels.dense_gemv import dense_gemv

        try:
            y = dense_gemv(x.reshape(-1, k), weight, bias)
        except Exception as e:  # noqa: BLE001 - e.g. a Triton build failure: same results, slower path
            log.warning("dense GEMV failed (%s: %s); linears use cuBLAS / chunked dequantization",
                        type(e).__name__, str(e)[:200])
            GEMV_DEVICES.clear()
        else:
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def stack_rows(linears: list[Linear]) -> torch.Tensor | None:
    """One weight [sum of the outs, in] whose row blocks ARE the given linears' weights (each becomes a view of its
    block), so projections of the same input run as one GEMM (at decode: one launch instead of several); None, with
    nothing changed, unless every linear is plain (not kept quantized), bias-free, and of one dtype, device and
    in-features."""
    ws = [op.weight for op in linears]
    if any(op.stays_quantized or op.bias is not None for op in linears) or \
            len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return None
    stacked = torch.cat(ws)
    start = 0
    for op, w in zip(linears, ws):
        op.weight = stacked[start:start + w.shape[0]]
        start += w.shape[0]
    return stacked
