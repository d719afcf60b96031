"""The full content pass behind `ft verify`: checksums (V20) and zero padding (V21).

Data files are streamed with plain reads through one reusable buffer, not through the reader's
mmap: touched pages of a mapping count as resident memory until it is unmapped, so verifying a
20 GB FTW through the mapping would grow RSS by 20 GB. Memory here stays at one chunk.
"""

from __future__ import annotations

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


def _scan_file(path: Path, regions: list[tuple[int, int, str, str]], size: int,
               tick: Callable[[int], None]) -> list[E.FtwError]:
    """One sequential pass: hash each region, check every byte between regions is zero."""
    failures: list[E.FtwError] = []
    buf = memoryview(bytearray(_CHUNK))
    first_bad_pad: int | None = None
    with open(path, "rb", buffering=0) as fh:
        pos = 0
        for start, end, what, want in [*regions, (size, size, "", "")]:
            while pos < start:  # padding gap
                n = fh.readinto(buf[:min(_CHUNK, start - pos)])
                if not n:
                    break
                if first_bad_pad is None and any(buf[:n]):
                    first_bad_pad = pos + next(i for i, v in enumerate(buf[:n]) if v)
                pos += n
                tick(n)
            if not what:
                break
            h = xxhash.xxh3_64()
            while pos < end:
                n = fh.readinto(buf[:min(_CHUNK, end - pos)])
                if not n:
                    break
                h.update(buf[:n])
                pos += n
                tick(n)
            if h.hexdigest() != want:
                failures.append(E.FtwChecksumError(path, f"{what}: xxh3 {h.hexdigest()} != recorded {want}"))
    if first_bad_pad is not None:
        failures.append(E.FtwPaddingError(path, f"padding byte at offset {first_bad_pad} is not zero"))
    return failures
