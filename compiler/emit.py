"""Execute a prepared plan: read each source tensor once, transform, hand the result to the FTW writer.

Memory: the item being built (the largest is an embedding / lm_head or one expert) plus what waits in the async
writer's bounded queue; dtype conversion and dequantization run in row chunks straight into the output tensor, so a
conversion never holds the source and a float32 temporary of a whole vocabulary-sized matrix at the same time.
"""

from __future__ import annotations

from typing import Callable

import torch

from ft.compiler.async_writer import AsyncWriter
from ft.compiler.errors import CheckpointError
from ft.compiler.expert_jobs import ExpertJobs
from ft.compiler.experts import Bank
from ft.compiler.linear import (DtypePolicy, Rows, Sniffed, cat, dense_quantizable, dequantize, finalize, load,
                                quantize_dense, take, to_dtype)
from ft.compiler.plan import LinearItem, TensorItem
from ft.compiler.prepare import Prepared
from ft.compiler.safetensors_io import TensorReader
from ft.compiler.source import Checkpoint
from ft.compiler.source_stream import SourceStream

CHUNK_BYTES = 64 << 20


def _chunks(rows: int, row_bytes: int):
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


class Emitter:
    def __init__(self, ck: Checkpoint, w: AsyncWriter, pol: DtypePolicy, on_read: Callable[[int], None],
                 reader: TensorReader | SourceStream | None = None, threads: int = 1) -> None:
        self.ck, self.w, self.pol, self.on_read, self.threads = ck, w, pol, on_read, threads
        self.reader = reader if reader is not None else TensorReader()
        self.linears: dict[str, str] = {}  # FTW module -> quantized scheme (manifest.quant.linears)
        self._pre: dict[str, torch.Tensor] = {}  # tensors read ahead by `prefetch`, taken by `read`

    # -- reading --------------------------------------------------------------------------------
    def prefetch(self, names: list[str]) -> None:
        """Read these tensors (about to be `read` whole, in their own dtype) in one go where the reader can."""
        many = getattr(self.reader, "read_many", None)
        got = many([(n, self.ck.info(n)) for n in names]) if many is not None else None
        if got is not None:
            self.on_read(sum(t.nbytes for t in got))
            self._pre = dict(zip(names, got))

    def read(self, name: str, dtype: torch.dtype | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` (rows [r0, r1) of dim 0 if given), converted to `dtype` chunk by chunk if it differs."""
        pre = self._pre.pop(name, None)
        if pre is not None and rows is None:
            return pre if dtype is None else to_dtype(pre, dtype, name)
        info = self.ck.info(name)
        if dtype is None or info.torch_dtype == dtype or not info.shape:
            t = self.reader.read(name, info, rows)
            self.on_read(t.nbytes)
            return t if dtype is None else to_dtype(t, dtype, name)
        r0, r1 = rows or (0, info.shape[0])
        out = torch.empty((r1 - r0, *info.shape[1:]), dtype=dtype)
        for a, b in _chunks(r1 - r0, info.nbytes // max(1, info.shape[0])):
            part = self.reader.read(name, info, (r0 + a, r0 + b))
            self.on_read(part.nbytes)
            out[a:b] = to_dtype(part, dtype, name)
        return out

    def rows(self, sn: Sniffed, dtype: torch.dtype | None) -> Rows:
        """One HF linear in row-wise form; plain weights converted to `dtype` while reading."""
        return load(self.ck,
                    lambda n: self.read(n, dtype if n.endswith(".weight") and sn.scheme == "plain" else None), sn)

    def dequant_to(self, r: Rows, dtype: torch.dtype, what: str) -> torch.Tensor:
        """Exact dequantization rounded once to `dtype`, in row chunks (bounded float32 temporaries)."""
        packed = 2 if r.scheme in ("nvfp4", "mxfp4") else 1  # two 4-bit codes per byte
        out = torch.empty((r.out_features, r.t["weight"].shape[1] * packed), dtype=dtype)
        for a, b in _chunks(out.shape[0], out.shape[1] * 4):
            out[a:b] = to_dtype(dequantize(Rows(r.scheme, {k: v[a:b] for k, v in r.t.items()})), dtype, what)
        return out

    # -- items ----------------------------------------------------------------------------------
    def tensor(self, item: TensorItem) -> None:
        if item.kind == "index":
            t = self.read(item.src)
            if t.dtype.is_floating_point or t.numel() and (int(t.min()) < 0 or int(t.max()) >= 2 ** 31):
                raise CheckpointError(f"{item.src}: an index table of non-negative int32 values is expected, "
                                      f"got {t.dtype}")
            t = t.to(torch.int32)
        elif item.kind in ("keep", "conv"):
            t = self.read(item.src, self.pol.dtype)
            if item.kind == "conv":
                t = t.squeeze(1)  # [C, 1, K] -> [C, K]
        else:
            t = self.read(item.src, torch.float32)
            if item.kind == "norm_1p":
                t = t + 1.0  # zero-centred RMSNorm: the runtime multiplies by (1 + w), folded here in fp32
        if item.perm is not None:
            t = t.index_select(0, item.perm)
        self.w.add_tensor(item.name, t.contiguous())

    def linear(self, item: LinearItem, sns: list[Sniffed]) -> None:
        dtype = None if item.router else self.pol.dtype
        parts = [self.rows(sn, dtype) for sn in sns]
        # FTW has no block-FP8 scheme: such linears are always dequantized (exact, rounded once to pol.plain)
        if self.pol.dequant or len({p.scheme for p in parts}) > 1 or any(p.scheme == "fp8_block" for p in parts):
            parts = [Rows("plain", {"weight": self.dequant_to(p, self.pol.plain, item.name)}) if p.scheme != "plain"
                     else p for p in parts]
        r = cat(parts)
        if item.perm is not None:
            r = take(r, item.perm)
        if self.pol.quantize_dense and r.scheme == "plain" and not item.router and \
                dense_quantizable(item.name, item.in_features):
            r = quantize_dense(r, self.pol.quantize_dense)
        pol = DtypePolicy(None, self.pol.plain, self.pol.dequant, self.pol.quantize) if item.router else self.pol
        scheme, tensors = finalize(r, pol, item.name)
        if scheme in ("nvfp4", "fp8_row"):
            self.linears[item.name] = scheme
        for suffix, t in tensors.items():
            self.w.add_tensor(f"{item.name}.{suffix}", t.contiguous())
        if item.bias:
            b = cat([Rows("plain", {"weight": self.read(f"{sn.module}.bias", dtype)}) for sn in sns]).t["weight"]
            if item.perm is not None:
                b = b.index_select(0, item.perm)
            self.w.add_tensor(f"{item.name}.bias", b.contiguous())

    def bank(self, bank: Bank, jobs: ExpertJobs) -> None:
        """Experts read in order here, built on `jobs`' workers (--quantize), written in order (expert_jobs.py)."""
        bw = self.w.add_expert_bank(bank.item.name, bank.scheme, bank.item.num_experts, bank.components())
        jobs.run(bank.item.num_experts, lambda e: bank.job(self, e), bw.write_expert)

    def run(self, prep: Prepared) -> None:
        self.reader.expect([self.ck.info(n) for n in prep.consumed])
        jobs = ExpertJobs(self.threads if self.pol.quantize else 1)  # only quantizing banks have work to spread
        try:
            for item, src in prep.steps:
                if isinstance(item, TensorItem):
                    self.tensor(item)
                elif isinstance(item, LinearItem):
                    self.linear(item, src)
                else:
                    self.bank(src, jobs)
        finally:
            jobs.close()
            self.reader.close()

