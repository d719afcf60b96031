"""Run the FtwWriter on one background thread so that reading and transforming the next tensor overlaps the write
of the previous one (writes block whenever the kernel's dirty-page limit is reached, i.e. at disk speed).

Calls are applied strictly in submission order by a single worker, so the file layout and every byte written are
exactly those of calling the writer directly (compiles stay deterministic). Memory: at most `max_pending` bytes of
tensors wait in the queue; an oversized item is waited for before the caller goes on. The first exception of the
worker is re-raised on the next call and by `drain`.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from ft.formats import FtwWriter


class AsyncWriter:
    def __init__(self, w: FtwWriter, max_pending: int = 256 << 20, drop_every: int = 1 << 30,
                 keep_cached: int = 0) -> None:
        self.w, self.max_pending, self.drop_every = w, max_pending, drop_every
        # newest output bytes left in the page cache (for the final verify). Measured on a 24 GB machine with a 21 GB
        # output: keeping 6 GB cost more write CPU (44.8 s compile) than the verify saved; keeping none: 29.5 s.
        self.keep_cached = keep_cached
        self._since_drop = 0
        self._q: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ft-ftw-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, nbytes = job
            if self._error is None:
                try:
                    fn()
                except BaseException as e:  # surfaced on the caller's thread
                    self._error = e
            with self._cv:
                self._pending -= nbytes
                self._cv.notify_all()
            self._since_drop += nbytes
            if self._since_drop >= self.drop_every and self._error is None:
                self._since_drop = 0
                try:
                    _drop_written(Path(self.w.tmp_dir), self.keep_cached)
                except OSError:  # only a cache hint: the write itself is unaffected
                    pass

    def _submit(self, fn: Callable[[], Any], nbytes: int) -> None:
        with self._cv:
            while self._pending > 0 and self._pending + nbytes > self.max_pending and self._error is None:
                self._cv.wait()
            self._raise()
            self._pending += nbytes
        self._q.put((fn, nbytes))
        if nbytes > self.max_pending:  # an oversized item (embedding, lm_head) is written before the next is built,
            with self._cv:             # so two of them never coexist in memory
                while self._pending > 0 and self._error is None:
                    self._cv.wait()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def add_tensor(self, name: str, t: torch.Tensor) -> None:
        self._submit(lambda: self.w.add_tensor(name, t), t.nbytes)

    def add_expert_bank(self, name: str, scheme: str, num_experts: int, components: dict) -> "_AsyncBank":
        bank = _AsyncBank(self)
        self._submit(lambda: bank.bind(self.w.add_expert_bank(name, scheme, num_experts, components)), 0)
        return bank

    def drain(self) -> None:
        """Wait until every submitted call has run; re-raise the worker's error if any."""
        self._q.put(None)
        self._thread.join()
        self._raise()

    def cancel(self) -> None:
        """Skip whatever is still queued and stop the worker (before the caller aborts the writer)."""
        if self._error is None:
            self._error = RuntimeError("cancelled")
        self._q.put(None)
        self._thread.join()


def _drop_written(tmp_dir: Path, keep: int) -> None:
    """Drop from the page cache the output pages older than the newest `keep` bytes (those already on disk; dirty
    ones are scheduled for writeback by the same call and go next time).

    Written pages are not read again until the final verify, which gets the newest `keep` bytes from the cache; the
    rest would fill memory, and once it is full every page of every write goes through reclaim (measured: ~3 s of
    kernel CPU per GB written with a full cache against ~0.5 s with free memory)."""
    files = sorted((p.stat().st_mtime_ns, p) for p in tmp_dir.iterdir() if p.is_file())
    for _, p in reversed(files):
        size = p.stat().st_size
        if keep >= size:
            keep -= size
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, size - max(keep, 0), os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        keep = 0


class _AsyncBank:
    def __init__(self, aw: AsyncWriter) -> None:
        self._aw = aw
        self._bank = None

    def bind(self, bank) -> None:
        self._bank = bank

    def write_expert(self, e: int, parts: dict[str, torch.Tensor]) -> None:
        self._aw._submit(lambda: self._bank.write_expert(e, parts), sum(t.nbytes for t in parts.values()))
