"""Warming the page cache with what an engine start reads first, while the process is still importing.

    start_prefetch(ftw_dir)   # returns at once; a daemon thread asks the kernel to read ahead

`ft serve` / `ft generate` call it before their heavy imports (torch, Triton, the server: seconds on a GPU host), so
a cold disk is already reading while they run: the dense tensors, which a GPU load copies whole, in file order, at
most MAX_BYTES. Expert records are left to the start's own order (which plan it uses, if any, depends on the machine).
It only asks the kernel to read ahead (posix_fadvise WILLNEED): nothing it reads is trusted or used, the reader
verifies everything when the engine opens the FTW. It parses the index with the standard library (no torch), reads
only the directory's own data files (data-NNNNN.ftd, regular files, no links), and gives up silently on anything
else, as a hint should. Without posix_fadvise (not Linux) it does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from pathlib import Path

from .layout import HEADER_SIZE, INDEX_NAME, MAGIC, Header, data_file_name

log = logging.getLogger("ft.formats")

MAX_BYTES = 8 << 30  # read ahead no more than this
WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def dense_ranges(ftw: Path, gap: int = 1 << 20) -> list[tuple[Path, int, int]]:
    """(file, offset, nbytes) of the dense tensors in file order, ranges less than `gap` apart merged (the alignment
    padding between tensors costs less to read than another request); [] if the index does not parse."""
    try:
        with open(ftw / INDEX_NAME, "rb") as f:
            magic, h = Header.unpack(f.read(HEADER_SIZE))
            if magic != MAGIC:
                return []
            m = json.loads(f.read(h.manifest_nbytes))
        files = [ftw / data_file_name(i) for i in range(len(m["files"]))]  # the names the spec gives them
        if any(p.is_symlink() or not p.is_file() for p in files):
            return []
        return _merged([(files[t["file"]], int(t["offset"]), int(t["nbytes"])) for t in m["tensors"]], gap)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
        return []


def start_prefetch(ftw: str | Path) -> threading.Thread | None:
    """Start the read-ahead of `dense_ranges(ftw)` on a daemon thread (module docstring); None where there is nothing
    to do (no posix_fadvise, no such directory)."""
    ftw = Path(ftw)
    if WILLNEED is None or not ftw.is_dir():
        return None
    t = threading.Thread(target=_read_ahead, args=(ftw,), name="ft-prefetch", daemon=True)
    t.start()
    return t


def _read_ahead(ftw: Path) -> None:
    left = MAX_BYTES
    fds: dict[Path, int] = {}
    try:
        for path, offset, nbytes in dense_ranges(ftw):
            if left <= 0:
                break
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            n = min(nbytes, left)
            os.posix_fadvise(fds[path], offset, n, WILLNEED)
            left -= n
    except OSError as e:
        log.debug("prefetch of %s stopped: %s", ftw, e)
    finally:
        for fd in fds.values():
            os.close(fd)


def _merged(ranges: list[tuple[Path, int, int]], gap: int) -> list[tuple[Path, int, int]]:
    """Sorted by (file, offset), ranges of one file at most `gap` apart joined."""
    out: list[tuple[Path, int, int]] = []
    for path, offset, nbytes in sorted(ranges, key=lambda r: (str(r[0]), r[1])):
        if out and out[-1][0] == path and offset <= out[-1][1] + out[-1][2] + gap:
            p, o, n = out[-1]
            out[-1] = (p, o, max(n, offset + nbytes - o))
        else:
            out.append((path, offset, nbytes))
    return out
