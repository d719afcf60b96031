"""Reusable random pools that full-size synthetic checkpoints are cut from, so writing runs at disk speed.

Generating 35B Gaussian numbers (or quantizing them) would take far longer than writing them. Instead each pool is
generated once and every tensor is a window of it starting at a per-tensor offset derived from (seed, name), wrapping
around at the end. Windows are views of the pools, so writing costs no per-element work: a pool scaled to a tensor's
std (or, for NVFP4/FP8 twins, to its global scale) is built once per distinct value and cached (a model has only a
handful of distinct stds: one per fan-in class). Windows at different offsets of iid noise are uncorrelated, so
experts, heads and rows are distinct. Pool lengths are odd (in elements, or in 16-element blocks for NVFP4), so a
tensor longer than its pool continues with windows shifted against the rows, never with an exact repeat of a row.

* `NormalPool`: float32 N(0, 1) values.
* `Fp4Pool`: NVFP4 codes + e4m3 block scales of N(0, 1) data (ModelOpt quantization of the pool), kept block
  aligned: a window of n elements is n/2 code bytes and n/16 scales starting at the same block. `deq` holds the exact
  value E2M1 * block_scale in BF16 (at most 6 significant bits); a tensor's dequantized weights are `deq * scale_2`.
* `Fp8Pool`: e4m3 codes of N(0, 1) data and their exact BF16 values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ft.compiler.quant import fp8 as fp8_quant
from ft.compiler.quant import nvfp4 as nvfp4_quant
from ft.compiler.synth.routing import name_seed
from ft.formats.quant import nvfp4 as nvfp4_fmt

CHUNK = 1 << 24  # elements per produced chunk (smooth progress)
MAX_CACHED = 12  # scaled pools kept at once (~70 MB each in BF16)
NORMAL_LEN = (1 << 25) + 1_000_003
FP4_BLOCKS = (1 << 20) + 1_009  # 16.8M elements in 16-element blocks
FP8_LEN = (1 << 24) + 1_000_003


def _windows(start: int, n: int, period: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(begin, end) ranges of a length-n window starting at `start` on a ring of `period` items."""
    pos = start % period
    while n > 0:
        take = min(n, period - pos, chunk)
        yield pos, pos + take
        n -= take
        pos = (pos + take) % period


class _ScaledCache:
    """(scale, dtype) -> (base * scale).to(dtype), least recently used dropped beyond MAX_CACHED entries."""

    def __init__(self, base: torch.Tensor):
        self.base = base
        self.items: dict[tuple[float, torch.dtype], torch.Tensor] = {}

    def get(self, scale: float, dtype: torch.dtype) -> torch.Tensor:
        key = (float(scale), dtype)
        t = self.items.pop(key, None)
        if t is None:
            t = (self.base.float() * scale).to(dtype)
            if len(self.items) >= MAX_CACHED:
                self.items.pop(next(iter(self.items)))
        self.items[key] = t
        return t


class NormalPool:
    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(name_seed(seed, "pool.normal"))
        self.values = torch.randn(NORMAL_LEN, generator=gen)
        self.scaled = _ScaledCache(self.values)

    def offset(self, seed: int, name: str) -> int:
        return name_seed(seed, "offset:" + name) % NORMAL_LEN

    def window(self, seed: int, name: str, numel: int, std: float, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """Chunks of std * pool[offset : offset + numel] (wrapping), in `dtype`."""
        pool = self.scaled.get(std, dtype)
        for a, b in _windows(self.offset(seed, name), numel, NORMAL_LEN, CHUNK):
            yield pool[a:b]

    def take(self, start: int, numel: int) -> torch.Tensor:
        """float32 pool[start : start + numel] (wrapping), as one tensor (numel <= pool length)."""
        return torch.cat([self.values[a:b] for a, b in _windows(start, numel, NORMAL_LEN, NORMAL_LEN)])


class Fp4Pool:
    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(name_seed(seed, "pool.fp4"))
        data = torch.randn(FP4_BLOCKS, nvfp4_fmt.BLOCK, generator=gen)
        codes, scales, s2 = nvfp4_quant.quantize(data)  # [B, 8] u8, [B, 1] e4m3
        self.codes = codes.reshape(-1)
        self.scales = scales.reshape(-1)
        unit = nvfp4_fmt.dequantize(codes, scales, torch.tensor(1.0))  # exact E2M1 * block scale
        self.deq = unit.to(torch.bfloat16).reshape(-1)
        if not torch.equal(self.deq.float(), unit.reshape(-1)):
            raise AssertionError("E2M1 * e4m3 products must be exact in BF16")
        self.unit_std = float(unit.std())  # dequantized std at scale_2 = 1
        self.scaled = _ScaledCache(self.deq)

    def block_offset(self, seed: int, name: str) -> int:
        return name_seed(seed, "offset:" + name) % FP4_BLOCKS

    def codes_window(self, seed: int, name: str, numel: int) -> Iterator[torch.Tensor]:
        k = self.block_offset(seed, name) * (nvfp4_fmt.BLOCK // 2)
        for a, b in _windows(k, numel // 2, self.codes.numel(), CHUNK):
            yield self.codes[a:b]

    def scales_window(self, seed: int, name: str, numel: int) -> Iterator[torch.Tensor]:
        for a, b in _windows(self.block_offset(seed, name), numel // nvfp4_fmt.BLOCK, FP4_BLOCKS, CHUNK):
            yield self.scales[a:b]

    def deq_window(self, seed: int, name: str, numel: int, scale_2: float,
                   dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """Exact dequantized values (deq * scale_2) of the same window, in `dtype`."""
        k = self.block_offset(seed, name) * nvfp4_fmt.BLOCK
        pool = self.scaled.get(scale_2, dtype)  # exact: deq has <= 6 significant bits, scale_2 two
        for a, b in _windows(k, numel, self.deq.numel(), CHUNK):
            yield pool[a:b]


class Fp8Pool:
    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(name_seed(seed, "pool.fp8"))
        codes, _ = fp8_quant.quantize(torch.randn(FP8_LEN, generator=gen))
        self.codes = codes
        self.unit_std = float(codes.float().std())
        self.scaled = _ScaledCache(codes)

    def offset(self, seed: int, name: str) -> int:
        return name_seed(seed, "offset:" + name) % FP8_LEN

    def codes_window(self, seed: int, name: str, numel: int) -> Iterator[torch.Tensor]:
        for a, b in _windows(self.offset(seed, name), numel, FP8_LEN, CHUNK):
            yield self.codes[a:b]

    def deq_window(self, seed: int, name: str, numel: int, scale: float, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        pool = self.scaled.get(scale, dtype)  # exact: e4m3 has 4 significant bits, scale two
        for a, b in _windows(self.offset(seed, name), numel, FP8_LEN, CHUNK):
            yield pool[a:b]
