"""Run the FtwWriter on one background thread so that reading and transforming the next tensor overlaps hashing and
writing the previous one (the writer's O_DIRECT writes block at disk speed).

Calls are applied strictly in submission order by a single worker, so the file layout and every byte written are
exactly those of calling the writer directly (compiles stay deterministic). Memory: at most `max_pending` bytes of
tensors wait in the queue, plus one oversized item (an embedding or LM head over `max_pending`) being written while
the caller goes on building the items after it (the write takes ~0.5 s a GB; waiting for it would also stop the
source pass once its window is full). A second oversized item is queued only once the first is written: the caller
holds at most that one meanwhile (models emit the embedding first and the LM head last, layers apart). The first
exception of the worker is re-raised on the next call and by `drain`.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch

from ft.formats import FtwWriter


class AsyncWriter:
    def __init__(self, w: FtwWriter, max_pending: int = 256 << 20) -> None:
        self.w, self.max_pending = w, max_pending
        self._q: queue.Queue = queue.Queue()
        self._pending = 0  # bytes of queued items up to max_pending
        self._big = False  # an oversized item is queued or being written
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ft-ftw-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, nbytes, big = job
            if self._error is None:
                try:
                    fn()
                except BaseException as e:  # surfaced on the caller's thread
                    self._error = e
            with self._cv:
                if big:
                    self._big = False
                else:
                    self._pending -= nbytes
                self._cv.notify_all()

    def _submit(self, fn: Callable[[], Any], nbytes: int) -> None:
        big = nbytes > self.max_pending
        with self._cv:
            while self._error is None and (self._big if big else
                                           self._pending > 0 and self._pending + nbytes > self.max_pending):
                self._cv.wait()
            self._raise()
            if big:
                self._big = True
            else:
                self._pending += nbytes
        self._q.put((fn, nbytes, big))

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


class _AsyncBank:
    def __init__(self, aw: AsyncWriter) -> None:
        self._aw = aw
        self._bank = None

    def bind(self, bank) -> None:
        self._bank = bank

    def write_expert(self, e: int, parts: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
        nbytes = sum(t.nbytes for v in parts.values() for t in (v if isinstance(v, tuple) else (v,)))
        self._aw._submit(lambda: self._bank.write_expert(e, parts), nbytes)
