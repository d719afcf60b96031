"""Read every source weight byte from disk once: one sequential pass per file feeds both its sha256 (provenance) and
the compile's tensor reads.

Why: on a page-cache read each byte costs a kernel copy (plus page allocation when cold), and hashing and tensor
reads used to go through the cache separately, so every byte crossed it twice. Here one reader thread reads each
weight file start to end in `chunk`-sized O_DIRECT reads (buffered where the filesystem refuses O_DIRECT, e.g.
tmpfs), a hashing thread folds the chunks into the file's sha256 in file order, and the chunks stay in a bounded
window (`window` bytes) for as long as a tensor of the compile plan still needs them.

The compile's read order differs from the file order (lm_head first in the file, last in the plan; within a layer
the modules come in another order), so the window is driven by the plan itself, known up front (`expect`): chunk k
may be dropped once every planned request that overlaps it has been served (`last_use[k] < current request`).
A request the window cannot serve (a tensor larger than `big`, a read outside the plan, or data the reader passed
or cannot reach because the window is full of pinned chunks) is read directly (aligned O_DIRECT pread): correct
in every order, slower only for those bytes. Served bytes are copied out of the window, so a tensor never pins
a chunk. Memory: `window` bytes of reusable buffers plus the tensor being read.

Early start (`prefetch`): so that the disk works while the compile parses headers and plans (seconds), the pass
may start on the file the plan will start with (the caller's guess) into a larger window (`early` bytes). At
`expect` early chunks keep the plan's last uses, and a big tensor held whole (the embedding) stays pinned until
served instead of being read twice. A wrong guess only costs speed: that file is hashed, its tensors read directly.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.byte_io import open_direct, plan_reads, pread_full, read_direct, span_views
from ft.compiler.safetensors_io import ST_DTYPES, TensorInfo, byte_range

class _Chunk:
    __slots__ = ("buf", "n", "hashed")

    def __init__(self, buf: mmap.mmap, n: int) -> None:
        self.buf, self.n, self.hashed = buf, n, False


class SourceStream:
    """TensorReader-compatible (`expect`, `read`, `close`) reader of a checkpoint's weight files that also hashes
    them; `digests()` finishes the pass (whatever the compile did not need is still read and hashed)."""

    def __init__(self, root: Path, weight_files: list[str], *, window: int = 512 << 20, chunk: int = 8 << 20,
                 big: int = 64 << 20) -> None:
        self.root, self.names = root, list(weight_files)
        self.paths = [root / n for n in self.names]
        self.sizes = [p.stat().st_size for p in self.paths]
        self.window, self.chunk, self.big = window, chunk, big
        self.bytes_read = 0
        self.direct_bytes = 0  # bytes served by direct reads (read twice from disk)
        self._cv = threading.Condition()
        self._chunks: dict[tuple[int, int], _Chunk] = {}
        self._pool: list[mmap.mmap] = []
        self._held = 0
        self._read_upto = [0] * len(self.paths)  # chunks of each file read so far
        self._waiting = False  # the reader waits for window space
        self._cur = -1  # index of the latest planned request served
        self._last_use: dict[tuple[int, int], int] = {}
        self._index: dict[tuple[Path, int, int], int] = {}
        self._fidx = {p: i for i, p in enumerate(self.paths)}
        self._digests: dict[str, str] = {}
        self._error: BaseException | None = None
        self._cancel = False
        self._fds: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._order: list[int] | None = None  # files in reading order (set by expect); None: the early file only
        self._early = 0  # the file `prefetch` starts with
        self._pinned: dict[int, int] = {}  # request -> window bytes its early chunks add until it is served
        self._normal_window = window

    # -- plan and threads ---------------------------------------------------------------------------
    def prefetch(self, first: str, early: int = 1536 << 20) -> None:
        """Start the pass now, before the plan is known: weight file `first`, into a window of `early` bytes."""
        if not self._threads and first in self.names:
            self._early = self.names.index(first)
            self.window = max(self.window, early)
            self._start()

    def expect(self, infos: list[TensorInfo]) -> None:
        """The compile's reads, in order; starts the pass (files in order of first use, then the rest) unless
        `prefetch` did."""
        index, last_use, order = plan_reads(infos, self._fidx, self.chunk, self.big)
        with self._cv:
            extra, fe = 0, self._early
            if self._threads and order[0] == fe:  # the early file leads the plan: keep its whole big tensors
                for (path, b, e), i in index.items():
                    ks = range(b // self.chunk, (e - 1) // self.chunk + 1)
                    if e - b > self.big and path == self.paths[fe] and all((fe, k) in self._chunks for k in ks):
                        extra += len(ks) * self.chunk
                        self._pinned[i] = len(ks) * self.chunk
                        last_use.update({(fe, k): max(i, last_use.get((fe, k), -1)) for k in ks})
            elif self._threads:  # wrong guess: the early file is hashed only (its tensors are read directly)
                last_use = {k: v for k, v in last_use.items() if k[0] != fe}
            self._index, self._last_use, self._order = index, last_use, order
            self.window = self._normal_window + extra
            self._cv.notify_all()
        if not self._threads:
            self._start()

    def _start(self) -> None:
        hq: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._guard, args=(self._read_all, hq), daemon=True,
                                          name="ft-source-read"),
                         threading.Thread(target=self._guard, args=(self._hash_all, hq), daemon=True,
                                          name="ft-sha256")]
        for t in self._threads:
            t.start()

    def _next_file(self, done: list[int]) -> int | None:
        """The next file to read: before `expect`, the first file only (then wait for the plan)."""
        with self._cv:
            while self._order is None and done and not self._cancel and self._error is None:
                self._cv.wait()
            if self._cancel or self._error is not None:
                return None
            if self._order is None:
                return self._early
            return next((fi for fi in self._order if fi not in done), None)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # surfaced to the compile by read() / digests()
            with self._cv:
                self._error = self._error or e
                self._cv.notify_all()

    def _read_all(self, hq: queue.Queue) -> None:
        done: list[int] = []
        try:
            while (fi := self._next_file(done)) is not None:
                done.append(fi)
                path, size = self.paths[fi], self.sizes[fi]
                fd = open_direct(path)
                try:
                    for k in range((size + self.chunk - 1) // self.chunk):
                        buf = self._take_buffer()
                        if buf is None:
                            return
                        want = min(self.chunk, size - k * self.chunk)
                        if pread_full(fd, buf, k * self.chunk, want, path) < want:
                            raise CheckpointError(f"{path.name}: truncated while reading (file changed?)")
                        with self._cv:
                            self._chunks[(fi, k)] = _Chunk(buf, want)
                            self._read_upto[fi] = k + 1
                            self._cv.notify_all()
                        hq.put((fi, k))
                finally:
                    os.close(fd)
                hq.put((fi, None))
        finally:
            hq.put(None)

    def _take_buffer(self) -> mmap.mmap | None:
        with self._cv:
            while self._held + self.chunk > self.window and not self._cancel and self._error is None:
                self._waiting = True
                self._cv.notify_all()
                self._cv.wait()
            self._waiting = False
            if self._cancel or self._error is not None:
                return None
            self._held += self.chunk
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
        """Drop hashed chunks no later planned request needs (lock held)."""
        for key in [k for k, c in self._chunks.items() if c.hashed and self._last_use.get(k, -1) < self._cur]:
            self._pool.append(self._chunks.pop(key).buf)
            self._held -= self.chunk

    # -- reads ---------------------------------------------------------------------------------------
    def read(self, name: str, info: TensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (or rows [r0, r1) of its first dim) as a new CPU tensor of its own dtype."""
        shape, begin, nbytes = byte_range(name, info, rows)
        idx = self._index.get((info.path, info.begin, info.end))
        fi = self._fidx.get(info.path)
        out = None
        if nbytes and fi is not None:
            with self._cv:
                if idx is not None and idx > self._cur:
                    self._cur = idx
                    self._evict()
                    self._cv.notify_all()
                wait = idx is not None and idx == self._cur and info.nbytes <= self.big
                out = self._from_window(fi, begin, nbytes, wait)
                if idx in self._pinned:  # an early-pinned big tensor, served: the window shrinks back
                    self.window -= self._pinned.pop(idx)
        if out is None:
            out = self._direct(info.path, begin, nbytes)
            self.direct_bytes += nbytes
        self.bytes_read += nbytes
        return out.view(info.torch_dtype).reshape(shape)

    def read_many(self, items: list[tuple[str, TensorInfo]]) -> list[torch.Tensor] | None:
        """Planned tensors lying close together in one file (one expert's weights and scales) with one copy out of
        the window: per-read overhead, not bytes, dominates small tensors. None when they are not in the plan, not
        in one file, spread out (the span over 1.25x their bytes) or larger than `big`; then read them one by one."""
        infos = [i for _, i in items]
        fi = self._fidx.get(infos[0].path) if infos else None
        idxs = [self._index.get((i.path, i.begin, i.end)) for i in infos]
        if fi is None or None in idxs or any(i.path != infos[0].path or i.dtype not in ST_DTYPES for i in infos):
            return None
        b0, b1 = min(i.begin for i in infos), max(i.end for i in infos)
        if b1 - b0 > self.big or 4 * (b1 - b0) > 5 * sum(i.nbytes for i in infos) or b1 == b0:
            return None
        first = min(idxs)
        with self._cv:  # as read(): the group's first request is current while waiting (its chunks stay pinned)
            if first > self._cur:
                self._cur = first
                self._evict()
                self._cv.notify_all()
            span = self._from_window(fi, b0, b1 - b0, first == self._cur)
            self._cur = max(self._cur, max(idxs))  # all served: the next read may evict their chunks
        if span is None:
            span = self._direct(infos[0].path, b0, b1 - b0)
            self.direct_bytes += b1 - b0
        self.bytes_read += sum(i.nbytes for i in infos)
        return span_views(span, b0, infos)

    def _from_window(self, fi: int, begin: int, nbytes: int, wait: bool) -> torch.Tensor | None:
        """Copy [begin, begin + nbytes) out of the window (lock held); None where it is not (and will not be) there."""
        c0, c1 = begin // self.chunk, (begin + nbytes - 1) // self.chunk
        while True:
            if self._error is not None:
                raise self._error
            missing = [k for k in range(c0, c1 + 1) if (fi, k) not in self._chunks]
            if not missing:
                break
            passed = any(k < self._read_upto[fi] for k in missing)
            # stuck: the reader waits for space and nothing can free any (a just-freed slot does not count: the
            # reader may not have woken yet to clear `_waiting`)
            stuck = (self._waiting and self._held + self.chunk > self.window
                     and all(c.hashed for c in self._chunks.values()))
            if not wait or passed or stuck or self._cancel:
                return None
            self._cv.wait()
        out = torch.empty(nbytes, dtype=torch.uint8)
        dst, pos = out.numpy(), begin
        while pos < begin + nbytes:
            k, off = divmod(pos, self.chunk)
            n = min(self.chunk - off, begin + nbytes - pos)
            dst[pos - begin:pos - begin + n] = np.frombuffer(self._chunks[(fi, k)].buf, np.uint8, n, off)
            pos += n
        return out

    def _direct(self, path: Path, begin: int, nbytes: int) -> torch.Tensor:
        """Aligned positioned read of [begin, begin + nbytes) into a fresh page-aligned buffer."""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = open_direct(path)
        return read_direct(fd, path, begin, nbytes)

    def close(self) -> None:
        """Close the direct-read descriptors (the pass itself goes on until digests() or stop())."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # -- results -------------------------------------------------------------------------------------
    def digests(self) -> dict[str, str]:
        """sha256 of every weight file: unpins the window, lets the pass finish, waits for it."""
        if not self._threads:
            self.expect([])
        with self._cv:
            self._cur = len(self._index) + 1 << 40
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
