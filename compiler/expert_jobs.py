"""Build expert records on worker threads while the compile goes on reading (`ft checkpoint --quantize`).

An expert bank is built in three steps per expert e: read its source tensors (on the compile's thread, in plan
order: the source stream serves reads in the order the plan announced), compute its components (quantization: pure
tensor work, any thread) and hand them to the writer (on the compile's thread, in expert order). `ExpertJobs.run`
keeps up to `2 * threads` experts, and at most `max_bytes` of their source bytes, between the first and the last step,
computing them on `threads` workers; the writer receives experts 0, 1, 2, ... exactly as in a serial compile, so the
output bytes do not depend on the thread count or on timing.

Why threads and not torch's intra-op pool: the quantizer works on cache-sized row chunks of one expert (tens of
microseconds per op), too small to split across cores without barrier overhead, while whole experts are
independent. torch releases the GIL inside each op, so the workers run in parallel; the compile sets torch's own
intra-op threads to 1, so each worker runs its ops on itself.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

Job = Callable[[], Any]


def default_threads() -> int:
    """All cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class ExpertJobs:
    """A pool of `threads` workers (none for 1: jobs then run inline, in order)."""

    def __init__(self, threads: int, max_bytes: int = 1 << 30) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads, self.max_bytes = threads, max_bytes
        self._ex = ThreadPoolExecutor(threads, thread_name_prefix="ft-expert") if threads > 1 else None

    def run(self, n: int, read: Callable[[int], tuple[Job, int]], write: Callable[[int, Any], None]) -> None:
        """For e in 0..n-1: `read(e)` -> (job, source bytes held) on this thread in order; `job()` on a worker;
        `write(e, job())` on this thread in order. The first failing job's exception is raised here."""
        if self._ex is None:
            for e in range(n):
                job, _ = read(e)
                write(e, job())
            return
        pending: deque[tuple[int, Future, int]] = deque()
        held = 0
        try:
            for e in range(n):
                job, nbytes = read(e)
                while pending and (len(pending) >= 2 * self.threads or held + nbytes > self.max_bytes):
                    e0, fut, b = pending.popleft()
                    write(e0, fut.result())
                    held -= b
                pending.append((e, self._ex.submit(job), nbytes))
                held += nbytes
            while pending:
                e0, fut, _ = pending.popleft()
                write(e0, fut.result())
        finally:
            for _, fut, _ in pending:  # failed: drop what was not written
                fut.cancel()

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
