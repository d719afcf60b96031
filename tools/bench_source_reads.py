"""How many bytes a compile reads from the disk, against the source's size: the read-once check of `ft checkpoint`.

    python tools/bench_source_reads.py SRC [--quantize nvfp4] [--work DIR] [--note TEXT] [--json FILE]

Cold cache (root: /proc/sys/vm/drop_caches, else posix_fadvise on the source files), then:
1. the read bound: every source weight file read once sequentially with O_DIRECT (64 MiB reads), bytes / seconds
   (probed before and after the compile, the faster counts); a 2 GiB O_DIRECT write probe for the write side;
2. what a cold child reads that only imports the compiler (Python, torch's libraries: `import_read_bytes`);
3. the compile in a child process (`compile_checkpoint`, `--verify sample`), caches dropped again right before it;
   the child reports its own /proc/self/io `read_bytes` (bytes its reads fetched from the storage layer; page-cache
   hits do not count) and ru_maxrss.
Reported: `read_ratio` = read_bytes / source bytes and `source_read_ratio` = (read_bytes - import_read_bytes) /
source bytes (1.0 = every weight byte once; the final sampled verify re-reads up to 256 MiB of the output, counted
too); wall / read bound (source bytes / read rate) and wall / floor (read bound + output bytes / write rate: this
disk shares one budget between reads and writes, benchmarks/compile.md). The output directory is removed afterwards.
Caveat: on a VM the host may cache what the guest dropped, so a second read of the same bytes can be faster than
the cold probe; read_bytes is the machine-independent number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile_lib import drop_cache, write_speed  # noqa: E402

CHILD = """
import json, resource, sys, time
from ft.compiler import compile_checkpoint
t0 = time.perf_counter()
compile_checkpoint(sys.argv[1], sys.argv[2], force=True, progress=False, quantize=sys.argv[3] or None)
wall = time.perf_counter() - t0
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(json.dumps({"wall_s": wall, "read_bytes": int(io["read_bytes"]), "rchar": int(io["rchar"]),
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def weight_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def cold_read_rate(files: list[Path]) -> tuple[float, int]:
    """Sequential O_DIRECT read of every file after dropping the cache: (bytes/s, bytes)."""
    drop_cache(files)
    buf = mmap.mmap(-1, 64 << 20)
    total, t0 = 0, time.perf_counter()
    for p in files:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            off = 0
            while (n := os.preadv(fd, [buf], off)) > 0:
                off += n
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0), total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--quantize", default="")
    ap.add_argument("--work", type=Path, default=None, help="where the output goes (default: beside SRC)")
    ap.add_argument("--note", default="")
    ap.add_argument("--json", type=Path, default=None, help="append the result as one JSON line")
    a = ap.parse_args()
    files = weight_files(a.src)
    src_bytes = sum(p.stat().st_size for p in files)
    rate, _ = cold_read_rate(files)
    work = a.work or a.src.parent
    wrate = write_speed(work, 2 << 30, "direct")
    drop_cache(files)
    imp = subprocess.run([sys.executable, "-c", "import ft.compiler, torch; print(open('/proc/self/io').read())"],
                         check=True, capture_output=True, text=True).stdout
    import_read = int(dict(line.split(": ") for line in imp.strip().splitlines())["read_bytes"])
    out = work / f"{a.src.name}-ftw-bench"
    method = drop_cache(files)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", CHILD, str(a.src), str(out), a.quantize], check=True,
                         capture_output=True, text=True)
    outer = time.perf_counter() - t0
    out_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out, ignore_errors=True)
    child = json.loads(res.stdout.strip().splitlines()[-1])
    rate_after, _ = cold_read_rate(files)
    bound = src_bytes / max(rate, rate_after)
    floor = bound + out_bytes / wrate
    r = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "src": a.src.name, "quantize": a.quantize or None, "source_bytes": src_bytes, "cache": method,
         "read_gbps": [rate / 1e9, rate_after / 1e9], "write_gbps": wrate / 1e9, "read_bound_s": bound,
         "output_bytes": out_bytes, "floor_s": floor, "import_read_bytes": import_read, **child, "process_s": outer,
         "read_ratio": child["read_bytes"] / src_bytes,
         "source_read_ratio": (child["read_bytes"] - import_read) / src_bytes,
         "wall_over_bound": child["wall_s"] / bound, "wall_over_floor": child["wall_s"] / floor,
         "load1": os.getloadavg()[0], "note": a.note}
    print(json.dumps(r, indent=1))
    if a.json:
        with a.json.open("a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
