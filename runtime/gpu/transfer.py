"""Moving expert records from host memory into VRAM slots.

Records live in the FTW mmap: pageable file pages, which the copy engine cannot read directly (a pageable
cudaMemcpy is staged by the driver at a fraction of the link speed). `CudaUploader` therefore copies each record
into one of a small ring of pinned staging buffers (threaded memcpy, bounded pinned memory: `num_staging` records)
and issues an async H2D copy from it on a dedicated copy stream. A staging buffer is reused only after the event of
its previous copy has completed. `fence()` returns an event the compute stream waits on before reading the slots;
`after_compute(event)` makes later copies wait for a kernel that still reads a slot about to be overwritten.

`HostUploader` is the same interface over a CPU "pool" (plain copies, no streams): the hybrid scheduler runs on it in
CPU-only tests and emulation.
"""

from __future__ import annotations

import time

import torch

from .cpu_nvfp4 import parallel_copy


class HostUploader:
    def __init__(self, pool: torch.Tensor):
        self.pool = pool
        self.bytes = 0
        self.copies = 0

    def upload(self, slot: int, record: torch.Tensor) -> None:
        self.pool[slot].copy_(record)
        self.bytes += record.numel()
        self.copies += 1

    def fence(self):
        return None

    def after_compute(self, event) -> None:
        return None

    def timing(self) -> tuple[int, float]:
        return 0, 0.0


class CudaUploader:
    def __init__(self, pool: torch.Tensor, *, num_staging: int = 8, copy_threads: int = 4):
        if pool.device.type != "cuda":
            raise ValueError("CudaUploader needs a CUDA slot pool")
        self.pool = pool
        self.stride = pool.shape[1]
        self.stream = torch.cuda.Stream(device=pool.device)
        self.staging = [torch.empty(self.stride, dtype=torch.uint8, pin_memory=True) for _ in range(num_staging)]
        self.events: list[torch.cuda.Event | None] = [None] * num_staging
        self.next = 0
        self.copy_threads = copy_threads
        self.bytes = 0
        self.copies = 0
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, end) per copy, not yet read
        self.staging_seconds = 0.0  # host time spent in pageable -> pinned copies

    def upload(self, slot: int, record: torch.Tensor) -> None:
        i = self.next
        self.next = (i + 1) % len(self.staging)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()  # its previous H2D copy still reads this buffer
        t = time.perf_counter()
        parallel_copy(self.staging[i], record, self.copy_threads)
        self.staging_seconds += time.perf_counter() - t
        start, ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            self.pool[slot].copy_(self.staging[i], non_blocking=True)
            ev.record(self.stream)
        self.events[i] = ev
        self._timed.append((start, ev))
        self.bytes += self.stride
        self.copies += 1

    def fence(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def after_compute(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def timing(self) -> tuple[int, float]:
        """(copies, seconds they spent on the copy engine) among those finished since the last call (no waiting)."""
        n, ms, rest = 0, 0.0, []
        for start, end in self._timed:
            if end.query():
                n += 1
                ms += start.elapsed_time(end)
            else:
                rest.append((start, end))
        self._timed = rest
        return n, ms / 1e3
