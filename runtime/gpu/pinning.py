"""Page-locking expert banks in place, so fetched records are DMA'd from the file pages with no staging copy.

`pin_banks` registers whole banks (one contiguous byte range each) with the uploader, in the order given, while the
host-memory allowance lasts. The allowance defaults to half of MemAvailable: page-locked memory cannot be swapped or
reclaimed, so the page cache and the rest of the machine keep the other half. A bank the driver refuses (some VMs
cannot pin file pages) stays on the staging path; nothing else changes.

What is registered is not the reader's mapping but a second, shared read-only mapping of the same file bytes
(`shared_view`). The reader maps data files private and writable, a copy-on-write mapping; a long-term read-only pin
of page-cache pages in such a mapping makes the kernel "unshare" them, copying every 4 KiB page into a new anonymous
page one fault at a time. That doubles the memory a pinned bank costs, and on the GPU VM it ran for minutes per 456 MB
bank. Pages of a shared mapping are pinned as they are. Each bank is also read into the page cache with readahead
first (`prefault`): the driver would otherwise fault cold pages in one at a time.

Reading a cold bank costs its bytes ÷ disk speed (~13 s for 18 GB at 1.4 GB/s), so `BackgroundPinner` runs
`pin_banks` on a thread: startup and the first MoE calls do not wait, and until a bank is registered its records take
the uploader's staging path (the uploader decides per record).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
import warnings

import numpy as np
import torch

from ft.formats.prefetch import bank_allowance, meminfo

log = logging.getLogger("ft.gpu")
_CUDART: list = []


def _cudart_libs() -> list:
    """The libcudart copies this process already loaded (torch's), opened through ctypes once."""
    if not _CUDART:
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "libcudart" in line})
            _CUDART.extend(ctypes.CDLL(p) for p in paths)
        except OSError:
            pass
    return _CUDART


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's sticky last-error after a refused cudaHostRegister (torch's next kernel-launch check
    would report it otherwise). Best effort."""
    for lib in _cudart_libs():  # every runtime copy in the process (the error state is per runtime and thread)
        lib.cudaGetLastError()


def device_pointer(host_ptr: int) -> int | None:
    """The device address of registered, mapped host memory at `host_ptr` (cudaHostGetDevicePointer), or None."""
    for lib in _cudart_libs():
        out = ctypes.c_void_p()
        if lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0) == 0 and out.value:
            return int(out.value)
        lib.cudaGetLastError()
    return None


def mem_available() -> int:
    return meminfo("MemAvailable")


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


def shared_view(bank) -> torch.Tensor:
    """uint8 [E * stride]: the bank's bytes through a shared read-only mapping of its data file (see the module doc).
    Byte-identical to the reader's view; never written (the mapping is PROT_READ: a write would fault)."""
    nbytes = int(bank.num_experts) * int(bank.stride)
    start = int(bank.offset) - int(bank.offset) % mmap.ALLOCATIONGRANULARITY
    with open(bank.file, "rb") as f:
        mm = mmap.mmap(f.fileno(), int(bank.offset) + nbytes - start, access=mmap.ACCESS_READ, offset=start)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: this view is only read
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
    return whole[int(bank.offset) - start:]


def verify_bank(bank) -> bool:
    """Check every record's checksum now (the reader otherwise checks each on its first `record()` call); False (and
    a warning) on the first bad one. Kernels that read a bank in place (mode mapped) need this first."""
    try:
        for e in range(bank.num_experts):
            bank.record(e)
    except Exception as err:  # noqa: BLE001 - FtwChecksumError or I/O; the host path reports it when it reads it
        log.warning("bank %s is not read in place: %s", bank.name, err)
        return False
    return True


def pin_banks(uploader, banks: list, allowance: int | None, stop: threading.Event | None = None,
              verify: bool = False) -> dict:
    """Register banks (in order) until `allowance` bytes (None = half of MemAvailable) are used, or `stop` is set.
    `verify`: also check every record of every bank, registered or not (`verified_banks` lists those that passed;
    mode mapped's CPU lane computes the misses of verified banks left unregistered)."""
    if allowance is None:
        allowance = bank_allowance()
    pinned, count, refused, verified = 0, 0, False, []
    seconds = {"read_s": 0.0, "register_s": 0.0, "verify_s": 0.0}  # where the time goes (start-up reports)

    def timed(key: str, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            seconds[key] += time.perf_counter() - t

    def check(bank) -> None:
        if verify and timed("verify_s", verify_bank, bank):
            verified.append(bank.name)

    for bank in banks:
        if stop is not None and stop.is_set():
            break
        base, nbytes = bank_range(bank)
        if pinned + nbytes > allowance or refused:
            check(bank)
            continue
        view = shared_view(bank)
        timed("read_s", prefault, view.data_ptr(), nbytes)
        if not timed("register_s", uploader.register, base, nbytes, view):
            refused = True  # the driver refuses this kind of mapping; the others would fail the same way
            check(bank)
            continue
        pinned += nbytes
        count += 1
        check(bank)
    if refused:
        log.warning("cudaHostRegister refused the expert banks' file pages; fetches stay on the staging path")
    return {"pinned_banks": count, "pinned_bytes": pinned, "pin_refused": refused,
            "pin_allowance": allowance, "verified_banks": verified, **{k: round(v, 3) for k, v in seconds.items()}}


class BackgroundPinner:
    """`pin_banks` on a daemon thread. `done` is set when it has finished (or failed: `info["pin_error"]`); `info` then
    holds its result. `stop()` ends it after the bank in progress and joins, so nothing is registered after it
    returns (call it before the uploader unregisters its ranges)."""

    def __init__(self, uploader, banks: list, allowance: int | None, verify: bool = False):
        self.info: dict = {}
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(uploader, banks, allowance, verify), name="ft-pin",
                                        daemon=True)
        self._thread.start()

    def _run(self, uploader, banks: list, allowance: int | None, verify: bool) -> None:
        t = time.perf_counter()
        try:
            pool = getattr(uploader, "pool", None)
            if pool is not None and pool.device.type == "cuda":
                torch.cuda.set_device(pool.device)  # register with the pool's device current on this thread
            self.info = pin_banks(uploader, banks, allowance, stop=self._stop, verify=verify)
        except Exception as e:  # noqa: BLE001 - fetches simply stay on the staging path
            log.warning("page-locking the expert banks failed (%s: %s); fetches stay on the staging path",
                        type(e).__name__, e)
            self.info = {"pinned_banks": 0, "pinned_bytes": 0, "pin_refused": True,
                         "pin_error": f"{type(e).__name__}: {e}"}
        finally:
            self.info["seconds"] = round(time.perf_counter() - t, 3)  # from the engine's start of pinning
            i = self.info
            log.info("expert banks: %d of %d page-locked (%.2f GB) in %.2f s (reading %.2f, registering %.2f, "
                     "verifying %.2f)", i.get("pinned_banks", 0), len(banks), i.get("pinned_bytes", 0) / 1e9,
                     i["seconds"], i.get("read_s", 0.0), i.get("register_s", 0.0), i.get("verify_s", 0.0))
            self.done.set()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until pinning has finished (or `timeout` seconds passed); returns `info` ({} while running)."""
        self.done.wait(timeout)
        return self.info if self.done.is_set() else {}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
