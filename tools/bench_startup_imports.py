"""How long `ft serve`'s imports take from a cold disk while the start's read-ahead runs beside them.

    python tools/bench_startup_imports.py --ftw DIR --out benchmarks [--reps 3] [--modes none,plain,idle,list]
                                          [--in-flight MIB]

Each run is a fresh process, the page cache dropped first (as root all of it, else the FTW's and the listed files'
pages: `bench_compile_lib.drop_cache`), that starts the FTW's read-ahead (`ft.formats.prefetch`, as `ft serve` does
before its imports) and then imports torch, the engine and the server. Modes: `none` (no read-ahead: the imports
alone), `plain` (the read-ahead in the normal I/O class, without the start-up file list), `idle` (in the idle I/O
class, no list), `list` (idle class, the list read first: today's start). The list is recorded once first, by a
process that has imported the same modules. Reports the imports' seconds and when the read-ahead finished; writes
OUT/startup_imports.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile_lib import drop_cache  # noqa: E402

IMPORTS = "import torch, ft.runtime.engine, ft.runtime.server.app"
CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
from pathlib import Path
from ft.formats import prefetch, startup_files
mode, ftw, listed = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
if sys.argv[4] != "default":
    prefetch.IN_FLIGHT = int(sys.argv[4]) << 20
if mode in ("plain", "idle"):
    startup_files.load = lambda path=None: []
else:
    startup_files.load = lambda path=None, _load=startup_files.load: _load(listed)
if mode == "plain":
    prefetch._idle_io = lambda: None
thread = None if mode == "none" else prefetch.start_prefetch(ftw)
IMPORTS
imports = time.perf_counter() - t0
if thread is not None:
    thread.join()
print(json.dumps({"imports_s": round(imports, 3), "read_ahead_s": round(time.perf_counter() - t0, 3)}))
""".replace("IMPORTS", IMPORTS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ftw", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="none,plain,idle,list")
    ap.add_argument("--in-flight", default="default", help="MiB the read-ahead keeps in flight (default: IN_FLIGHT)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        listed = Path(tmp) / "list.json"
        subprocess.run([sys.executable, "-c", f"{IMPORTS}; from ft.formats import startup_files; "
                        f"startup_files.record(path=__import__('pathlib').Path({str(listed)!r}))"], check=True)
        from ft.formats import startup_files

        listed_ranges = startup_files.load(listed)
        listed_bytes = sum(n for _, _, n in listed_ranges)
        # as root the whole page cache, else these files' pages: the FTW's and the listed libraries'
        cold = sorted(p for p in args.ftw.iterdir() if p.is_file()) + sorted({p for p, _, _ in listed_ranges})
        runs, page_cache = [], None
        for rep in range(args.reps):
            for mode in modes:  # alternating, so that drifts of the disk hit every mode alike
                page_cache = drop_cache([p for p in cold if p.is_file()])
                out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.ftw), str(listed),
                                      args.in_flight],
                                     capture_output=True, text=True, check=True).stdout
                runs.append({"mode": mode, "rep": rep, **json.loads(out.strip().splitlines()[-1])})
                print(f"{mode:6s} imports {runs[-1]['imports_s']:5.2f} s  read-ahead done "
                      f"{runs[-1]['read_ahead_s']:5.2f} s", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(sys.argv), "ftw": str(args.ftw), "list_bytes": listed_bytes,
              "in_flight_mib": args.in_flight, "page_cache": page_cache,
              "imports": IMPORTS, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "startup_imports.json"
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*old, result], indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
