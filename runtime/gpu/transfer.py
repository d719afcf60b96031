"""Host -> VRAM expert uploads on a dedicated copy stream.

FTW records live in mmapped (pageable) file pages; an H2D copy from pageable memory is staged by the driver at a
fraction of the link speed. Two ways around it, both in `CudaUploader`:
  * registered ranges: `register(base, nbytes, view)` page-locks a whole expert bank in place (cudaHostRegister,
    read-only where the driver allows it) through `view`, memory holding the same bytes as [base, base + nbytes)
    (pinning.shared_view: a shared mapping of the same file pages); a record inside such a range is DMA'd straight
    from the file pages at link speed;
  * staging: any other record is copied (threaded memcpy) into one of a ring of pinned buffers, then DMA'd.
Staged copies run on a staging thread that consumes a FIFO of commands, so the caller never waits for a memcpy at
upload time: prefetches overlap the next attention block. A direct copy (a DMA from page-locked pages, microseconds
to issue) is issued at once on the caller's thread when nothing is queued: going through the staging thread would
make it wait until that thread wins the GIL from the caller, which keeps it while it drives the GPU. `fence()` waits
until every queued command is issued and returns an event on the copy stream; `after_compute(ev)` makes later
copies wait for ev (slot reuse). Commands are issued in call order (directly only when the FIFO is empty, queued
otherwise), so two uploads into one slot can never be reordered.

`HostUploader` is the same interface over a CPU "pool" (plain copies, no streams): the expert store runs on it in
CPU-only tests and emulation.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time

import torch

from .cpu.kernel import parallel_copy
from .pinning import clear_cuda_error, device_pointer


class HostUploader:
    def __init__(self, pool: torch.Tensor):
        self.pool = pool
        self.bytes = 0
        self.copies = 0
        self.staging_seconds = 0.0
        self.direct_copies = 0
        self.pinned_bytes = 0

    def register(self, base: int, nbytes: int, view: torch.Tensor | None = None) -> bool:
        return False

    def mapped_address(self, ptr: int, nbytes: int) -> int | None:
        return ptr  # a CPU "device" reads host memory as it is (kernels under the Triton interpreter)

    def locked_address(self, ptr: int, nbytes: int) -> int | None:
        return None

    def upload(self, slot: int, record: torch.Tensor) -> None:
        self.pool[slot].copy_(record)
        self.bytes += record.numel()
        self.copies += 1

    def upload_ranges(self, ranges: list[tuple[int, int, int]]) -> None:
        for slot, ptr, nbytes in ranges:
            n = nbytes // self.pool.shape[1]
            src = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
            self.pool[slot:slot + n].view(-1).copy_(src)
            self.bytes += nbytes
            self.copies += n

    def fence(self):
        return None

    def after_compute(self, event) -> None:
        return None

    def timing(self) -> tuple[int, float]:
        return 0, 0.0

    def close(self) -> None:
        return None


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
        self.direct_copies = 0  # from registered ranges, no staging memcpy
        self.pinned_bytes = 0
        # registered ranges: (start, end) addresses of the records as callers pass them, and the page-locked uint8
        # view of the same bytes that DMAs read
        self._ranges: list[tuple[int, int, torch.Tensor, int | None]] = []  # + the view's device address if mapped
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, end) per copy, not yet read
        self._lock = threading.Lock()
        self.staging_seconds = 0.0  # staging-thread time spent in pageable -> pinned copies
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="ft-h2d-staging", daemon=True)
        self._thread.start()

    # ---- pinning ---------------------------------------------------------------------------------------------
    def register(self, base: int, nbytes: int, view: torch.Tensor | None = None) -> bool:
        """Page-lock `view` (uint8 [nbytes], the bytes at [base, base + nbytes); default: that memory itself) so that
        records inside [base, base + nbytes) are DMA'd from it; False (nothing changed) if the driver refuses."""
        if view is None:
            view = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(base), dtype=torch.uint8)
        if view.numel() < nbytes:
            raise ValueError(f"register: view has {view.numel()} bytes, the range {nbytes}")
        cudart = torch.cuda.cudart()
        # ReadOnly (8: file pages stay shared) and Mapped (2: kernels may read it, see `mapped_address`) first; then
        # without Mapped, then plain (needs writable pages)
        for flags in (10, 8, 2, 0):
            rc = cudart.cudaHostRegister(view.data_ptr(), nbytes, flags)
            if int(rc) == 0:
                dptr = device_pointer(view.data_ptr()) if flags & 2 else None
                self._ranges.append((base, base + nbytes, view, dptr))
                self.pinned_bytes += nbytes
                return True
            clear_cuda_error()
        return False

    def mapped_address(self, ptr: int, nbytes: int) -> int | None:
        """Device address through which kernels read [ptr, ptr + nbytes) in place (a registered, mapped range holds
        it), else None."""
        for a, b, _, dptr in self._ranges:
            if dptr is not None and a <= ptr and ptr + nbytes <= b:
                return dptr + (ptr - a)
        return None

    def locked_address(self, ptr: int, nbytes: int) -> int | None:
        """Host address of the page-locked view holding the same bytes as [ptr, ptr + nbytes), else None. Its pages
        stay mapped (registering faulted them in and locks them): the CPU reads records there without a page fault,
        where a first read through the reader's own mapping faults each 4 KiB page in (435 faults a geom record)."""
        view = self._pinned(ptr, nbytes)
        return None if view is None else view.data_ptr()

    def _dma_source(self, record: torch.Tensor) -> torch.Tensor | None:
        """The page-locked bytes of `record` if a registered range holds it, else None."""
        return self._pinned(record.data_ptr(), record.numel())

    def _pinned(self, ptr: int, n: int) -> torch.Tensor | None:
        """The page-locked bytes [ptr, ptr + n) if a registered range holds them, else None."""
        for a, b, view, _ in self._ranges:
            if a <= ptr and ptr + n <= b:
                return view[ptr - a:ptr - a + n]
        return None

    # ---- commands (caller thread) ----------------------------------------------------------------------------
    def upload(self, slot: int, record: torch.Tensor) -> None:
        self._raise()
        if self._q.unfinished_tasks == 0 and self._dma_source(record) is not None:
            self._copy(slot, record)  # everything queued is issued already: the order holds
        else:
            self._q.put(("copy", slot, record))
        self.bytes += self.stride
        self.copies += 1

    def upload_ranges(self, ranges: list[tuple[int, int, int]]) -> None:
        """One DMA per (slot, ptr, nbytes): [ptr, ptr + nbytes) (whole records inside a registered range) into pool
        rows slot, slot + 1, .. (pool rows are contiguous and as long as bank records), after everything queued
        before them. All are checked before any is issued; one stream switch for all (a prefill group issues ~16:
        host time per DMA is what the copy engine waits for)."""
        srcs = []
        for slot, ptr, nbytes in ranges:
            n, rest = divmod(nbytes, self.stride)
            if rest or slot < 0 or slot + n > self.pool.shape[0]:
                raise ValueError(f"upload_ranges: {nbytes} bytes into rows {slot}.. of {self.pool.shape[0]}")
            src = self._pinned(ptr, nbytes)
            if src is None:
                raise ValueError("upload_ranges reads page-locked banks only")
            srcs.append((self.pool[slot:slot + n].view(-1), src))
        self._q.join()  # copies still queued go first: the order of uploads into one row holds
        self._raise()
        with torch.cuda.stream(self.stream):
            for dst, src in srcs:
                dst.copy_(src, non_blocking=True)
        nbytes = sum(src.numel() for _, src in srcs)
        self.bytes += nbytes
        self.copies += nbytes // self.stride
        self.direct_copies += nbytes // self.stride

    def after_compute(self, event: torch.cuda.Event) -> None:
        if self._q.unfinished_tasks == 0:
            self.stream.wait_event(event)
        else:
            self._q.put(("wait", event, None))

    def fence(self) -> torch.cuda.Event:
        self._q.join()
        self._raise()
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def timing(self) -> tuple[int, float]:
        """(copies, seconds they spent on the copy engine) among those finished since the last call (no waiting)."""
        n, ms, rest = 0, 0.0, []
        with self._lock:
            timed, self._timed = self._timed, []
        for start, end in timed:
            if end.query():
                n += 1
                ms += start.elapsed_time(end)
            else:
                rest.append((start, end))
        with self._lock:
            self._timed = rest + self._timed
        return n, ms / 1e3

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        self.stream.synchronize()
        cudart = torch.cuda.cudart()
        for _, _, view, _ in self._ranges:
            cudart.cudaHostUnregister(view.data_ptr())
        self._ranges.clear()
        self.pinned_bytes = 0

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("expert upload failed on the staging thread") from err

    # ---- the staging thread ----------------------------------------------------------------------------------
    def _work(self) -> None:
        torch.cuda.set_device(self.pool.device)
        while True:
            cmd = self._q.get()
            try:
                if cmd is None:
                    return
                if self._error is None:
                    kind, a, b = cmd
                    if kind == "wait":
                        self.stream.wait_event(a)
                    else:
                        self._copy(a, b)
            except BaseException as e:  # noqa: BLE001 - handed to the caller at its next upload/fence
                self._error = e
            finally:
                self._q.task_done()

    def _copy(self, slot: int, record: torch.Tensor) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        src = self._dma_source(record)
        if src is not None:
            self.direct_copies += 1
        else:
            i = self.next
            self.next = (i + 1) % len(self.staging)
            ev = self.events[i]
            if ev is not None:
                ev.synchronize()  # its previous H2D copy still reads this buffer
            t = time.perf_counter()
            parallel_copy(self.staging[i], record, self.copy_threads)
            self.staging_seconds += time.perf_counter() - t
            src = self.staging[i]
            self.events[i] = end
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            self.pool[slot].copy_(src, non_blocking=True)
            end.record(self.stream)
        with self._lock:
            self._timed.append((start, end))
