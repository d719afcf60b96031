"""The full content pass behind `ft verify`: checksums (V20) and zero padding (V21).

Data files are streamed in aligned blocks through one reusable buffer, not through the reader's
mmap: touched pages of a mapping count as resident memory until it is unmapped, so verifying a
20 GB FTW through the mapping would grow RSS by 20 GB. Memory here stays at one block. A block
still in the page cache is copied from it (RWF_NOWAIT read); any other block is read with
O_DIRECT, which skips the kernel's page allocation and copy (the costly part of a cold buffered
read); filesystems that refuse O_DIRECT get plain reads.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import xxhash

from . import errors as E
from .layout import xxh3_hex

if TYPE_CHECKING:
    from .reader import FtwReader

_CHUNK = 16 << 20


def total_bytes(r: "FtwReader") -> int:
    m = r.records
    return sum(f.nbytes for f in m.files) + sum(a.nbytes for a in m.assets.values()) + sum(
        a.nbytes for s in m.slots.values() for a in s)


def verify_all(r: "FtwReader", progress: Callable[[int], None] | None = None) -> list[E.FtwError]:
    m = r.records
    failures: list[E.FtwError] = []
    tick = progress or (lambda n: None)
    for idx, f in enumerate(m.files):
        # (start, end, what, expected xxh3) for every checksummed region of this file, in file order
        regions = [(t.offset, t.offset + t.nbytes, f"tensor {t.name}", t.xxh3)
                   for t in m.tensors.values() if t.file == idx]
        for b in m.banks.values():
            if b.file == idx:
                regions += [(b.offset + e * b.stride, b.offset + e * b.stride + b.used_bytes,
                             f"bank {b.name} expert {e}", b.xxh3[e]) for e in range(b.num_experts)]
        failures += _scan_file(r.path / f.name, sorted(regions), f.nbytes, tick)
    for a in (*m.assets.values(), *m.slots["plans"], *m.slots["kernels"]):
        data = (r.path / a.name).read_bytes()
        if xxh3_hex(data) != a.xxh3:
            failures.append(E.FtwChecksumError(r.path / a.name, f"xxh3 {xxh3_hex(data)} != recorded {a.xxh3}"))
        tick(a.nbytes)
    return failures


class _Blocks:
    """Sequential reads of one file in `_CHUNK`-aligned blocks; `view(pos, n)` is at most `n` bytes from `pos`
    (fewer at a block end; empty at end of file), valid until the next call."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        try:
            self.dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            self.dfd = self.fd
        self.buf = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT requires
        self.start, self.n = 0, -1

    def _load(self, start: int) -> None:
        view, n = memoryview(self.buf), 0
        try:  # the page-cache copy, only if every page is there
            n = os.preadv(self.fd, [view], start, os.RWF_NOWAIT)
        except (OSError, AttributeError):
            n = 0
        if n < _CHUNK and (n == 0 or start + n < os.fstat(self.fd).st_size):
            n = 0
            while n < _CHUNK:
                got = os.preadv(self.dfd, [view[n:]], start + n)
                if got <= 0:
                    break
                n += got
        self.start, self.n = start, n

    def view(self, pos: int, n: int) -> memoryview:
        if not self.start <= pos < self.start + self.n:
            self._load(pos - pos % _CHUNK)
        off = pos - self.start
        return memoryview(self.buf)[off:off + max(0, min(n, self.n - off))]

    def close(self) -> None:
        if self.dfd != self.fd:
            os.close(self.dfd)
        os.close(self.fd)  # the buffer goes with this object (views of it may still be alive here)


def _scan_file(path: Path, regions: list[tuple[int, int, str, str]], size: int,
               tick: Callable[[int], None]) -> list[E.FtwError]:
    """One sequential pass: hash each region, check every byte between regions is zero."""
    failures: list[E.FtwError] = []
    first_bad_pad: int | None = None
    fh = _Blocks(path)
    try:
        pos = 0
        for start, end, what, want in [*regions, (size, size, "", "")]:
            while pos < start:  # padding gap
                buf = fh.view(pos, start - pos)
                n = len(buf)
                if not n:
                    break
                if first_bad_pad is None and any(buf):
                    first_bad_pad = pos + next(i for i, v in enumerate(buf) if v)
                pos += n
                tick(n)
            if not what:
                break
            h = xxhash.xxh3_64()
            while pos < end:
                buf = fh.view(pos, end - pos)
                n = len(buf)
                if not n:
                    break
                h.update(buf)
                pos += n
                tick(n)
            if h.hexdigest() != want:
                failures.append(E.FtwChecksumError(path, f"{what}: xxh3 {h.hexdigest()} != recorded {want}"))
    finally:
        fh.close()
    if first_bad_pad is not None:
        failures.append(E.FtwPaddingError(path, f"padding byte at offset {first_bad_pad} is not zero"))
    return failures
