"""Compile benchmark: synthesize the Qwen3.6-35B-A3B NVFP4 checkpoint (all 40 layers, or cut to fewer), measure the
disk, compile it to FTW, and compare the wall time with the I/O bound.

    python tools/bench_compile.py [--layers 6] [--no-twin] [--work DIR] [--keep]
    python tools/bench_compile.py --layers 40 --no-twin     # the full model: 23 GB in, 21 GB out, no 72 GB twin

The compile reads every input byte once (sha256 for provenance, tensors for the output) and writes every output
byte once, so its floor is `input bytes / disk read speed + output bytes / disk write speed`. Write speed: 64 MiB
blocks of random data with fsync. Read speed: a sequential read of cold data, probed before and after the compile
(page cache dropped system-wide with /proc/sys/vm/drop_caches when running as root, else the files' pages evicted
with posix_fadvise). The cold data is the BF16 twin when it exists (same disk and age as the input, never read by the
compile), else 2 regions of the input shards themselves, read just as the compile will read them (caches dropped
again right before the compile). Target: wall within 1.3x of the floor, peak RSS under 4 GB. Peak memory of the
compile child: ru_maxrss (the kernel's high-water mark of resident pages, file pages included) and the peak of
RssAnon sampled from /proc every 20 ms. Fewer than 40 layers are extrapolated from the bytes per layer. Writes
benchmarks/compile.md and benchmarks/compile.json; the previous result is kept there as an older row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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
G = 1e9


def drop_cache(paths: list[Path]) -> str:
    """Empty the page cache so reads hit the disk: system-wide as root, else the given files' clean pages."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def write_speed(work: Path, nbytes: int) -> float:
    """Bytes/s written to the work directory's disk: 64 MiB blocks of random data, fsync before the clock stops."""
    path = work / "disk-speed.bin"
    block = os.urandom(64 << 20)
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            os.fsync(f.fileno())
        return nbytes / (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)


def read_speed(files: list[Path], skip: int, nbytes: int) -> tuple[float, str]:
    """(bytes/s, cache method) of a cold sequential read of `nbytes` of `files` (concatenated), `skip` bytes in."""
    method = drop_cache(files)
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
    if done < nbytes:
        raise SystemExit(f"read probe wanted {nbytes} bytes from {skip} on, the files hold only {done}")
    return done / (time.perf_counter() - t0), method


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def run_compile(src: Path, out: Path) -> dict:
    """Compile in a child process: wall time, its rusage, and /proc peaks sampled every 20 ms (plus load average)."""
    code = ("import sys; from ft.compiler import compile_checkpoint; "
            "compile_checkpoint(sys.argv[1], sys.argv[2], force=True, progress=False)")
    cmd = [sys.executable, "-c", code, str(src), str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak = {"RssAnon": 0, "VmHWM": 0, "RssFile": 0, "load1": os.getloadavg()[0]}

    def sample() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                for k in ("RssAnon", "VmHWM", "RssFile"):
                    peak[k] = max(peak[k], int(fields.get(k, "0 kB").split()[0]) << 10)
                peak["load1"] = max(peak["load1"], os.getloadavg()[0])
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
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "ru_maxrss": usage.ru_maxrss << 10,
            "peak": peak, "command": shlex.join(shown)}


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


def check_space(work: Path, layers: int, twin: bool, probe: int) -> None:
    """Refuse to start unless input + output (+ twin) + probe file fit: the bytes come from synth's tensor table."""
    from ft.compiler.synth import tensor_table

    def size(quant: str) -> int:
        table = tensor_table("qwen3_5_moe", PRESET, quant=quant, num_layers=layers)
        return sum(t.dtype.itemsize * math.prod(t.shape) for t in table)

    need = 2 * size("nvfp4") + (size("none") if twin else 0) + probe + (1 << 30)  # output ~= input bytes
    free = shutil.disk_usage(work).free
    if free < need:
        hint = " (try --no-twin)" if twin else ""
        raise SystemExit(f"{work}: {free / G:.1f} GB free, the run needs about {need / G:.1f} GB{hint}")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split()[1]) << 10
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": mem, "python": platform.python_version(),
            "platform": platform.platform()}


def measure(args, src: Path, out: Path) -> dict:
    """Probe the disk, compile, probe again; the result dict written to benchmarks/compile.json."""
    from ft.compiler.synth import synth

    if not (src / "config.json").is_file():
        t0 = time.perf_counter()
        synth("qwen3_5_moe", PRESET, src, quant="nvfp4", num_layers=args.layers, force=True, twin=not args.no_twin)
        print(f"synthesized {src} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    in_files = files_under(src)
    in_bytes = sum(p.stat().st_size for p in in_files)
    twin = sorted(src.with_name(src.name + "-twin").glob("*.safetensors"))
    cold = twin or sorted(src.glob("*.safetensors"))
    n = args.disk_bytes
    print("disk probes (before)", file=sys.stderr)
    (r1, method), w1 = read_speed(cold, 0, n), write_speed(args.work, n)
    drop_cache(in_files)
    load_before = os.getloadavg()
    print(f"compiling {in_bytes / G:.1f} GB", file=sys.stderr)
    run = run_compile(src, out)
    load_after = os.getloadavg()
    print(f"compiled in {run['wall_s']:.0f} s; disk probes (after)", file=sys.stderr)
    # the disk is shared and noisy: probe before and after (the second read on another cold region)
    (r2, _), w2 = read_speed(cold, n if twin else max(n, sum(p.stat().st_size for p in cold) - n), n), \
        write_speed(args.work, n)
    read_bps, write_bps = (r1 + r2) / 2, (w1 + w2) / 2
    out_bytes = sum(p.stat().st_size for p in files_under(out))
    floor = in_bytes / read_bps + out_bytes / write_bps
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": shlex.join(["python", "tools/bench_compile.py", *sys.argv[1:]]),
        "compile_command": run["command"],
        "checkpoint": {"preset": PRESET, "quant": "nvfp4", "layers": args.layers, "input_bytes": in_bytes,
                       "output_bytes": out_bytes},
        "disk": {"read_bytes_per_s": read_bps, "write_bytes_per_s": write_bps, "probe_bytes": n,
                 "read_probe": f"{'BF16 twin' if twin else 'input shards (first and last region)'}, cold by {method}",
                 "probes": {"before": [r1, w1], "after": [r2, w2]}},
        "compile": {"wall_s": run["wall_s"], "cpu_s": run["cpu_s"], "io_floor_s": floor,
                    "ratio": run["wall_s"] / floor, "ru_maxrss_bytes": run["ru_maxrss"],
                    "peak_anon_rss_bytes": run["peak"]["RssAnon"], "peak_file_rss_bytes": run["peak"]["RssFile"],
                    "vm_hwm_sampled_bytes": run["peak"]["VmHWM"]},
        "load_average": {"before": list(load_before), "after": list(load_after),
                         "max_1min_during": run["peak"]["load1"]},
    }
    if args.layers != FULL_LAYERS:
        split = per_layer_split(out, src)
        full_in = split["in_fixed"] + FULL_LAYERS * split["in_per_layer"]
        full_out = split["out_fixed"] + FULL_LAYERS * split["out_per_layer"]
        full_floor = full_in / read_bps + full_out / write_bps
        result["extrapolated_40_layers"] = {
            "input_bytes": full_in, "output_bytes": full_out, "io_floor_s": full_floor,
            "wall_s_at_measured_ratio": full_floor * run["wall_s"] / floor,
            "output_bytes_per_layer": split["out_per_layer"], "input_bytes_per_layer": split["in_per_layer"]}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6, help="layers to synthesize (the real model has 40)")
    ap.add_argument("--no-twin", action="store_true", help="synthesize without the BF16 twin (72 GB at 40 layers)")
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench_compile")
    ap.add_argument("--disk-bytes", type=int, default=2 << 30, help="bytes written / read by each disk-speed probe")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and the FTW output")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / f"qwen36-nvfp4-L{args.layers}"
    out = args.work / f"qwen36-nvfp4-L{args.layers}.ftw"
    if not (src / "config.json").is_file():
        check_space(args.work, args.layers, not args.no_twin, args.disk_bytes)
    try:
        result = measure(args, src, out)
    finally:  # tens of GB: never leave them behind, not even on failure or Ctrl-C
        if not args.keep:
            for d in (src, src.with_name(src.name + "-twin"), out, *args.work.glob(f".{src.name}*")):
                shutil.rmtree(d, ignore_errors=True)
    bench = REPO / "benchmarks"
    bench.mkdir(exist_ok=True)
    old = bench / "compile.json"
    if old.is_file():
        prev = json.loads(old.read_text())
        result["older"] = [{k: v for k, v in prev.items() if k != "older"}, *prev.get("older", [])]
    old.write_text(json.dumps(result, indent=2) + "\n")
    (bench / "compile.md").write_text(render(result))
    print(render(result))


def _row(r: dict, note: str) -> str:
    c, d, ck = r["compile"], r["disk"], r["checkpoint"]
    load = r.get("load_average", {}).get("max_1min_during")
    return (f"| {r['date']} | {ck['layers']} | {ck['input_bytes'] / G:.2f} / {ck['output_bytes'] / G:.2f} | "
            f"{d['read_bytes_per_s'] / G:.2f} / {d['write_bytes_per_s'] / G:.2f} | {c['io_floor_s']:.1f} | "
            f"{c['wall_s']:.1f} | {c['ratio']:.2f} | {c['ru_maxrss_bytes'] / 2**30:.2f} | "
            f"{c['peak_anon_rss_bytes'] / 2**30:.2f} | {'-' if load is None else f'{load:.1f}'} | {note} |")


def render(r: dict) -> str:
    c, d, m, ck, la = r["compile"], r["disk"], r["machine"], r["checkpoint"], r["load_average"]
    x = r.get("extrapolated_40_layers")
    extra = "" if x is None else f"""
Extrapolated to the full 40 layers ({x['input_bytes_per_layer'] / 2**20:.0f} MiB in, {x['output_bytes_per_layer'] / 2**20:.0f} MiB out
per layer): input {x['input_bytes'] / G:.1f} GB, output {x['output_bytes'] / G:.1f} GB, I/O floor {x['io_floor_s']:.0f} s,
expected wall {x['wall_s_at_measured_ratio']:.0f} s at the measured ratio.
"""
    older = "".join(_row(o, "older" + (f": {o['note']}" if o.get("note") else "")) + "\n" for o in r.get("older", []))
    return f"""# `ft checkpoint` compile benchmark

- date: {r['date']}
- machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM; {m['platform']}
- load average (1/5/15 min) before {'/'.join(f'{v:.2f}' for v in la['before'])}, after {'/'.join(f'{v:.2f}' for v in la['after'])}, highest 1-min during the compile {la['max_1min_during']:.2f} (the machine is shared)
- command: `{r['command']}`
- compile: `{r['compile_command']}` (fresh process, input evicted from the page cache first)
- read probe: {d['read_probe']}

Input: synthetic {ck['preset']} NVFP4 (ModelOpt MIXED_PRECISION layout: NVFP4 experts/shared experts/lm_head, FP8
attention and GDN projections, BF16 rest){'' if ck['layers'] == 40 else f' cut to {ck["layers"]} of 40 layers'}.

| quantity | value |
|---|---|
| input / output | {ck['input_bytes'] / G:.2f} GB / {ck['output_bytes'] / G:.2f} GB |
| disk read (cold) / write (fsync); mean of probes before and after | {d['read_bytes_per_s'] / G:.2f} GB/s / {d['write_bytes_per_s'] / G:.2f} GB/s |
| I/O floor (read input + write output) | {c['io_floor_s']:.1f} s |
| compile wall time (incl. final verify) / CPU time | {c['wall_s']:.1f} s / {c['cpu_s']:.1f} s |
| wall / floor (target <= 1.3) | **{c['ratio']:.2f}** |
| peak RSS, ru_maxrss (target < 4 GB) | {c['ru_maxrss_bytes'] / G:.2f} GB ({c['ru_maxrss_bytes'] / 2**30:.2f} GiB) |
| peak anonymous / file-backed RSS (sampled) | {c['peak_anon_rss_bytes'] / 2**30:.2f} GiB / {c['peak_file_rss_bytes'] / 2**30:.2f} GiB |
{extra}
## All results (newest first)

| date | layers | in / out GB | read / write GB/s | floor s | wall s | ratio | ru_maxrss GiB | anon RSS GiB | load | note |
|---|---|---|---|---|---|---|---|---|---|---|
{_row(r, "this run")}
{older}"""


if __name__ == "__main__":
    main()
