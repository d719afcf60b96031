"""Benchmark: where a `--quantize nvfp4` compile's time goes beyond its disk bound, one stage taken away at a time.

    python tools/bench_compile_stages.py --src DIR [--out benchmarks] [--repeat 2] [--note TEXT] [--only 'V1;V2']
                                         [--py-spy BIN]

Each variant runs in its own process with the source's page cache dropped first (`bench_compile_lib.drop_cache`),
best of `--repeat`; compiles write into a temporary folder beside the source:
* pass: the source stream alone (`SourceStream.digests()`: every weight byte read once and hashed, nothing built);
* pass, no sha256: the same with the hash replaced by a no-op (what the single sha256 stream costs);
* compile, free quantization: `compile_checkpoint(quantize="nvfp4")` with the NVFP4 kernel replaced by zero-filled
  outputs of the right shapes (the read / copy / write pipeline alone: it writes as many bytes as the real one);
* the same, no sha256;
* compile --quantize: the real thing (a local folder: its weight files are hashed);
* compile --quantize / the free compile, published sha256: as from a hub download, whose weight files' published
  sha256 is taken (`metadata.published_sha256` stubbed to answer one): nothing hashed, and what no planned read needs
  (the MTP layers) not read at all. The "no sha256" variants stub the hash instead and still read every byte.
Stubbed runs produce wrong bytes on purpose and are deleted; only their times are kept. The disk bound is source
bytes over the faster cold read (O_DIRECT or buffered), as in `bench_quantize_speed.py`; the I/O floor adds the
compile's output bytes over the disk's O_DIRECT write speed (`benchmarks/compile.md`'s floor: reads and writes share
one disk). Each variant's best run also
keeps the source disk's timeline (GB/s read and written, busy share, every 100 ms): where the disk idles, the pipeline
stalls. Writes DIR/compile_stages.json (the runs appended) and prints a table. `--py-spy BIN`: after the timed runs,
one more run of each variant under `py-spy record --idle --threads` (not timed: sampling slows it), its chrome trace
in DIR/spy-<variant>.json for `tools/spy_phases.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile_lib import disk_timeline, drop_cache, read_speed, write_speed  # noqa: E402

VARIANTS = {  # variant -> (what the child runs, how weight files are hashed: on, off (stubbed), published)
    "pass": ("pass", "on"), "pass, no sha256": ("pass", "off"),
    "compile, free quantization": ("free", "on"), "compile, free quantization, no sha256": ("free", "off"),
    "compile --quantize": ("quantize", "on"),
    "compile, free quantization, published sha256": ("free", "published"),
    "compile --quantize, published sha256": ("quantize", "published")}

CHILD = r"""
import hashlib, sys, time, torch
from pathlib import Path
what, hashing, src, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
if hashing == "published":
    import ft.compiler.checkpoint as ck
    ck.published_sha256 = lambda root, name: "0" * 64 if name.endswith(".safetensors") else None
if hashing == "off":
    class _NoHash:
        def update(self, b): pass
        def hexdigest(self): return "0" * 64
    import ft.compiler.source_pass as sp
    sp.hashlib = type("H", (), {"sha256": _NoHash})
if what == "free":
    import ft.compiler.experts as ex
    def _zeros(w):
        n, k = w.shape
        return {"weight": torch.zeros(n, k // 2, dtype=torch.uint8), "weight_scale_2": torch.ones(n),
                "weight_scale": torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn)}
    ex.quantize_rows = lambda *ws: [_zeros(w) for w in ws]
from ft.compiler import compile_checkpoint
from ft.compiler.source_stream import SourceStream
t = time.perf_counter()
if what == "pass":
    SourceStream(src, sorted(p.name for p in src.glob("*.safetensors"))).digests()
else:
    compile_checkpoint(src, out, progress=False, quantize="nvfp4")
print(time.perf_counter() - t)
"""


def run(variant: str, src: Path, files: list[Path], spy: list[str] = ()) -> tuple[float, list, int]:
    """-> (seconds, the source disk's timeline while the child ran: `disk_timeline`, bytes the compile wrote); `spy`:
    the child runs under this profiler command line."""
    what, hashing = VARIANTS[variant]
    with tempfile.TemporaryDirectory(dir=src.parent, prefix="ft-stages-") as tmp:
        drop_cache(files)
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen([*spy, sys.executable, "-c", CHILD, what, hashing, str(src),
                                      str(Path(tmp) / "out.ftw")], stdout=out, stderr=err, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
            timeline = disk_timeline(files[0], lambda: child.poll() is None)
            out.seek(0), err.seek(0)
            if child.wait():
                raise SystemExit(f"{variant}: exit {child.returncode}\n{err.read()[-2000:]}")
            times = [ln for ln in out.read().split() if ln.replace(".", "", 1).isdigit()]  # py-spy prints too
            written = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
            return float(times[-1]), timeline, written


def _speed(probe, *args) -> float:
    """GB/s of a read or write probe; 0 where the filesystem refuses its method (O_DIRECT on a tmpfs source: the
    pass then reads buffered, at memory speed, and the sha256 streams set its pace)."""
    try:
        r = probe(*args)
    except OSError:
        return 0.0
    return (r[0] if isinstance(r, tuple) else r) / 1e9


def busy_share(timeline: list) -> float | None:
    """The share of a timeline's steps the disk was busy (None: no timeline)."""
    return sum(b for *_, b in timeline) / len(timeline) if timeline else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("benchmarks"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--note", default="")
    ap.add_argument("--only", help="these variants only, separated by ';' (default: all of VARIANTS)")
    ap.add_argument("--py-spy", help="a py-spy binary: one more, profiled run of each variant (module doc)")
    args = ap.parse_args()
    variants = [v.strip() for v in args.only.split(";")] if args.only else list(VARIANTS)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"bench_compile_stages: unknown variants {sorted(unknown)}; known: {'; '.join(VARIANTS)}")
    files = sorted(args.src.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    reads = {m: _speed(read_speed, files, 0, nbytes, m) for m in ("direct", "buffered")}  # GB/s
    bound = nbytes / 1e9 / max(reads.values())
    write = _speed(write_speed, args.src.parent, min(nbytes, 2 << 30), "direct") \
        or _speed(write_speed, args.src.parent, min(nbytes, 2 << 30), "buffered")  # GB/s
    row = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
           "note": args.note, "cpus": os.cpu_count(), "source_bytes": nbytes, "read_gb_s": reads,
           "write_gb_s": write, "disk_bound_s": bound, "seconds": {}, "written_bytes": {}}
    print(f"{nbytes / 1e9:.2f} GB, cold read {reads['direct']:.2f} (direct) / {reads['buffered']:.2f} (buffered) "
          f"GB/s, write {write:.2f} GB/s (direct), disk bound {bound:.2f} s, {os.cpu_count()} cores")
    row["disk_timeline"] = {}  # the best run's: is the disk idle while the pipeline stalls?
    for variant in variants:
        s, timeline, written = min(run(variant, args.src, files) for _ in range(args.repeat))
        row["seconds"][variant], row["disk_timeline"][variant] = s, timeline
        row["written_bytes"][variant] = written
        floor = bound + (written / 1e9 / write if written else 0.0)
        busy = busy_share(timeline)
        print(f"  {variant:40s} {s:6.2f} s  {s / bound:.2f}x the bound"
              + (f", {s / floor:.2f}x the I/O floor ({written / 1e9:.2f} GB written)" if written else "")
              + (f"  disk busy {100 * busy:.0f} % of the child's run" if busy is not None else ""), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in variants if args.py_spy else ():
        trace = args.out / f"spy-{variant.replace(',', '').replace(' ', '-')}.json"
        run(variant, args.src, files, [args.py_spy, "record", "--idle", "--threads", "--format", "chrometrace",
                                       "--rate", "200", "-o", str(trace), "--"])
        print(f"  profiled: {trace}", flush=True)
    path = args.out / "compile_stages.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(runs + [row], indent=1) + "\n")


if __name__ == "__main__":
    main()
