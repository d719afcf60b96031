"""Read every source weight byte from disk once: one sequential pass per file feeds both its sha256 (provenance) and
the compile's tensor reads, whatever the tensors' sizes.

Why: on a page-cache read each byte costs a kernel copy (plus page allocation when cold), and hashing and tensor
reads used to go through the cache separately, so every byte crossed it twice. The pass (`source_pass.py`) reads
each file once into a bounded window that keeps each chunk while a request of the compile's plan still needs it
(`read_plan.py`, known up front by `expect`). Here the compile's reads are copied out of the window chunk by chunk
as the pass brings them, each copied chunk released at once: a tensor of any size streams through (a fused
[E, 2I, H] expert tensor read one expert at a time, a 1 GB embedding read whole), and the two fused tensors of a
bank, read interleaved while the file holds them one after the other, are served by holding the first in the window
(up to `hold` bytes) while the second streams by.

A request the window cannot serve (a read outside the plan, data the pass went by or dropped, or data it cannot
reach because the window is full of pinned chunks) is read directly from where the copy stopped (aligned O_DIRECT
pread): correct in every order, slower only for those bytes (`direct_bytes`). Memory: the pass's buffers
(`window + hold + lag`) plus the tensor being read.

Early start (`prefetch`): so that the disk works while the compile parses headers and plans (seconds), the pass
may start on the file the plan will start with (the caller's guess); at `expect` its chunks fall under the plan
like any others. A wrong guess only costs speed: that file is hashed, its tensors read directly.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ft.compiler.byte_io import copy_into, open_direct, read_direct, span_views
from ft.compiler.read_plan import ReadPlan
from ft.compiler.safetensors_io import ST_DTYPES, TensorInfo, byte_range
from ft.compiler.source_pass import SourcePass


class SourceStream(SourcePass):
    """TensorReader-compatible (`expect`, `read`, `close`) reader of a checkpoint's weight files that also hashes
    them; `digests()` finishes the pass (whatever the compile did not need is still read and hashed)."""

    def expect(self, infos: list[TensorInfo]) -> None:
        """The compile's reads, in order; starts the pass (files in order of first use, then the rest) unless
        `prefetch` did."""
        self._set_plan(ReadPlan(infos, self._fidx, self.chunk, self.big))

    # -- reads ---------------------------------------------------------------------------------------
    def read(self, name: str, info: TensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (or rows [r0, r1) of its first dim) as a new CPU tensor of its own dtype."""
        shape, begin, nbytes = byte_range(name, info, rows)
        out = torch.empty(nbytes, dtype=torch.uint8)
        fi, pos = self._fidx.get(info.path), begin
        if nbytes and fi is not None:
            with self._cv:
                j = self._plan.index.get((info.path, info.begin, info.end)) if self._plan is not None else None
                if j is not None:
                    self._plan.start(j)
                left = info.end - self._plan.served[j] if j is not None and info.nbytes > self.big else 0
                pos = self._copy_out(out, fi, begin, nbytes, j, (j, -1) if j is not None else None, left)
        if pos < begin + nbytes:
            self._direct(out[pos - begin:], info.path, pos)
            self.direct_bytes += begin + nbytes - pos
        self.bytes_read += nbytes
        return out.view(info.torch_dtype).reshape(shape)

    def read_many(self, items: list[tuple[str, TensorInfo]]) -> list[torch.Tensor] | None:
        """Planned tensors lying close together in one file (one expert's weights and scales) with one copy out of
        the window: per-read overhead, not bytes, dominates small tensors. None when they are not in the plan, not
        in one file, spread out (the span over 1.25x their bytes) or larger than `big`; then read them one by one."""
        infos = [i for _, i in items]
        fi = self._fidx.get(infos[0].path) if infos else None
        p = self._plan
        idxs = [p.index.get((i.path, i.begin, i.end)) for i in infos] if p is not None else [None]
        if fi is None or None in idxs or any(i.path != infos[0].path or i.dtype not in ST_DTYPES for i in infos):
            return None
        b0, b1 = min(i.begin for i in infos), max(i.end for i in infos)
        if b1 - b0 > self.big or 4 * (b1 - b0) > 5 * sum(i.nbytes for i in infos) or b1 == b0:
            return None
        span = torch.empty(b1 - b0, dtype=torch.uint8)
        with self._cv:
            p.start(min(idxs))
            pos = self._copy_out(span, fi, b0, b1 - b0, None, (min(idxs), -1), 0)
            for j, i in zip(idxs, infos):
                p.serve(j, i.begin, i.end)
            p.start(max(idxs))
            self._evict()
            self._cv.notify_all()
        if pos < b1:
            self._direct(span[pos - b0:], infos[0].path, pos)
            self.direct_bytes += b1 - pos
        self.bytes_read += sum(i.nbytes for i in infos)
        return span_views(span, b0, infos)

    def _copy_out(self, out: torch.Tensor, fi: int, begin: int, nbytes: int, j: int | None,
                  rank: tuple[int, int] | None, left: int) -> int:
        """Copy [begin, begin + nbytes) of file fi out of the window into `out` chunk by chunk as the pass brings
        them, request j (if any) releasing each copied chunk; returns where the copy stopped (the rest is not in
        the window and will not be). `rank`: a planned read waits for the pass (None: takes what is there). When
        the pass is stuck waiting for `hold` room, big-pinned chunks needed later than `rank` are dropped one by one
        to let it on where that costs fewer re-read bytes than reading directly what is `left` of the request (a
        big one waiting in the same file, close ahead of the pass); else the rest is read directly (a small tensor
        filed behind a fused bank, such as the router, costs its own bytes, not the bank's) (lock held; a planned
        read lets it go while it copies a chunk, which its request pins: the pass reads and hashes meanwhile)."""
        dst, pos, end = out.numpy(), begin, begin + nbytes
        while pos < end:
            if self._error is not None:
                raise self._error
            k, off = divmod(pos, self.chunk)
            c = self._chunks.get((fi, k))
            if c is None:
                if rank is None or self._cancel or k < self._read_upto[fi] or self._plan.final:
                    break
                w = self._want
                if self._stuck() and (w is None or w[0] != fi or (k - w[1]) * self.chunk > left
                                      or not self._plan.big_pinned(w)  # full of small pins: no drop helps
                                      or self._plan.drop_last(list(self._chunks), rank) is None):
                    break
                self._evict()
                self._cv.notify_all()
                self._cv.wait()
                continue
            n = min(self.chunk - off, end - pos)
            # a planned read pins the chunk until it is served past it, so the pass may read and hash during the
            # copy; an unplanned one pins nothing: the chunk could be evicted once the lock is let go
            if rank is not None:
                self._cv.release()
            try:
                copy_into(dst[pos - begin:pos - begin + n], np.frombuffer(c.buf, np.uint8, n, off))
            finally:
                if rank is not None:
                    self._cv.acquire()
            pos += n
            if j is not None:
                self._plan.serve(j, pos - n, pos)
                self._evict()
                self._cv.notify_all()
        if j is not None and pos < end:
            self._plan.serve(j, pos, end)  # read directly: release the rest
            self._evict()
            self._cv.notify_all()
        return pos

    def _direct(self, out: torch.Tensor, path: Path, begin: int) -> None:
        """Fill `out` (uint8) with the file's bytes from `begin` by aligned positioned reads, `big` bytes at a time
        (the page-aligned staging buffer of each read is the only temporary)."""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = open_direct(path)
        dst = out.numpy()
        for a in range(0, out.numel(), self.big):
            n = min(self.big, out.numel() - a)
            copy_into(dst[a:a + n], read_direct(fd, path, begin + a, n).numpy())

    def close(self) -> None:
        """Close the direct-read descriptors (the pass itself goes on until digests() or stop())."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

