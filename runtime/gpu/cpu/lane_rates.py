"""The CPU lane's start-up measurement of the GPU side of a mapped decode call (`lane.lane_for` prices its split
with it): what one more staged miss costs the GPU.

It times the call's own copy kernel, with the launches `ft kernels build` covers (`compiler/kernels/launches.py`),
best of 5 with CUDA events (the first may compile: never the best), and returns None where it cannot be measured (no
CUDA, inside a graph capture, no mapped bank, too few staging rows or experts).
"""

from __future__ import annotations

import torch

COPY_RATE_MISSES = (2, 8)  # `copy_rate` times gather calls of this many staged misses (int32 ids [1, n])


def _best_ms(fn) -> float:
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def _measurable(md) -> bool:
    ex = md.ex
    return ex.device.type == "cuda" and not torch.cuda.is_current_stream_capturing() and bool(md.base)


def _staging_idle(ex) -> None:
    for ev in ex._prefill_done:  # the staging rows are prefill-buffer rows: no prefill may still read them
        if ev is not None:
            ev.synchronize()


def copy_rate(md) -> float | None:
    """Bytes/s of this GPU copying one more staged miss of a call from a mapped bank: the slope between calls of 2
    and 8 misses, measured here (the link, the host's memory and the copy kernel together, as the lane's split
    needs them)."""
    ex = md.ex
    if not _measurable(md) or 2 * ex.opts.prefill_slots < 8 or ex.E < 8:
        return None
    from ..kernels.gather import gather_missing

    layer = next(iter(md.base))
    table = torch.full((ex.L, ex.E), -1, dtype=torch.int32, device=ex.device)  # all misses, staged
    _staging_idle(ex)

    def calls(n: int):
        ids = torch.arange(n, dtype=torch.int32, device=ex.device).view(1, n)
        return lambda: gather_missing(ex.pool, ex.layout, ids, table, layer, md.base[layer], ex.banks[layer].stride,
                                      ex.num_slots)

    lo, hi = COPY_RATE_MISSES
    per = (_best_ms(calls(hi)) - _best_ms(calls(lo))) / (hi - lo) * 1e-3
    return ex.layout.payload_bytes / per if per > 0 else None

