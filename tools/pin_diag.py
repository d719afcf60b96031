"""Which way of page-locking host memory works on this machine, and how fast (GPU machine diagnostic).

Each case runs in a child process with a timeout, since cudaHostRegister has hung on some VMs:
file pages mapped private (the reader's mapping) or shared, read-only or writable registration, anonymous memory,
cudaHostAlloc (torch pin_memory), and an O_DIRECT read of a file into a pinned buffer. Prints one JSON line per case.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

_CHILD = r"""
import ctypes, json, mmap, os, sys, time, numpy as np, torch
from ft.runtime.gpu.pinning import prefault
path, case, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.cuda.init(); torch.empty(1, device="cuda")
cud = torch.cuda.cudart()
def evict():
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def reg(addr, flags):
    t = time.perf_counter(); rc = int(cud.cudaHostRegister(addr, n, flags)); return rc, time.perf_counter() - t
out = {"case": case}
if case.startswith("file"):
    evict()
    f = open(path, "rb")
    acc = mmap.ACCESS_COPY if "private" in case else mmap.ACCESS_READ
    mm = mmap.mmap(f.fileno(), n, access=acc)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm)) if acc == mmap.ACCESS_COPY else \
        np.frombuffer(mm, np.uint8).ctypes.data
    t = time.perf_counter(); out["prefault"] = prefault(addr, n); out["prefault_s"] = time.perf_counter() - t
    out["rc"], out["register_s"] = reg(addr, 8 if "ro" in case else 0)
elif case == "anon":
    a = np.ones(n, np.uint8); out["rc"], out["register_s"] = reg(a.ctypes.data, 0)
elif case == "hostalloc":
    t = time.perf_counter(); b = torch.empty(n, dtype=torch.uint8, pin_memory=True); b[::4096] = 1
    out["alloc_s"] = time.perf_counter() - t; out["rc"] = 0
elif case == "odirect":
    b = torch.empty(n, dtype=torch.uint8, pin_memory=True); evict()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT); mv = memoryview(b.numpy())
    t = time.perf_counter(); done = 0
    while done < n:
        got = os.preadv(fd, [mv[done:done + (64 << 20)]], done)
        if got <= 0: raise SystemExit(f"short read at {done} of {n} bytes")
        done += got
    out["read_s"] = time.perf_counter() - t; out["gbs"] = n / out["read_s"] / 1e9; out["rc"] = 0
    d = torch.empty(n, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize(); t = time.perf_counter()
    d.copy_(b, non_blocking=True); torch.cuda.synchronize(); out["h2d_gbs"] = n / (time.perf_counter() - t) / 1e9
print(json.dumps(out), flush=True)
"""


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 456 << 20
    with open(path, "wb") as f:  # buffered write, then fsync: the pages can be evicted afterwards
        for _ in range(-(-n >> 24)):  # whole 16 MiB chunks covering n bytes
            f.write(bytes(range(256)) * (1 << 16))
        f.flush()
        import os
        os.fsync(f.fileno())
    info = {k: v for k, v in (line.split(":", 1) for line in open("/proc/meminfo"))
            if k in ("MemTotal", "MemFree", "MemAvailable", "Cached", "Mlocked", "CmaTotal", "HugePages_Total")}
    zones = [line.strip() for line in open("/proc/zoneinfo") if line.startswith("Node") or " managed " in line]
    print(json.dumps({"meminfo": {k: v.strip() for k, v in info.items()}, "zones": zones,
                      "cmdline": open("/proc/cmdline").read().strip(),
                      "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()}), flush=True)
    for case in ("hostalloc", "anon", "odirect", "file-shared-ro", "file-private-ro", "file-shared-rw",
                 "file-private-rw"):
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-c", _CHILD, path, case, str(n)], capture_output=True, text=True,
                               timeout=25)
            print(r.stdout.strip() or json.dumps({"case": case, "rc_proc": r.returncode, "err": r.stderr[-800:]}))
        except subprocess.TimeoutExpired:
            print(json.dumps({"case": case, "timeout_s": time.perf_counter() - t}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
