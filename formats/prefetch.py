"""Warming the page cache with what an engine start reads first, while the process is still importing.

    start_prefetch(ftw_dir)   # returns at once; a forked child asks the kernel to read ahead

`ft serve` / `ft generate` call it before their heavy imports (torch, Triton, the server: seconds on a GPU host), so
a cold disk is already reading while they run. In order: the library files the last start of this interpreter read
(`startup_files`: the imports' own reads then find them in the page cache), the FTW's dense tensors, which a load
copies whole, in file order (at most MAX_BYTES), then the expert banks in the manifest's (layer) order, the order a
GPU start page-locks them in, up to half of the available memory, the page-locking's own default allowance (a cold
start reads all of those before it is ready anyway; starting seconds earlier is what it gains). It only asks the
kernel to read ahead (posix_fadvise WILLNEED, one readahead-sized step at a time, IN_FLIGHT bytes ahead of what the
disk has delivered: `will_need`), from a child process in the idle I/O class: the disk stays busy, and the
process's own reads (imports, page faults) are served first where the disk's scheduler has classes, else wait behind
milliseconds of it, not gigabytes. Nothing it reads is trusted or used: the reader verifies everything when the
engine opens the FTW. It parses the index with the standard library (no torch), reads only the directory's own data
files (data-NNNNN.ftd, regular files, no links), and gives up silently on anything else, as a hint should. Without
posix_fadvise (not Linux) it does nothing.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import platform
import stat
import struct
import sys
import threading
from collections import deque
from pathlib import Path

from . import startup_files
from .layout import HEADER_SIZE, INDEX_NAME, MAGIC, Header, data_file_name

log = logging.getLogger("ft.formats")

MAX_BYTES = 8 << 30  # read ahead no more than this
WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


Ranges = list[tuple[Path, int, int]]  # (data file, offset, nbytes)


def read_ahead_ranges(ftw: Path, gap: int = 1 << 20) -> tuple[Ranges, Ranges]:
    """(dense, banks): the dense tensors in file order, ranges less than `gap` apart merged (the alignment padding
    between tensors costs less to read than another request), and the expert banks in manifest order (a bank is one
    contiguous range); ([], []) if the index does not parse."""
    try:
        with open(ftw / INDEX_NAME, "rb") as f:
            magic, h = Header.unpack(f.read(HEADER_SIZE))
            if magic != MAGIC:
                return [], []
            m = json.loads(f.read(h.manifest_nbytes))
        files = [ftw / data_file_name(i) for i in range(len(m["files"]))]  # the names the spec gives them
        if any(p.is_symlink() or not p.is_file() for p in files):
            return [], []
        dense = _merged([(files[t["file"]], int(t["offset"]), int(t["nbytes"])) for t in m["tensors"]], gap)
        banks = [(files[b["file"]], int(b["offset"]), int(b["num_experts"]) * int(b["stride"]))
                 for b in m["expert_banks"]]
        return dense, banks
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
        return [], []


MIN_STEP, MAX_STEP = 128 << 10, 64 << 20
IN_FLIGHT = 16 << 20  # read-ahead bytes in flight: the disk stays busy, another reader waits behind ~8 ms of it


def advice_step(fd: int) -> int:
    """The most bytes one POSIX_FADV_WILLNEED call on `fd` reads: Linux reads at most max(readahead, largest request)
    of the file's device per call (`force_page_cache_ra`) and drops the rest of the range silently, so one call over
    a 456 MB bank reads its first few MB. From sysfs (the device's read_ahead_kb and max_sectors_kb, or its block
    device info's read_ahead_kb), else 128 KiB, the kernel's default readahead; within [MIN_STEP, MAX_STEP]."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return MIN_STEP
    return _device_step(os.major(dev), os.minor(dev))


@functools.lru_cache(maxsize=64)
def _device_step(major: int, minor: int) -> int:
    node = f"{major}:{minor}"
    queue = Path("/sys/dev/block", node).resolve()
    queue = queue / "queue" if (queue / "queue").is_dir() else queue.parent / "queue"  # a partition: its disk's
    kib = []
    for f in (queue / "read_ahead_kb", queue / "max_sectors_kb", Path("/sys/class/bdi", node, "read_ahead_kb")):
        try:
            kib.append(int(f.read_text()))
        except (OSError, ValueError):
            pass
    return min(MAX_STEP, max(MIN_STEP, max(kib, default=0) << 10))


def will_need(fd: int, offset: int, nbytes: int, step: int | None = None, in_flight: int | None = None) -> None:
    """Ask the kernel to read [offset, offset + nbytes) of `fd` into the page cache, all of it: one WILLNEED call per
    `step` (default `advice_step(fd)`); nothing without posix_fadvise. Each call queues its reads and returns.
    Unbounded (`in_flight` None), the loop queues as much as the device takes and runs at the disk's speed, and every
    other read of the process waits behind that queue; with `in_flight`, it keeps about that many bytes asked for and
    not yet read (it waits for the oldest step's last byte), so another reader's request (an import, a page fault)
    waits behind those at most."""
    if WILLNEED is None:  # not Linux: nothing to ask
        return
    step = step or advice_step(fd)
    depth = max(1, in_flight // step) if in_flight is not None else None
    asked: deque[int] = deque()  # the last byte of each step asked for and maybe not yet read, oldest first
    for a in range(offset, offset + nbytes, step):
        n = min(step, offset + nbytes - a)
        os.posix_fadvise(fd, a, n, WILLNEED)
        asked.append(a + n - 1)
        if depth is not None and len(asked) > depth:
            os.pread(fd, 1, asked.popleft())  # returns once that page (and, in practice, its step) is read


def meminfo(field: str = "MemAvailable") -> int:
    """A /proc/meminfo field (MemAvailable, MemTotal, ...) in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def bank_allowance() -> int:
    """Half of MemAvailable: the host memory the expert banks may be page-locked in by default (`gpu/pinning.py`),
    and so what a start reads of them before it is ready; 0 where /proc/meminfo says nothing."""
    return meminfo("MemAvailable") // 2


def start_prefetch(ftw: str | Path | None, *, process: bool = True) -> threading.Thread | None:
    """Start the read-ahead of `read_ahead_ranges(ftw)` (module docstring); returns a daemon thread that ends with it,
    or None where there is nothing to do (no posix_fadvise, no FTW given, no such directory: a hub repo id is resolved
    later).

    With `process` (the default) the read-ahead runs in a forked child process, which the returned thread reaps: a
    thread of this process needs the GIL between its system calls, and the imports it runs beside hold the GIL for
    seconds at a time while they load extension modules (torch's CUDA libraries: the disk sat idle for 3 of the first
    4 s of a GPU start). The child dies with this process (PR_SET_PDEATHSIG). Without fork, or once this process has
    other threads (forking then is unsafe), it runs on the thread itself; tests that patch what it calls use that."""
    if ftw is None or WILLNEED is None or not Path(ftw).is_dir():
        return None
    ftw = Path(ftw)
    if process and hasattr(os, "fork") and threading.active_count() == 1:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: read ahead, then leave without running this process's exit handlers
            try:
                _die_with(parent)
                _read_ahead(ftw)
            finally:
                os._exit(0)
        t = threading.Thread(target=os.waitpid, args=(pid, 0), name="ft-prefetch", daemon=True)
    else:
        t = threading.Thread(target=_read_ahead, args=(ftw,), name="ft-prefetch", daemon=True)
    t.start()
    return t


def _die_with(parent: int) -> None:
    """In the forked child: be killed when `parent` exits (Linux prctl PR_SET_PDEATHSIG), and leave now if it already
    has; elsewhere the child simply runs to its end."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def _read_ahead(ftw: Path) -> None:
    _idle_io()
    # first what the imports will read (a hint: gone files skipped), one file open at a time
    for path, ranges in itertools.groupby(startup_files.load(), key=lambda r: r[0]):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                for _, offset, nbytes in ranges:
                    will_need(fd, offset, nbytes, in_flight=IN_FLIGHT)
        except OSError:
            pass
        finally:
            os.close(fd)
    fds: dict[Path, int] = {}
    dense, banks = read_ahead_ranges(ftw)
    try:
        for ranges, cap in ((dense, MAX_BYTES), (banks, bank_allowance())):
            for path, offset, nbytes in ranges:
                if cap <= 0:
                    break
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                n = min(nbytes, cap)
                will_need(fds[path], offset, n, in_flight=IN_FLIGHT)
                cap -= n
    except OSError as e:
        log.debug("prefetch of %s stopped: %s", ftw, e)
    finally:
        for fd in fds.values():
            os.close(fd)


IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set system call's number (no libc wrapper exists)


def _idle_io() -> None:
    """Put the calling thread in the idle I/O class, so that where the disk's scheduler has classes (mq-deadline,
    BFQ) the process's own reads (imports, page faults) go before the read-ahead's; nothing where that fails."""
    nr = IOPRIO_SET.get(platform.machine()) if sys.platform.startswith("linux") else None
    if nr is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).syscall(nr, 1, threading.get_native_id(), 3 << 13)  # WHO_PROCESS, IDLE
    except (OSError, AttributeError):
        pass


def _merged(ranges: Ranges, gap: int) -> Ranges:
    """Sorted by (file, offset), ranges of one file at most `gap` apart joined."""
    out: Ranges = []
    for path, offset, nbytes in sorted(ranges, key=lambda r: (str(r[0]), r[1])):
        if out and out[-1][0] == path and offset <= out[-1][1] + out[-1][2] + gap:
            p, o, n = out[-1]
            out[-1] = (p, o, max(n, offset + nbytes - o))
        else:
            out.append((path, offset, nbytes))
    return out
