"""The single pass under `source_stream.SourceStream`: one reader thread reads each weight file start to end in
`chunk`-sized O_DIRECT reads (buffered where the filesystem refuses O_DIRECT, e.g. tmpfs), a hashing thread folds
the chunks into the file's sha256 in file order (HASHERS threads, files taking turns), and the chunks stay in a
bounded window while a request of the compile's plan (`read_plan.ReadPlan`) still needs them. Files whose
hub-published sha256 the download recorded (`published`: `metadata.published_sha256`) are not hashed, and their
chunks no planned read needs are not read: one sha256 stream (1.3-2 GB/s) sets the pace of a pass over a faster disk
(`benchmarks/compile_stages.md`).

Budgets: `window` bytes for chunks pinned by tensors up to `big` bytes, `hold` more for chunks pinned by bigger
ones (`read_plan`), and `lag` more for chunks the compile is done with that wait only for their hash; the reader
waits for room, except that a big-pinned chunk needed after every big-pinned chunk held, with `hold` full, is read
for the hash only (dropped). Before the plan is known (`prefetch`), the early file is read into an `early`-byte
window and nothing is evicted. Memory: at most `max(window + hold + lag, early)` bytes of reusable buffers
(`peak_held`). Defaults: window 512 MiB, hold 768 MiB (a 35B-A3B layer's down_proj, 512 MiB, plus read-ahead over
its gate_up_proj), lag 768 MiB, early 1.5 GiB.

Why `lag`: files are read one after the other, so while one file is read only its sha256 thread has work. Where
the disk outruns one sha256 stream, the reader runs up to `lag` bytes ahead of that file's hash, and the next file's
thread starts that much earlier: the two hash side by side for longer.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path

from ft.compiler.byte_io import open_direct, pread_full
from ft.compiler.errors import CheckpointError
from ft.compiler.read_plan import Key, ReadPlan

# sha256 threads; weight files take turns in read order, so the next file is hashed beside the end of this one (one
# sha256 stream, ~1.4 GB/s, is slower than a fast disk: its lag would otherwise hold the pass back file after file)
HASHERS = 2


class _Chunk:
    __slots__ = ("buf", "n", "hashed")

    def __init__(self, buf: mmap.mmap, n: int) -> None:
        self.buf, self.n, self.hashed = buf, n, False


class SourcePass:
    """The pass and its window; `SourceStream` serves the compile's reads from it."""

    def __init__(self, root: Path, weight_files: list[str], *, window: int = 512 << 20, chunk: int = 8 << 20,
                 big: int = 64 << 20, hold: int = 768 << 20, lag: int = 768 << 20,
                 published: dict[str, str] | None = None) -> None:
        self.root, self.names = root, list(weight_files)
        self.published = dict(published or {})  # file -> the sha256 its hub publishes: read, not hashed
        self.paths = [root / n for n in self.names]
        self.sizes = [p.stat().st_size for p in self.paths]
        self.window, self.chunk, self.big, self.hold, self.lag = window, chunk, big, hold, lag
        self.bytes_read = 0  # bytes delivered to the compile
        self.pass_bytes = 0  # bytes the pass read from disk (each weight byte once)
        self.direct_bytes = 0  # bytes served by direct reads (read twice from disk)
        self.peak_held = 0  # high-water mark of window buffers in use
        self._cv = threading.Condition()
        self._chunks: dict[Key, _Chunk] = {}
        self._pool: list[mmap.mmap] = []
        self._held = 0
        self._read_upto = [0] * len(self.paths)  # chunks of each file read so far
        self._want: Key | None = None  # the chunk the reader waits to read (window full), else None
        self._plan: ReadPlan | None = None  # None before expect: the early file's chunks stay
        self._fidx = {p: i for i, p in enumerate(self.paths)}
        self._digests: dict[str, str] = {}
        self._error: BaseException | None = None
        self._cancel = False
        self._fds: dict[Path, int] = {}
        self._threads: list[threading.Thread] = []
        self._early = 0  # the file `prefetch` starts with
        self._early_window = 0

    # -- plan and threads ---------------------------------------------------------------------------
    def prefetch(self, first: str, early: int = 1536 << 20) -> None:
        """Start the pass now, before the plan is known: weight file `first`, into a window of `early` bytes."""
        if not self._threads and first in self.names:
            self._early, self._early_window = self.names.index(first), early
            self._start()

    def _set_plan(self, plan: ReadPlan) -> None:
        with self._cv:
            if self._threads and plan.order[0] != self._early:  # wrong guess: the early file is hashed only
                plan.dropped_files.add(self._early)
            self._plan = plan
            self._evict()
            self._cv.notify_all()
        if not self._threads:
            self._start()

    def _start(self) -> None:
        hqs: list[queue.Queue] = [queue.Queue() for _ in range(HASHERS)]
        self._threads = [threading.Thread(target=self._guard, args=(self._read_all, hqs), daemon=True,
                                          name="ft-source-read"),
                         *(threading.Thread(target=self._guard, args=(self._hash_all, hq), daemon=True,
                                            name=f"ft-sha256-{i}") for i, hq in enumerate(hqs))]
        for t in self._threads:
            t.start()

    def _next_file(self, done: list[int]) -> int | None:
        """The next file to read: before `expect`, the first file only (then wait for the plan)."""
        with self._cv:
            while self._plan is None and done and not self._cancel and self._error is None:
                self._cv.wait()
            if self._cancel or self._error is not None:
                return None
            if self._plan is None:
                return self._early
            return next((fi for fi in self._plan.order if fi not in done), None)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # surfaced to the compile by read() / digests()
            with self._cv:
                self._error = self._error or e
                self._cv.notify_all()

    def _read_all(self, hqs: list[queue.Queue]) -> None:
        done: list[int] = []
        try:
            while (fi := self._next_file(done)) is not None:
                hq = hqs[len(done) % len(hqs)]  # files in read order take turns: the next one hashes beside this one
                done.append(fi)
                path, size = self.paths[fi], self.sizes[fi]
                digest = self.published.get(self.names[fi])
                fd = open_direct(path)
                try:
                    for k in range((size + self.chunk - 1) // self.chunk):
                        if digest is not None and self._unneeded((fi, k)):
                            continue
                        buf = self._take_buffer((fi, k))
                        if buf is None:
                            return
                        want = min(self.chunk, size - k * self.chunk)
                        if pread_full(fd, buf, k * self.chunk, want, path) < want:
                            raise CheckpointError(f"{path.name}: truncated while reading (file changed?)")
                        with self._cv:
                            self.pass_bytes += want
                            self._chunks[(fi, k)] = c = _Chunk(buf, want)
                            self._read_upto[fi] = k + 1
                            if digest is not None:  # never hashed: evictable once served, as if hashed now
                                c.hashed = True
                                self._evict()
                            self._cv.notify_all()
                        if digest is None:
                            hq.put((fi, k))
                finally:
                    os.close(fd)
                if digest is None:
                    hq.put((fi, None))
                else:
                    self._digests[self.names[fi]] = digest
        finally:
            for hq in hqs:
                hq.put(None)

    def _unneeded(self, key: Key) -> bool:
        """Chunk `key` of a file that is not hashed, which no planned read needs now (tensors the compile skips: an
        MTP head, a vision tower) is not read at all: marked as passed, so a read of it outside the plan goes direct,
        as for an evicted chunk."""
        with self._cv:
            if self._plan is None or self._plan.pinned(key):
                return False
            self._read_upto[key[0]] = key[1] + 1
            self._cv.notify_all()
            return True

    def _room(self, key: Key) -> bool:
        """May the reader read chunk `key` now (lock held)? With `hold` full, a big-pinned chunk of a tensor the
        compile reads after every tensor held there (and has not started) is dropped at once (read for the hash
        only); else the reader waits: the compile copies (and releases) held chunks, or drops them by rank. Chunks
        that wait only for their hash are counted against `lag` first, the window after."""
        p = self._plan
        if p is None:
            return self._held + self.chunk <= max(self.window, self._early_window)
        big = p.big_pinned_of(self._chunks)
        hashing = [k for k in p.unpinned_of(self._chunks) if not self._chunks[k].hashed]  # done with but its hash
        lag = min(self.lag, len(hashing) * self.chunk)
        if self._held + self.chunk > self.window + self.hold + lag:  # the early window may still exceed the budgets
            return False
        if p.big_pinned(key):
            if (len(big) + 1) * self.chunk <= self.hold:
                return True
            j = p.rank(key)[0]
            if j <= p.cur or big and j <= max(p.rank(k)[0] for k in big):
                return False  # wait: the compile copies (and frees) or drops pinned chunks
            p.dropped.add(key)
        return self._held - len(big) * self.chunk - lag + self.chunk <= self.window

    def _take_buffer(self, key: Key) -> mmap.mmap | None:
        with self._cv:
            while not self._room(key) and not self._cancel and self._error is None:
                self._want = key
                self._cv.notify_all()
                self._cv.wait()
            self._want = None
            if self._cancel or self._error is not None:
                return None
            self._held += self.chunk
            self.peak_held = max(self.peak_held, self._held)
            return self._pool.pop() if self._pool else mmap.mmap(-1, self.chunk)

    def _hash_all(self, hq: queue.Queue) -> None:
        h = hashlib.sha256()
        while (item := hq.get()) is not None:
            fi, k = item
            if k is None:
                self._digests[self.names[fi]] = h.hexdigest()
                h = hashlib.sha256()
                continue
            c = self._chunks[(fi, k)]  # only this thread and eviction (after `hashed`) remove entries
            h.update(memoryview(c.buf)[:c.n])
            with self._cv:
                c.hashed = True
                self._evict()
                self._cv.notify_all()

    def _evict(self) -> None:
        """Drop hashed chunks no planned request still needs (lock held; nothing before the plan is known)."""
        p = self._plan
        if p is None:
            return
        for key in [k for k in p.unpinned_of(self._chunks) if self._chunks[k].hashed]:
            self._pool.append(self._chunks.pop(key).buf)
            self._held -= self.chunk

    def _stuck(self) -> bool:
        """The pass waits for window space and nothing can free any (lock held): hashing frees only unpinned
        chunks, so pinned ones still being hashed do not count. A reader woken but not yet running is not stuck:
        its room is checked again here."""
        if self._want is None:
            return False
        unhashed = [k for k, c in self._chunks.items() if not c.hashed]
        return (self._plan is not None and not self._plan.unpinned_of(unhashed)
                and not self._room(self._want))

    # -- results -------------------------------------------------------------------------------------
    def digests(self) -> dict[str, str]:
        """sha256 of every weight file: unpins the window, lets the pass finish, waits for it."""
        if self._plan is None:
            self._set_plan(ReadPlan([], self._fidx, self.chunk, self.big))
        with self._cv:
            self._plan.final = True
            self._evict()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._chunks.clear()
        self._pool.clear()
        if self._error is not None:
            raise CheckpointError(f"cannot read source files: {self._error}") from self._error
        return dict(self._digests)

    def stop(self) -> None:
        """End early (the compile failed); a no-op once finished."""
        with self._cv:
            self._cancel = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self.close()

    def close(self) -> None:
        """Release what the reads hold (SourceStream: its direct-read descriptors)."""
