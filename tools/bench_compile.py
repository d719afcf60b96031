"""Compile benchmark: synthesize a full-size Qwen3.6-35B-A3B NVFP4 checkpoint cut to a few layers, measure the disk,
compile it to FTW, and compare the wall time with the I/O bound.

    python tools/bench_compile.py [--layers 6] [--work DIR] [--keep]

The compile reads every input byte once (sha256 for provenance, tensors for the output) and writes every output
byte once, so its floor is `input bytes / disk read speed + output bytes / disk write speed`: the write speed is a
dd-like 64 MiB-block write with fsync; the read speed a sequential read of cold data (caches dropped).
The target is a wall time within 1.3x of that floor. Peak memory is reported twice: anonymous RSS (what the compile
allocates; sampled from /proc) and ru_maxrss (which also counts file pages the final verification maps).
Per-layer numbers are extrapolated to the real 40 layers from the bytes per layer. Writes benchmarks/compile.md and
benchmarks/compile.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FULL_LAYERS = 40
PRESET = "qwen3.6-35b-a3b"


def drop_cache(paths: list[Path]) -> None:
    """Evict files from the page cache (clean pages; no root needed) so reads really hit the disk."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_speed(work: Path, nbytes: int) -> float:
    """Bytes/s written to the work directory's disk: 64 MiB blocks of random data, fsync before the clock stops."""
    path = work / "disk-speed.bin"
    block = os.urandom(64 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        os.fsync(f.fileno())
    speed = nbytes / (time.perf_counter() - t0)
    path.unlink()
    return speed


def read_speed(files: list[Path], skip: int, nbytes: int) -> float:
    """Bytes/s of a sequential read of `nbytes` of data that was not read since it was written (the synthetic
    twin: same disk, same age as the input, never touched by the compile), starting `skip` bytes in. A file
    written a moment ago would be served by the host's caches and overstate the disk."""
    drop_cache(files)
    buf = bytearray(64 << 20)
    done, seen = 0, 0
    t0 = time.perf_counter()
    for p in files:
        size = p.stat().st_size
        if seen + size <= skip:
            seen += size
            continue
        with open(p, "rb", buffering=0) as f:
            f.seek(max(0, skip - seen))
            seen += size
            while done < nbytes and (n := f.readinto(buf)):
                done += n
        if done >= nbytes:
            break
    return done / (time.perf_counter() - t0)


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def run_compile(src: Path, out: Path) -> dict:
    """Compile in a child process; wall time, ru_maxrss and the peak anonymous RSS sampled every 20 ms."""
    code = ("import sys; from ft.compiler import compile_checkpoint; "
            "compile_checkpoint(sys.argv[1], sys.argv[2], force=True, progress=False)")
    cmd = [sys.executable, "-c", code, str(src), str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak = {"anon": 0, "rss": 0}

    def sample() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                peak["anon"] = max(peak["anon"], int(fields.get("RssAnon", "0 kB").split()[0]) << 10)
                peak["rss"] = max(peak["rss"], int(fields.get("VmRSS", "0 kB").split()[0]) << 10)
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"compile failed with exit code {proc.returncode}: {shlex.join(cmd)}")
    shown = ["python", "-c", code, _rel(src), _rel(out)]  # no machine-specific paths in the report
    return {"wall_s": wall, "peak_anon_rss": peak["anon"], "peak_rss_sampled": peak["rss"],
            "ru_maxrss": usage.ru_maxrss << 10, "command": shlex.join(shown)}


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return p.name


def per_layer_split(ftw: Path, src: Path) -> dict[str, int]:
    """Bytes outside the decoder layers and bytes per decoder layer, of the FTW output and of the source."""
    from ft.compiler.source import Checkpoint
    from ft.formats import FtwReader

    r = FtwReader(ftw, checksums="off")
    layers = r.config.num_layers
    out_layers = sum(t.nbytes for t in r.records.tensors.values() if t.name.startswith("layers."))
    out_layers += sum(b.nbytes for b in r.records.banks.values())
    out_total = sum(p.stat().st_size for p in files_under(ftw))
    ck = Checkpoint.open(src)
    in_layers = sum(i.nbytes for n, i in ck.tensors.items() if ".language_model.layers." in n)
    in_total = sum(p.stat().st_size for p in files_under(src))
    return {"out_fixed": out_total - out_layers, "out_per_layer": out_layers // layers,
            "in_fixed": in_total - in_layers, "in_per_layer": in_layers // layers}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split()[1]) << 10
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": mem, "python": platform.python_version(),
            "platform": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6, help="layers to synthesize (the real model has 40)")
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench_compile")
    ap.add_argument("--disk-bytes", type=int, default=2 << 30, help="bytes written / read by each disk-speed probe")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and the FTW output")
    args = ap.parse_args()

    from ft.compiler.synth import synth

    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / f"qwen36-nvfp4-L{args.layers}"
    out = args.work / f"qwen36-nvfp4-L{args.layers}.ftw"
    if not (src / "config.json").is_file():
        t0 = time.perf_counter()
        synth("qwen3_5_moe", PRESET, src, quant="nvfp4", num_layers=args.layers, force=True)
        print(f"synthesized {src} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    twin = sorted(src.with_name(src.name + "-twin").glob("*.safetensors"))
    if not twin:
        raise SystemExit(f"{src}-twin is missing: the read probe needs cold data on the same disk")
    in_files = files_under(src)
    in_bytes = sum(p.stat().st_size for p in in_files)
    r1, w1 = read_speed(twin, 0, args.disk_bytes), write_speed(args.work, args.disk_bytes)
    drop_cache(in_files)
    run = run_compile(src, out)
    # the disk is shared and noisy: probe before and after (the second read probe on other, still cold twin data)
    r2, w2 = read_speed(twin, args.disk_bytes, args.disk_bytes), write_speed(args.work, args.disk_bytes)
    read_bps, write_bps = (r1 + r2) / 2, (w1 + w2) / 2
    out_bytes = sum(p.stat().st_size for p in files_under(out))
    floor = in_bytes / read_bps + out_bytes / write_bps

    split = per_layer_split(out, src)
    full_in = split["in_fixed"] + FULL_LAYERS * split["in_per_layer"]
    full_out = split["out_fixed"] + FULL_LAYERS * split["out_per_layer"]
    full_floor = full_in / read_bps + full_out / write_bps
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": shlex.join(["python", "tools/bench_compile.py", *sys.argv[1:]]),
        "compile_command": run["command"],
        "checkpoint": {"preset": PRESET, "quant": "nvfp4", "layers": args.layers, "input_bytes": in_bytes,
                       "output_bytes": out_bytes},
        "disk": {"read_bytes_per_s": read_bps, "write_bytes_per_s": write_bps, "probe_bytes": args.disk_bytes,
                 "probes": {"before": [r1, w1], "after": [r2, w2]}},
        "compile": {"wall_s": run["wall_s"], "io_floor_s": floor, "ratio": run["wall_s"] / floor,
                    "peak_anon_rss_bytes": run["peak_anon_rss"], "peak_rss_sampled_bytes": run["peak_rss_sampled"],
                    "ru_maxrss_bytes": run["ru_maxrss"]},
        "extrapolated_40_layers": {"input_bytes": full_in, "output_bytes": full_out, "io_floor_s": full_floor,
                                   "wall_s_at_measured_ratio": full_floor * run["wall_s"] / floor,
                                   "output_bytes_per_layer": split["out_per_layer"],
                                   "input_bytes_per_layer": split["in_per_layer"]},
    }
    bench = REPO / "benchmarks"
    bench.mkdir(exist_ok=True)
    (bench / "compile.json").write_text(json.dumps(result, indent=2) + "\n")
    (bench / "compile.md").write_text(render(result))
    print(render(result))
    if not args.keep:
        for d in (src, src.with_name(src.name + "-twin"), out):
            shutil.rmtree(d, ignore_errors=True)


def render(r: dict) -> str:
    g, c, d, x, m = 1e9, r["compile"], r["disk"], r["extrapolated_40_layers"], r["machine"]
    ck = r["checkpoint"]
    return f"""# `ft checkpoint` compile benchmark

- date: {r['date']}
- machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM; {m['platform']}
- command: `{r['command']}`
- compile: `{r['compile_command']}` (fresh process, input evicted from the page cache first)

Input: synthetic {ck['preset']} NVFP4 (ModelOpt MIXED_PRECISION layout: NVFP4 experts/shared experts/lm_head, FP8
attention and GDN projections, BF16 rest) cut to {ck['layers']} of 40 layers.

| quantity | value |
|---|---|
| input / output | {ck['input_bytes'] / g:.2f} GB / {ck['output_bytes'] / g:.2f} GB |
| disk read (cold) / write (fsync); mean of probes before and after | {d['read_bytes_per_s'] / g:.2f} GB/s / {d['write_bytes_per_s'] / g:.2f} GB/s |
| I/O floor (read input + write output) | {c['io_floor_s']:.1f} s |
| compile wall time (incl. final verify) | {c['wall_s']:.1f} s |
| wall / floor (target <= 1.3) | **{c['ratio']:.2f}** |
| peak anonymous RSS | {c['peak_anon_rss_bytes'] / 2**30:.2f} GiB |
| ru_maxrss (incl. mapped file pages of the verify pass) | {c['ru_maxrss_bytes'] / 2**30:.2f} GiB |

Extrapolated to the full 40 layers ({x['input_bytes_per_layer'] / 2**20:.0f} MiB in, {x['output_bytes_per_layer'] / 2**20:.0f} MiB out
per layer): input {x['input_bytes'] / g:.1f} GB, output {x['output_bytes'] / g:.1f} GB, I/O floor {x['io_floor_s']:.0f} s,
expected wall {x['wall_s_at_measured_ratio']:.0f} s at the measured ratio.
"""


if __name__ == "__main__":
    main()
