"""One FTW data file written sequentially with O_DIRECT through page-aligned staging buffers.

Why not buffered writes: on the benchmark machine (virtio disk, 24 GB RAM) a buffered write + fsync ran at 0.2-1.2
GB/s and cost about 1 s of kernel CPU per GB (page allocation and copy, then reclaim once written pages fill
memory), while O_DIRECT writes of 8-64 MiB ran at 1.2-1.7 GB/s with little CPU; written bytes also stay out of the
page cache, which the rest of the machine keeps.

How: `write` copies the caller's bytes into a `block`-sized staging buffer; a full buffer goes to one I/O thread,
which writes it at its file offset (`pwrite`) while the caller fills the next one. Filesystems that refuse O_DIRECT
(tmpfs) get a buffered descriptor and the same code.

Invariants:
* The file holds exactly the bytes handed to `write`/`zeros`, in order (explicit offsets; one I/O thread).
* At `close` the total is a multiple of ALIGN (FTW data files always are, V14): O_DIRECT needs aligned lengths.
* Memory: at most `depth` buffers of `block` bytes.
* A failed write (ENOSPC, EIO) is raised, with its errno, by the next `write`, `zeros` or `close`.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from pathlib import Path

import numpy as np

from .layout import ALIGN

_ZERO_BLOCK = bytes(1 << 20)


def _open(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError:
            pass
    return os.open(path, flags, 0o644), False


class DataFile:
    def __init__(self, path: Path, *, block: int = 16 << 20, depth: int = 3) -> None:
        if block % ALIGN or block <= 0 or depth < 2:
            raise ValueError(f"block must be a positive multiple of {ALIGN} and depth >= 2")
        self.path, self.block = path, block
        self.fd, self.direct = _open(path)
        self.pos = 0  # bytes accepted so far (the file offset of the next byte)
        self._free: queue.Queue = queue.Queue()
        for _ in range(depth):
            self._free.put(None)  # a slot: the buffer is mapped on first use
        self._todo: queue.Queue = queue.Queue()
        self._buf: mmap.mmap | None = None
        self._arr: np.ndarray | None = None  # uint8 view of _buf: numpy copies release the GIL, mmap slices do not
        self._fill = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ft-ftw-io", daemon=True)
        self._thread.start()

    # -- caller side -----------------------------------------------------------------------------------
    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            if self._buf is None:
                self._take()
            n = min(len(mv), self.block - self._fill)
            self._arr[self._fill:self._fill + n] = np.frombuffer(mv[:n], np.uint8)
            self._fill += n
            self.pos += n
            mv = mv[n:]
            if self._fill == self.block:
                self._submit()

    def zeros(self, n: int) -> None:
        while n > 0:
            k = min(n, len(_ZERO_BLOCK))
            self.write(memoryview(_ZERO_BLOCK)[:k])
            n -= k

    def close(self) -> None:
        """Write what is buffered, wait for the I/O thread, fsync, close. Raises the first write error."""
        try:
            if self._fill:
                if self.direct and self.pos % ALIGN:
                    raise ValueError(f"{self.path.name}: {self.pos} bytes is not a multiple of {ALIGN}")
                self._submit()
            self._stop()
            self._raise()
            os.fsync(self.fd)
        finally:
            self._close_fd()

    def abort(self) -> None:
        """Stop without caring about the bytes (the caller removes the file)."""
        self._error = self._error or RuntimeError("aborted")
        self._stop()
        self._close_fd()

    def _take(self) -> None:
        self._raise()
        buf = self._free.get()
        self._raise()
        self._buf = buf if buf is not None else mmap.mmap(-1, self.block)  # page-aligned, as O_DIRECT needs
        self._arr = np.frombuffer(self._buf, np.uint8)
        self._fill = 0

    def _submit(self) -> None:
        self._todo.put((self._buf, self.pos - self._fill, self._fill))
        self._buf, self._arr, self._fill = None, None, 0

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- I/O thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._todo.get()) is not None:
            buf, offset, n = job
            if self._error is None:
                try:
                    view, done = memoryview(buf), 0
                    while done < n:  # a short write (rare) continues at an aligned offset: n is a block multiple
                        done += os.pwrite(self.fd, view[done:n], offset + done)
                    view.release()
                except BaseException as e:  # surfaced on the caller's side
                    self._error = e
            self._free.put(buf)
