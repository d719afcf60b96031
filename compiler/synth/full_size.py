"""Full-size synthetic checkpoints, written tensor by tensor from random pools in bounded memory.

The name/shape table comes from transformers on the meta device (`tables.meta_table` + `tables.mtp_table`), the
value rule of every tensor from `weights.spec_for`, and the bytes from `pools`: big Gaussian tensors are windows of a
float32 pool times their std, embeddings are pool rows passed through `routing.embedding_rows`, and small tensors
(routers, norms, A_log, conv1d, biases) are materialized exactly as for small presets. NVFP4 / FP8 linears are windows
of pre-quantized code pools with a per-tensor global scale; their exact BF16 twin is the same window dequantized.
Peak memory is the pools (~0.4 GB) plus a few 64 MB chunks, whatever the model size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch

from ft.compiler.synth import routing
from ft.compiler.synth.nvfp4_checkpoint import input_scale, scale_group, scale_jitter, scheme_of, two_bit_scale
from ft.compiler.synth.pools import CHUNK, Fp4Pool, Fp8Pool, NormalPool
from ft.compiler.synth.shards import Entry, tensor_entry
from ft.compiler.synth.tables import TensorSpec
from ft.compiler.synth.weights import ValueContext, materialize_piece, pieces, spec_for

SMALL = 1 << 20  # tensors below this many elements are materialized with their own generator


class FullSizeWriter:
    """Builds lazy Entries (no tensor data until written) for one checkpoint and, with NVFP4, its twin."""

    def __init__(self, arch: str, ctx: ValueContext, quant: str):
        self.arch, self.ctx, self.quant = arch, ctx, quant

    # pools are built on first use, so listing entries (tables, sizes) costs no memory
    @functools.cached_property
    def normal(self) -> NormalPool:
        return NormalPool(self.ctx.seed)

    @functools.cached_property
    def fp4(self) -> Fp4Pool:
        return Fp4Pool(self.ctx.seed)

    @functools.cached_property
    def fp8(self) -> Fp8Pool:
        return Fp8Pool(self.ctx.seed)

    # ---- unquantized values -------------------------------------------------------------------------------------
    def _piece_chunks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        spec = spec_for(name, shape, self.ctx)
        numel = math.prod(shape)
        uniform_embedding = spec.kind == "embedding" and self.ctx.routing == "uniform"
        if (spec.kind == "normal" or uniform_embedding) and numel >= SMALL:
            yield from self.normal.window(self.ctx.seed, name, numel, spec.std, dtype)
        elif spec.kind == "embedding" and numel >= SMALL:  # skewed: each row gets its component along u replaced
            hidden = shape[-1]
            rows_per_chunk = max(1, CHUNK // hidden)
            for r0 in range(0, shape[0], rows_per_chunk):
                yield self.embedding_rows(name, hidden, r0, min(rows_per_chunk, shape[0] - r0)).to(dtype)
        else:
            yield materialize_piece(name, shape, self.ctx).to(dtype)

    def embedding_rows(self, name: str, hidden: int, row0: int, num_rows: int) -> torch.Tensor:
        """float32 rows [row0, row0 + num_rows) of a pool-backed embedding."""
        std = spec_for(name, (num_rows, hidden), self.ctx).std
        start = self.normal.offset(self.ctx.seed, name) + row0 * hidden
        rows = self.normal.take(start, num_rows * hidden).reshape(num_rows, hidden) * std
        return routing.embedding_rows(self.ctx.seed, rows, self.ctx.routing, std)

    def plain_entry(self, t: TensorSpec) -> Entry:
        def produce() -> Iterator[torch.Tensor]:
            for name, shape in pieces(t.name, t.shape):
                yield from self._piece_chunks(name, shape, t.dtype)
        return Entry(t.name, t.dtype, t.shape, produce)

    # ---- quantized values ---------------------------------------------------------------------------------------
    def _quant_entries(self, t: TensorSpec, scheme: str) -> tuple[list[Entry], Entry]:
        """ModelOpt tensors of one quantized linear and its exact twin; nothing is computed until written."""
        out_f, in_f = t.shape
        numel = out_f * in_f
        std = spec_for(t.name, t.shape, self.ctx).std
        mod, seed, name = t.name[: -len(".weight")], self.ctx.seed, t.name
        pool = (lambda: self.fp4) if scheme == "nvfp4" else (lambda: self.fp8)
        jitter = scale_jitter(seed, scale_group(self.arch, name))  # globals differ between tensors, gate/up share
        scale = lambda: two_bit_scale(std * jitter / pool().unit_std)  # noqa: E731  (BF16-exact, see nvfp4_checkpoint)
        scalar = lambda: (torch.tensor(scale(), dtype=torch.float32),)  # noqa: E731
        if scheme == "nvfp4":
            quant = [Entry(name, torch.uint8, (out_f, in_f // 2), lambda: pool().codes_window(seed, name, numel)),
                     Entry(f"{mod}.weight_scale", torch.float8_e4m3fn, (out_f, in_f // 16),
                           lambda: pool().scales_window(seed, name, numel)),
                     Entry(f"{mod}.weight_scale_2", torch.float32, (), scalar),
                     tensor_entry(f"{mod}.input_scale", input_scale("nvfp4"))]
        else:
            quant = [Entry(name, torch.float8_e4m3fn, t.shape, lambda: pool().codes_window(seed, name, numel)),
                     Entry(f"{mod}.weight_scale", torch.float32, (), scalar),
                     tensor_entry(f"{mod}.input_scale", input_scale("fp8"))]
        twin = Entry(name, t.dtype, t.shape, lambda: pool().deq_window(seed, name, numel, scale(), t.dtype))
        return quant, twin

    def entries(self, table: list[TensorSpec]) -> tuple[list[Entry], list[Entry] | None]:
        """(checkpoint entries, twin entries or None) in table order."""
        main: list[Entry] = []
        twin: list[Entry] = []
        for t in table:
            scheme = scheme_of(self.arch, t.name) if self.quant == "nvfp4" else None
            if scheme is None:
                e = self.plain_entry(t)
                main.append(e)
                twin.append(e)
            else:
                q, tw = self._quant_entries(t, scheme)
                main.extend(q)
                twin.append(tw)
        return main, (twin if self.quant == "nvfp4" else None)

    # ---- routing check without running the model ----------------------------------------------------------------
    def estimate_coverage(self, table: list[TensorSpec], top_k: int, num_tokens: int = 2048) -> list[routing.Coverage]:
        """Expert load predicted from the embedding rows of random tokens and the routers (see routing)."""
        embed = next(t for t in table if t.name.endswith("embed_tokens.weight"))
        vocab, hidden = embed.shape
        gen = torch.Generator().manual_seed(self.ctx.seed)
        ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
        if math.prod(embed.shape) >= SMALL:
            rows = torch.cat([self.embedding_rows(embed.name, hidden, i, 1) for i in ids.tolist()])
        else:
            rows = materialize_piece(embed.name, embed.shape, self.ctx)[ids]
        routers = [materialize_piece(t.name, t.shape, self.ctx) for t in table
                   if spec_for(t.name, t.shape, self.ctx).kind == "router" and not t.name.startswith("mtp.")]
        return routing.estimate_coverage(rows.to(embed.dtype).float(), routers, top_k)
