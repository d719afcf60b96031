"""The content checks behind `ft verify` and the compiler's final check: checksums (V20) and zero padding (V21).

Two plans, one scanner (specs/ftw.md §10):
* full (`verify_all`: `ft verify`, `ft checkpoint --verify full`): every byte of every data file;
* sample (`verify_sample`: the default final check of `ft checkpoint`): within a byte budget, the last and first
  region of each data file, the last and first record of each expert bank, then other regions drawn at random;
  each sampled region is read with the padding that follows it. The writer computed every digest from the
  bytes it wrote, so the sample is there to catch misplaced bytes (a wrong offset shifts everything after it, the
  last region of each file included) and a disk that did not keep what it acknowledged.
Side files (assets, plans, kernels) are always hashed whole: they are small; kernels containers (V22) and placement
plans (`plans/<name>.json`, formats/plan.py; V23) are also validated.

Data files are read in aligned blocks through one reusable buffer, not through the reader's mmap: touched pages of
a mapping count as resident memory until it is unmapped, so verifying a 20 GB FTW through the mapping would grow
RSS by 20 GB. Memory here stays at one block. A block still in the page cache is copied from it (RWF_NOWAIT read);
any other block is read with O_DIRECT, which skips the kernel's page allocation and copy (the costly part of a cold
buffered read); filesystems that refuse O_DIRECT get plain reads.
"""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import xxhash

from . import errors as E
from .kernels import unpack as unpack_kernels
from .layout import ALIGN, align_up, xxh3_hex

if TYPE_CHECKING:
    from .manifest import Manifest
    from .reader import FtwReader

_CHUNK = 16 << 20
SAMPLE_BYTES = 256 << 20  # default budget of verify_sample (about 0.2 s of disk reads on the benchmark machine)

# (start, end, pad_end, what, xxh3): hash [start, end) and compare; bytes [end, pad_end) must be zero.
# what == "" is a padding-only unit (the gap before a file's first region, or a file without regions).
Unit = tuple[int, int, int, str, str]
Plan = dict[int, list[Unit]]  # data file index -> its units in file order


def total_bytes(r: "FtwReader") -> int:
    m = r.records
    return sum(f.nbytes for f in m.files) + sum(a.nbytes for a in m.assets.values()) + sum(
        a.nbytes for s in m.slots.values() for a in s)


def full_plan(m: "Manifest") -> Plan:
    """Every byte of every data file: each region with the gap up to the next region (or the end of the file)."""
    plan: Plan = {}
    for idx, f in enumerate(m.files):
        regions = sorted([(t.offset, t.offset + t.nbytes, f"tensor {t.name}", t.xxh3)
                          for t in m.tensors.values() if t.file == idx]
                         + [(b.offset + e * b.stride, b.offset + e * b.stride + b.used_bytes,
                             f"bank {b.name} expert {e}", b.xxh3[e])
                            for b in m.banks.values() if b.file == idx for e in range(b.num_experts)])
        units: list[Unit] = []
        if not regions or regions[0][0] > 0:
            units.append((0, 0, regions[0][0] if regions else f.nbytes, "", ""))
        for i, (start, end, what, want) in enumerate(regions):
            nxt = regions[i + 1][0] if i + 1 < len(regions) else f.nbytes
            units.append((start, end, max(end, nxt), what, want))  # regions never overlap (V16)
        plan[idx] = units
    return plan


def sample_plan(m: "Manifest", budget: int = SAMPLE_BYTES, rng: random.Random | None = None) -> Plan:
    """Units of `full_plan` totalling at most `budget` bytes: first, in this order, the last and then the first
    region of each data file (the last and first of at most `budget // 16` bytes: an embedding can be larger than the
    whole budget) and the last and first record of each expert bank; then random others while they fit. A budget
    >= the data size gives the full plan."""
    rng = rng or random.Random()
    full = full_plan(m)
    cap = max(ALIGN, budget // 16)

    def size(key: tuple[int, int]) -> int:
        u = full[key[0]][key[1]]
        return u[2] - u[0]

    def end_regions(reverse: bool) -> list[tuple[int, int]]:
        picks = []
        for idx, units in full.items():
            order = range(len(units) - 1, -1, -1) if reverse else range(len(units))
            picks += [(idx, i) for i in order if units[i][3] and size((idx, i)) <= cap][:1]
        return picks

    where = {u[3]: (idx, i) for idx, units in full.items() for i, u in enumerate(units) if u[3]}
    bank_last = [where[f"bank {b.name} expert {b.num_experts - 1}"] for b in m.banks.values()]
    bank_first = [where[f"bank {b.name} expert 0"] for b in m.banks.values()]
    rest = [(idx, i) for idx, units in full.items() for i in range(len(units))]
    rng.shuffle(rest)
    keep: set[tuple[int, int]] = set()
    used = 0
    for key in [*end_regions(True), *bank_last, *end_regions(False), *bank_first, *rest]:
        if key not in keep and used + size(key) <= budget:
            keep.add(key)
            used += size(key)
    return {idx: [units[i] for i in range(len(units)) if (idx, i) in keep] for idx, units in full.items()}


def plan_bytes(plan: Plan) -> int:
    return sum(u[2] - u[0] for units in plan.values() for u in units)


def verify_all(r: "FtwReader", progress: Callable[[int], None] | None = None) -> list[E.FtwError]:
    return check(r, full_plan(r.records), progress)


def verify_sample(r: "FtwReader", budget: int = SAMPLE_BYTES, progress: Callable[[int], None] | None = None,
                  rng: random.Random | None = None) -> list[E.FtwError]:
    return check(r, sample_plan(r.records, budget, rng), progress)


def check(r: "FtwReader", plan: Plan, progress: Callable[[int], None] | None = None) -> list[E.FtwError]:
    """Scan the planned units of the data files, then hash every side file; all failures, in file order."""
    m = r.records
    failures: list[E.FtwError] = []
    tick = progress or (lambda n: None)
    for idx, units in sorted(plan.items()):
        failures += _scan_file(r.path / m.files[idx].name, units, tick)
    from .plan import SUFFIX, model_key, parse_plan

    kernels = {a.name for a in m.slots["kernels"]}
    key = model_key(m) if m.slots["plans"] else None
    for a in (*m.assets.values(), *m.slots["plans"], *m.slots["kernels"]):
        data = (r.path / a.name).read_bytes()
        if xxh3_hex(data) != a.xxh3:
            failures.append(E.FtwChecksumError(r.path / a.name, f"xxh3 {xxh3_hex(data)} != recorded {a.xxh3}"))
        elif a.name in kernels:  # an intact kernels entry is also a well-formed container (V22)
            try:
                unpack_kernels(data, r.path / a.name)
            except E.FtwError as e:
                failures.append(e)
        elif a.name.startswith("plans/") and a.name.endswith(SUFFIX):  # a placement plan: its content too (V23)
            try:
                parse_plan(data, r.path / a.name, name=a.name[len("plans/"):-len(SUFFIX)], key=key)
            except E.FtwPlanError as e:
                failures.append(e)
        tick(a.nbytes)
    return failures


class _Blocks:
    """Reads of one file in ALIGN-aligned blocks of up to `_CHUNK` bytes; `view(pos, n, horizon)` is at most `n`
    bytes from `pos` (fewer at a block end; empty at end of file), valid until the next call. A block read stops at
    `horizon` (rounded up to ALIGN): the end of the contiguous span being scanned, so sparse samples read little."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        try:
            self.dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            self.dfd = self.fd
        self.buf = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT requires
        self.start, self.n = 0, -1

    def _load(self, start: int, want: int) -> None:
        view, n = memoryview(self.buf)[:want], 0
        try:  # the page-cache copy, only if every page is there
            n = os.preadv(self.fd, [view], start, os.RWF_NOWAIT)
        except (OSError, AttributeError):
            n = 0
        if n < want and (n == 0 or start + n < os.fstat(self.fd).st_size):
            n = 0
            while n < want:
                got = os.preadv(self.dfd, [view[n:]], start + n)
                if got <= 0:
                    break
                n += got
        self.start, self.n = start, n

    def view(self, pos: int, n: int, horizon: int) -> memoryview:
        if not self.start <= pos < self.start + self.n:
            start = pos - pos % ALIGN
            self._load(start, max(ALIGN, min(_CHUNK, align_up(horizon) - start)))
        off = pos - self.start
        return memoryview(self.buf)[off:off + max(0, min(n, self.n - off))]

    def close(self) -> None:
        if self.dfd != self.fd:
            os.close(self.dfd)
        os.close(self.fd)  # the buffer goes with this object (views of it may still be alive here)


def _scan_file(path: Path, units: list[Unit], tick: Callable[[int], None]) -> list[E.FtwError]:
    """One pass in file order: hash each unit's region, check its padding is zero."""
    failures: list[E.FtwError] = []
    first_bad_pad: int | None = None
    horizons = [0] * len(units)  # end of the run of back-to-back units from unit i on
    for i in range(len(units) - 1, -1, -1):
        follows = i + 1 < len(units) and units[i + 1][0] == units[i][2]
        horizons[i] = horizons[i + 1] if follows else units[i][2]
    fh = _Blocks(path)
    try:
        for (start, end, pad_end, what, want), horizon in zip(units, horizons):
            pos = start
            if what:
                h = xxhash.xxh3_64()
                while pos < end and len(buf := fh.view(pos, end - pos, horizon)):
                    h.update(buf)
                    pos += len(buf)
                    tick(len(buf))
                if h.hexdigest() != want:
                    failures.append(E.FtwChecksumError(path, f"{what}: xxh3 {h.hexdigest()} != recorded {want}"))
            pos = max(pos, end)
            while pos < pad_end and len(buf := fh.view(pos, pad_end - pos, horizon)):
                if first_bad_pad is None and (rest := buf.tobytes().lstrip(b"\0")):
                    first_bad_pad = pos + len(buf) - len(rest)
                pos += len(buf)
                tick(len(buf))
    finally:
        fh.close()
    if first_bad_pad is not None:
        failures.append(E.FtwPaddingError(path, f"padding byte at offset {first_bad_pad} is not zero"))
    return failures
