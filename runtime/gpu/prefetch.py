"""Mode mapped's expert prefetch: the next MoE layer's misses cross the link while this layer still computes.

Without it a decode call's misses are copied only once the layer's router has chosen them: at a small VRAM budget
the link idles through every layer's attention, dense projections and hit experts, and the step waits for it
through every MoE call. The residual stream changes little from one layer to the next, so the next MoE layer's
router applied to this layer's post-attention residual (through that layer's own MoE norm) names most of the experts
it will pick (`tools/bench_prefetch_guess.py` measures how many: `benchmarks/prefetch_guess.md`). With
`OffloadConfig.prefetch` = M > 0:

1. `DecoderLayer` l hands its post-attention residual h to the next MoE layer n's `start`, before its own MoE call.
   On a side stream (forked from the compute stream, so inside a CUDA-graph capture it joins the capture) the guess
   `norm_n -> router_n top-k` runs, `gather.prefetch_missing` writes the first M distinct guessed experts of n
   without a slot (event `chosen`) and the GPU copies their records from n's mapped bank into n's M prefetch rows
   (event `copied`). The copy has layer l's MoE call and layer n's attention to finish in.
2. Layer n's MoE call `join`s: its plan waits for `chosen` only; the plan reads a miss from its prefetch row where the
   guess was right (`pair_copy` 3), and the misses not prefetched are split between the CPU lane and the GPU's own
   copy as without prefetch. The call's own copy waits for `copied` (`wait_rows`), so the MoE kernel keeps following
   that copy directly (with PDL its programs of other pairs start during it). A call of another path waits for every
   prefetch in flight first (`settle`), before it may write the prefill buffers.
A wrong guess costs link time only. Two prefetches may be in flight (the one layer n reads, and the one for the MoE
layer after n, forked in layer n before its call), so MoE layers alternate between two sets of M rows at the top of
the prefill buffers (by the parity of their rank among the MoE layers); a set is rewritten only by a prefetch forked
after the call that read it was queued. The calls' own staging rows stay below both sets (a call of more than
`max_pairs` pairs gets no prefetch). The first MoE layer has no layer before it and gets none.
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
        if not 0 < 2 * m < buffer_rows:
            raise ValueError(f"prefetch of {m} records needs more than {2 * m} prefill-buffer rows ({buffer_rows})")
        self.max_pairs = buffer_rows - 2 * m  # a call's staging rows (num_slots + p) stay below the prefetch rows
        self.bufs = [Prefetch(ex.device, m, ex.num_slots + self.max_pairs + i * m) for i in range(2)]
        self.parity = {layer: i % 2 for i, layer in enumerate(ex.moe_layers)}
        self.cuda = ex.device.type == "cuda"
        self.stream = torch.cuda.Stream(ex.device) if self.cuda else None
        self.pending: list[int | None] = [None, None]  # per row set: the layer whose prefetch is in flight, not joined
        self.ready_for: int | None = None  # the layer whose call may read its prefetch rows (joined)
        self.rows_pending = False          # ready_for's copy not yet waited for by the compute stream
        self._events: list[tuple] = [(), ()]  # per row set: (chosen, copied) of its prefetch (CUDA)

    def start(self, layer: int, x: torch.Tensor, guess: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Prefetch what `guess(x)` (int64 [T, k] expert ids) names for `layer`'s next call, if that call will take
        the mapped path with a mapped bank."""
        from .mapped_path import uses_mapped

        md, ex = self.md, self.md.ex
        T = x.shape[0]
        if T * ex.k > self.max_pairs or not uses_mapped(ex, layer, T) or layer not in md.base:
            return
        i = self.parity[layer]
        self.settle(i)  # a prefetch of this row set not joined (no call of its layer since): its rows are rewritten
        if self.cuda:
            chosen, copied = torch.cuda.Event(), torch.cuda.Event()
            self.stream.wait_stream(torch.cuda.current_stream(ex.device))
            x.record_stream(self.stream)  # the compute stream may drop x before the guess has read it
            with torch.cuda.stream(self.stream):
                self._issue(layer, x, guess, self.bufs[i], lambda: chosen.record(self.stream))
                copied.record(self.stream)
            self._events[i] = (chosen, copied)
        else:
            self._issue(layer, x, guess, self.bufs[i], None)
        self.pending[i] = layer

    def _issue(self, layer: int, x: torch.Tensor, guess, buf: Prefetch, between) -> None:
        md, ex = self.md, self.md.ex
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
        may read a prefetch made for its layer once the choice is written (the rows wait for `wait_rows`), and whose
        staging rows lie below the prefetch rows; any other call waits for every prefetch in flight."""
        self.wait_rows()  # a joined prefetch its call did not wait for (not expected: every mapped call does)
        self.ready_for = None
        if not reads:
            self.settle()
            return
        i = self.parity.get(layer)
        if i is None or self.pending[i] is None:
            return
        if self.pending[i] != layer:  # made for another call that never came: its rows are no one's
            self.settle(i)
            return
        if self.cuda:
            torch.cuda.current_stream(self.md.ex.device).wait_event(self._events[i][0])
        self.ready_for, self.rows_pending, self.pending[i] = layer, True, None

    def wait_rows(self) -> None:
        """Before the call's own copy (and so before its MoE kernel): the compute stream waits for the prefetch rows."""
        if self.rows_pending and self.cuda:
            torch.cuda.current_stream(self.md.ex.device).wait_event(self._events[self.parity[self.ready_for]][1])
        self.rows_pending = False

    def settle(self, only: int | None = None) -> None:
        """The compute stream waits for the prefetch copies of row set `only` (None: both) issued so far."""
        for i in (0, 1) if only is None else (only,):
            joined = self.rows_pending and self.parity[self.ready_for] == i
            if self.pending[i] is not None or joined:
                if self.cuda:
                    torch.cuda.current_stream(self.md.ex.device).wait_event(self._events[i][1])
                self.pending[i] = None
                if joined:
                    self.rows_pending = False

    def for_call(self, layer: int) -> Prefetch | None:
        return self.bufs[self.parity[layer]] if self.ready_for == layer else None

    def emulated(self, layer: int) -> dict[int, int]:
        """CPU emulation: expert -> prefetch row of what `layer`'s call may read."""
        if self.ready_for != layer:
            return {}
        buf = self.bufs[self.parity[layer]]
        ids = buf.ids[:self.m].tolist()
        return {e: buf.row0 + j for j, e in enumerate(ids) if e >= 0}
