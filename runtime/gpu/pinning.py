"""Page-locking expert banks in place, so fetched records are DMA'd from the file pages with no staging copy.

`pin_banks` registers whole banks (one contiguous byte range each) with the uploader, in the order given, while the
host-memory allowance lasts. The allowance defaults to half of MemAvailable: page-locked memory cannot be swapped or
reclaimed, so the page cache and the rest of the machine keep the other half. Each bank is read into the page cache
with readahead first (`prefault`): the driver would fault cold pages in one at a time. A bank the driver refuses
(some VMs cannot pin file pages) stays on the staging path; nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

log = logging.getLogger("ft.gpu")
_CUDART: list = []


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's sticky last-error after a refused cudaHostRegister (torch's next kernel-launch check
    would report it otherwise). Best effort: finds the libcudart this process already loaded."""
    if not _CUDART:
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "libcudart" in line})
            _CUDART.extend(ctypes.CDLL(p) for p in paths)
        except OSError:
            pass
    for lib in _CUDART:  # every runtime copy in the process (the error state is per runtime and thread)
        lib.cudaGetLastError()


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def bank_range(bank) -> tuple[int, int]:
    """(first byte address, byte length) of an expert bank's records in the mmap, without touching the records."""
    comp, info = next(iter(bank.components.items()))
    stacked = bank.stacked(comp)
    return stacked.data_ptr() - int(info.offset), int(bank.num_experts) * int(bank.stride)


_MADV_WILLNEED, _MADV_POPULATE_READ = 3, 22  # linux/mman.h; POPULATE_READ since Linux 5.14
_PAGE = 4096


def prefault(base: int, nbytes: int) -> str:
    """Read [base, base + nbytes) of a file mapping into the page cache with readahead before it is page-locked.
    cudaHostRegister faults absent pages in one 4 KiB page at a time; on cold file pages (a bundle written with
    O_DIRECT, or just copied to this machine) that ran for minutes per bank on the GPU VM instead of the disk's
    second. Returns the method used."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = base - base % _PAGE
    length = nbytes + (base - start)
    if libc.madvise(start, length, _MADV_POPULATE_READ) == 0:
        return "populate"
    libc.madvise(start, length, _MADV_WILLNEED)  # older kernels: start readahead, then touch every page
    pages = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(start))[::_PAGE]
    int(pages.sum())  # reads one byte of each page
    return "touch"


def pin_banks(uploader, banks: list, allowance: int | None) -> dict:
    """Register banks (in order) until `allowance` bytes (None = half of MemAvailable) are used."""
    if allowance is None:
        allowance = mem_available() // 2
    pinned, count, refused = 0, 0, False
    for bank in banks:
        base, nbytes = bank_range(bank)
        if pinned + nbytes > allowance:
            continue
        prefault(base, nbytes)
        if not uploader.register(base, nbytes):
            refused = True
            break  # the driver refuses this kind of mapping; the others would fail the same way
        pinned += nbytes
        count += 1
    if refused:
        log.warning("cudaHostRegister refused the expert banks' file pages; fetches stay on the staging path")
    return {"pinned_banks": count, "pinned_bytes": pinned, "pin_refused": refused,
            "pin_allowance": allowance}
