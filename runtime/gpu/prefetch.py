"""Mode mapped's expert prefetch: a layer's misses start crossing the link while its attention still runs.

Without it a decode call's misses are copied only once the layer's router has chosen them, after the attention: at
a small VRAM budget the link idles through every layer's attention and the step waits for it through every MoE
call. The residual stream changes little from a layer's input to its MoE's input, so the layer's own router applied
to its input (through the MoE's norm) names most of the experts it will pick (`tools/bench_prefetch_guess.py`
measures how many: `benchmarks/prefetch_guess.md`). With `OffloadConfig.prefetch` = M > 0:

1. `DecoderLayer` hands its input x to `start` before the mixer's first kernel. On a side stream (high priority,
   forked from the compute stream, so inside a CUDA-graph capture it joins the capture) the guess `norm -> router
   top-k` runs, `gather.prefetch_missing` writes the first M distinct guessed experts without a slot (event `chosen`)
   and the GPU copies their records from the mapped bank into the last M rows of the prefill buffers (event
   `copied`).
2. The layer's MoE call `join`s: its plan waits for `chosen` only, so the plan and the CPU lane's post go ahead while
   the prefetch copy may still run; the plan reads a miss from its prefetch row where the guess was right
   (`pair_copy` 3). The call's own copy (the misses not prefetched) waits for `copied` (`wait_rows`): the link is
   busy with the prefetch until then anyway, and the MoE kernel keeps following that copy directly (with PDL its
   programs of other pairs start during it). A call of another path, or of another layer, waits for everything first
   (`settle`), before it may write the prefill buffers.
A wrong guess costs link time only. At most one prefetch is in flight: it is forked after the previous layer's MoE
call, whose kernels the side stream therefore waits for, so its rows are free; the call's own staging rows stay
below them (a call of more than `max_pairs` pairs gets no prefetch).
"""

from __future__ import annotations

from typing import Callable

import torch

from .kernels.gather import Prefetch


class ExpertPrefetch:
    def __init__(self, md, m: int) -> None:
        ex = md.ex
        self.md, self.m = md, m
        buffer_rows = 2 * ex.opts.prefill_slots
        if not 0 < m < buffer_rows:
            raise ValueError(f"prefetch of {m} records needs more than {m} prefill-buffer rows ({buffer_rows})")
        self.max_pairs = buffer_rows - m  # a call's staging rows (num_slots + p) stay below the prefetch rows
        self.buf = Prefetch(ex.device, m, ex.num_slots + self.max_pairs)
        self.cuda = ex.device.type == "cuda"
        self.stream = torch.cuda.Stream(ex.device, priority=-1) if self.cuda else None
        self.pending: int | None = None    # the layer whose prefetch is in flight, not joined yet
        self.ready_for: int | None = None  # the layer whose call may read the prefetch rows (joined)
        self.rows_pending = False          # ready_for's copy not yet waited for by the compute stream
        self._events: tuple = ()           # (chosen, copied) of the prefetch in flight (CUDA)

    def start(self, layer: int, x: torch.Tensor, guess: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Prefetch what `guess(x)` (int64 [T, k] expert ids) names for `layer`'s next call, if that call will take
        the mapped path with a mapped bank."""
        from .mapped_path import uses_mapped

        md, ex = self.md, self.md.ex
        T = x.shape[0]
        if T * ex.k > self.max_pairs or not uses_mapped(ex, layer, T) or layer not in md.base:
            return
        self.settle()  # a prefetch not joined (no MoE call since): its rows are about to be rewritten
        if self.cuda:
            chosen, copied = torch.cuda.Event(), torch.cuda.Event()
            self.stream.wait_stream(torch.cuda.current_stream(ex.device))
            with torch.cuda.stream(self.stream):
                self._issue(layer, x, guess, lambda: chosen.record(self.stream))
                copied.record(self.stream)
            self._events = (chosen, copied)
        else:
            self._issue(layer, x, guess, None)
        self.pending = layer

    def _issue(self, layer: int, x: torch.Tensor, guess, between) -> None:
        md, ex, buf = self.md, self.md.ex, self.buf
        ids = guess(x)
        bank = ex.banks[layer]
        if not self.cuda and not ex.interpret:  # CPU emulation: the reference choice, copied in PyTorch
            from .kernels.gather import prefetch_reference

            chosen = prefetch_reference(ids, md.table.tensor, layer, buf.m)
            buf.ids.fill_(-1)
            for j, e in enumerate(chosen):
                ex.pool[buf.row0 + j] = bank.record(e)
                buf.ids[j] = e
            return
        from .kernels.gather import prefetch_missing

        prefetch_missing(ex.pool, ex.layout, ids, md.table.tensor, layer, md.base[layer], bank.stride, buf,
                         between=between)

    def join(self, layer: int, *, reads: bool) -> None:
        """At the start of every MoE call (`GpuExperts.__call__`). `reads`: the call takes the mapped path, whose plan
        may read a prefetch made for its layer once the choice is written (the rows wait for `wait_rows`); any other
        call waits for the whole prefetch in flight."""
        self.ready_for = None
        if self.pending is None:
            return
        if not (reads and self.pending == layer):
            self.settle()
            return
        if self.cuda:
            torch.cuda.current_stream(self.md.ex.device).wait_event(self._events[0])
        self.ready_for, self.rows_pending, self.pending = layer, True, None

    def wait_rows(self) -> None:
        """Before the call's own copy (and so before its MoE kernel): the compute stream waits for the prefetch rows."""
        if self.rows_pending and self.cuda:
            torch.cuda.current_stream(self.md.ex.device).wait_event(self._events[1])
        self.rows_pending = False

    def settle(self) -> None:
        """The compute stream waits for every prefetch copy issued so far."""
        if self.pending is not None or self.rows_pending:
            if self.cuda:
                torch.cuda.current_stream(self.md.ex.device).wait_event(self._events[1])
            self.pending, self.rows_pending = None, False

    def for_call(self, layer: int) -> Prefetch | None:
        return self.buf if self.ready_for == layer else None

    def emulated(self, layer: int) -> dict[int, int]:
        """CPU emulation: expert -> prefetch row of what `layer`'s call may read."""
        if self.ready_for != layer:
            return {}
        ids = self.buf.ids[:self.m].tolist()
        return {e: self.buf.row0 + j for j, e in enumerate(ids) if e >= 0}
