"""The full content pass behind `ft verify`: checksums (V20) and zero padding (V21)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from . import errors as E
from .layout import xxh3_hex

if TYPE_CHECKING:
    from .reader import FtwReader

_CHUNK = 64 << 20


def total_bytes(r: "FtwReader") -> int:
    m = r.records
    return sum(f.nbytes for f in m.files) + sum(a.nbytes for a in m.assets.values()) + sum(
        a.nbytes for s in m.slots.values() for a in s)


def verify_all(r: "FtwReader", progress: Callable[[int], None] | None = None) -> list[E.FtwError]:
    m = r.records
    failures: list[E.FtwError] = []
    tick = progress or (lambda n: None)
    for idx, f in enumerate(m.files):
        buf = r._file_buf(idx)
        regions, ticked = [], 0
        for t in m.tensors.values():
            if t.file == idx:
                regions.append((t.offset, t.offset + t.nbytes))
                got = _hash(buf[t.offset:t.offset + t.nbytes])
                if got != t.xxh3:
                    failures.append(E.FtwChecksumError(r.path / f.name, f"tensor {t.name}: xxh3 {got} != recorded {t.xxh3}"))
                tick(t.nbytes)
                ticked += t.nbytes
        for b in m.banks.values():
            if b.file != idx:
                continue
            for e in range(b.num_experts):
                start = b.offset + e * b.stride
                regions.append((start, start + b.used_bytes))
                got = _hash(buf[start:start + b.used_bytes])
                if got != b.xxh3[e]:
                    failures.append(E.FtwChecksumError(r.path / f.name, f"bank {b.name} expert {e}: xxh3 {got} != recorded {b.xxh3[e]}"))
                tick(b.stride)
                ticked += b.stride
        bad = _nonzero_gap(buf, sorted(regions), f.nbytes)
        if bad is not None:
            failures.append(E.FtwPaddingError(r.path / f.name, f"padding byte at offset {bad} is not zero"))
        tick(f.nbytes - ticked)  # the padding just scanned, so progress adds up to total_bytes()
    for a in (*m.assets.values(), *m.slots["plans"], *m.slots["kernels"]):
        data = (r.path / a.name).read_bytes()
        if xxh3_hex(data) != a.xxh3:
            failures.append(E.FtwChecksumError(r.path / a.name, f"xxh3 {xxh3_hex(data)} != recorded {a.xxh3}"))
        tick(a.nbytes)
    return failures


def _hash(t: torch.Tensor) -> str:
    return xxh3_hex(t.numpy()) if t.numel() else xxh3_hex(b"")


def _nonzero_gap(buf: torch.Tensor, regions: list[tuple[int, int]], size: int) -> int | None:
    """First non-zero byte outside the data regions (gaps and tails), scanned in bounded chunks."""
    pos = 0
    for start, end in [*regions, (size, size)]:
        for lo in range(pos, start, _CHUNK):
            chunk = buf[lo:min(start, lo + _CHUNK)]
            nz = torch.nonzero(chunk, as_tuple=False)
            if nz.numel():
                return lo + int(nz[0])
        pos = max(pos, end)
    return None
