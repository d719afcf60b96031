"""The library bytes a start of this interpreter reads before it is ready, kept so that the next start reads them first.

    record(exclude=ftw_dir, pause=wait_idle)   # once the server is ready and idle: what this process used, to the
                                               # cache (a small JSON)
    load()                    # at the next start: [(file, offset, nbytes)], read ahead before the FTW's ranges

Importing torch, Triton and the server from a cold disk is thousands of small reads, one after another. Behind a
read-ahead's sequential stream each of them waits (a disk's elevator serves the stream's sectors first), and the
imports end only when the read-ahead does (`benchmarks/coldstart.md`). Read ahead at full depth first, they come from
the page cache.

What is recorded: each imported module's bytecode and source files, whole, and of every file-backed mapping (shared
libraries) the pages this process has mapped in, from /proc/self/pagemap's present bit, as file ranges (gaps under
GAP joined). Files under `exclude` (the FTW, whose own ranges the read-ahead has), or linked from there, are left
out, and at most MAX_BYTES are kept. The list is a hint: `load` returns [] for anything unreadable or malformed, and
the read-ahead skips what no longer exists. One list per interpreter (its executable and prefix), written atomically.
Recording takes a core for a second or more (the page table of GBs of GPU libraries), so a server runs it only while
it is idle: `pause()` is asked before each file and blocks while requests run (`benchmarks/coldstart.md`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Callable

from .home import cache_home

log = logging.getLogger("ft.formats")

VERSION = 1
GAP = 256 << 10  # ranges of one file closer than this are read as one
MAX_BYTES = 2 << 30  # a list stops here: a hint must stay cheap to read
Ranges = list[tuple[Path, int, int]]  # (file, offset, nbytes)


def list_path() -> Path:
    key = hashlib.sha256(f"{sys.executable}\0{sys.prefix}".encode()).hexdigest()[:16]
    return cache_home() / "startup" / f"{key}.json"


def load(path: Path | None = None) -> Ranges:
    """The recorded ranges, in the order recorded; [] when there is no list or it does not parse."""
    try:
        doc = json.loads((path or list_path()).read_text())
        if doc.get("version") != VERSION:
            return []
        out = [(Path(f), int(a), int(n)) for f, ranges in doc["files"] for a, n in ranges]
        return out if all(p.is_absolute() and a >= 0 and n > 0 for p, a, n in out) else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def record(exclude: Path | None = None, path: Path | None = None,
           pause: Callable[[], bool] | None = None) -> Path | None:
    """Write what this process has used (module docstring) to `path` (default `list_path()`); None if it could not,
    or if `pause()` (called before each file: it may block while the process is busy) returned False."""
    def go() -> None:
        if pause is not None and not pause():
            raise _Stopped

    try:
        go()
        skip = Path(exclude).resolve() if exclude is not None else None
        # and the files it holds wherever their links lead (a Hub snapshot's files are links to its blobs)
        skip_files = {str(p.resolve()) for p in Path(exclude).rglob("*")} if exclude is not None else set()

        def wanted(f: str) -> bool:
            go()
            return _regular(f) and f not in skip_files and not (skip is not None and Path(f).is_relative_to(skip))

        files = {f: [[0, os.path.getsize(f)]] for f in _module_files() if wanted(f)}
        try:
            mapped = _mapped_pages(wanted)
        except OSError as e:  # no /proc/self/pagemap (a restricted container): the modules alone
            log.debug("start-up file list without mapped files: %s", e)
            mapped = {}
        for f, pages in mapped.items():
            if f not in files:  # a module file is listed whole already
                go()
                files[f] = _joined(pages)
        kept, total = [], 0
        for f, ranges in files.items():
            ranges = [[a, b - a] for a, b in ranges if b > a]  # an empty module file has nothing to read
            total += sum(n for _, n in ranges)
            if total > MAX_BYTES:
                break
            if ranges:
                kept.append([f, ranges])
        out = path or list_path()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": VERSION, "files": kept}))
        os.replace(tmp, out)
        return out
    except (OSError, ValueError) as e:
        log.debug("start-up file list not recorded: %s", e)
        return None
    except _Stopped:
        return None


class _Stopped(Exception):
    """`record`'s pause said stop (the server is shutting down)."""


def _module_files() -> list[str]:
    """Each imported module's files: its cached bytecode, which the import read, and its source, which a start reads
    too (Triton hashes its own sources for its cache key and reads each kernel's source when it is first launched);
    extension modules are mappings, taken from /proc/self/maps."""
    out = []
    for m in list(sys.modules.values()):
        for attr in ("__cached__", "__file__"):
            f = getattr(m, attr, None)
            if isinstance(f, str) and f.endswith((".pyc", ".py")) and os.path.isfile(f):
                out.append(os.path.abspath(f))
    return out


def _mapped_pages(wanted) -> dict[str, list]:
    """File path -> offsets of the pages of it this process has mapped in (present in its page table; int64 arrays,
    one per mapping), for the mapped files `wanted(path)` accepts (asked before the page table is read: a device's
    mapping can span GiBs). Vectorized: a GPU process maps GBs of CUDA libraries, and this runs beside the first
    requests (numpy imported here, not at module import: the read-ahead imports this module before torch)."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    out: dict[str, list] = {}
    verdict: dict[str, bool] = {}
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb", buffering=0) as pm:
        for line in maps:
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
                continue
            if parts[5] not in verdict:
                verdict[parts[5]] = wanted(parts[5])
            if not verdict[parts[5]]:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            entries = np.frombuffer(os.pread(pm.fileno(), (end - start) // page * 8, start // page * 8), np.uint64)
            present = np.flatnonzero(entries >> np.uint64(63)).astype(np.int64)
            out.setdefault(parts[5], []).append(int(parts[2], 16) + present * page)
    return out


def _joined(pages: list) -> list[list[int]]:
    """Page offsets (int64 arrays, as `_mapped_pages` gives them) -> [start, end) ranges, pages closer than GAP
    joined."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    p = np.unique(np.concatenate(pages))
    if p.size == 0:
        return []
    cut = np.flatnonzero(np.diff(p) > GAP + page)  # the last page of each range but the last
    starts, ends = p[np.r_[0, cut + 1]], p[np.r_[cut, len(p) - 1]] + page
    return [[int(a), int(b)] for a, b in zip(starts, ends)]


def _regular(f: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(f).st_mode)
    except OSError:
        return False
