"""Compile benchmark: synthesize the Qwen3.6-35B-A3B NVFP4 checkpoint (all 40 layers, or cut to fewer), measure the
disk, compile it to FTW, and compare the wall time with the I/O bound.

    python tools/bench_compile.py [--layers 6] [--no-twin] [--work DIR] [--keep] [--verify full] [--note TEXT]
    python tools/bench_compile.py --layers 40 --no-twin     # the full model: 23 GB in, 21 GB out, no 72 GB twin
    python tools/bench_compile.py --layers 8 --quantize nvfp4   # a BF16 source quantized: compile_quantize.md

The compile reads every input byte once (sha256 for provenance, tensors for the output) and writes every output
byte once, so its floor is `input bytes / disk read speed + output bytes / disk write speed`. Each speed is the
faster of a buffered and an O_DIRECT probe (bench_compile_lib.py), each probed before and after the compile. Write:
64 MiB blocks of random data with fsync. Read: a sequential read of cold data (page cache dropped system-wide with
/proc/sys/vm/drop_caches when running as root, else the files' pages evicted with posix_fadvise). The cold data
is the BF16 twin when it exists (same disk and age as the input, never read by the compile), else 2 regions of the
input shards themselves, read just as the compile will read them (caches dropped again right before the compile).
Target: wall within 1.3x of the floor, peak RSS under 4 GB. Peak memory of the compile child: ru_maxrss (the
kernel's high-water mark of resident pages, file pages included) and the peak of RssAnon sampled from /proc every
20 ms. Fewer than 40 layers are extrapolated from the bytes per layer. Writes
benchmarks/compile.md and benchmarks/compile.json; the previous result is kept there as an older row.
`--verify full` measures the compile with its final full re-read (`ft checkpoint --verify full`).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile_lib import G, drop_cache, probe, render  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FULL_LAYERS = 40
PRESET = "qwen3.6-35b-a3b"


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def run_compile(src: Path, out: Path, verify: str, quantize: str | None = None) -> dict:
    """Compile in a child process: wall time, its rusage, and /proc peaks sampled every 20 ms (plus load average)."""
    code = ("import sys; from ft.compiler import compile_checkpoint; "
            f"compile_checkpoint(sys.argv[1], sys.argv[2], force=True, progress=False, verify={verify!r}"
            + (f", quantize={quantize!r})" if quantize else ")"))
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


def check_space(work: Path, layers: int, twin: bool, probe: int, source: str = "nvfp4") -> None:
    """Refuse to start unless input + output (+ twin) + probe file fit: the bytes come from synth's tensor table."""
    from ft.compiler.synth import tensor_table

    def size(quant: str) -> int:
        table = tensor_table("qwen3_5_moe", PRESET, quant=quant, num_layers=layers)
        return sum(t.dtype.itemsize * math.prod(t.shape) for t in table)

    need = size(source) + size("nvfp4") + (size("none") if twin else 0) + probe + (1 << 30)  # out: NVFP4 experts
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
        if args.quantize:  # a BF16 release's layout (fused experts), quantized by the compile
            synth("qwen3_5_moe", PRESET, src, dtype="bf16", expert_layout="fused", num_layers=args.layers, force=True)
        else:
            synth("qwen3_5_moe", PRESET, src, quant="nvfp4", num_layers=args.layers, force=True,
                  twin=not args.no_twin)
        print(f"synthesized {src} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    in_files = files_under(src)
    in_bytes = sum(p.stat().st_size for p in in_files)
    twin = sorted(src.with_name(src.name + "-twin").glob("*.safetensors"))
    cold = twin or sorted(src.glob("*.safetensors"))
    n = args.disk_bytes
    print("disk probes (before)", file=sys.stderr)
    before, method = probe(cold, 0, args.work, n)
    drop_cache(in_files)
    load_before = os.getloadavg()
    print(f"compiling {in_bytes / G:.1f} GB", file=sys.stderr)
    run = run_compile(src, out, args.verify, args.quantize)
    load_after = os.getloadavg()
    print(f"compiled in {run['wall_s']:.0f} s; disk probes (after)", file=sys.stderr)
    # the disk is shared and noisy: probe before and after (the second read on another cold region)
    after, _ = probe(cold, n if twin else max(n, sum(p.stat().st_size for p in cold) - n), args.work, n)
    mean = {k: (before[k] + after[k]) / 2 for k in before}
    read_bps = max(mean["read_buffered"], mean["read_direct"])
    write_bps = max(mean["write_buffered"], mean["write_direct"])
    out_bytes = sum(p.stat().st_size for p in files_under(out))
    floor = in_bytes / read_bps + out_bytes / write_bps
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": shlex.join(["python", "tools/bench_compile.py", *sys.argv[1:]]),
        "verify": args.verify, "note": args.note,
        "compile_command": run["command"],
        "checkpoint": {"preset": PRESET, "quant": "bf16" if args.quantize else "nvfp4", "quantize": args.quantize,
                       "layers": args.layers, "input_bytes": in_bytes,
                       "output_bytes": out_bytes},
        "disk": {"read_bytes_per_s": read_bps, "write_bytes_per_s": write_bps, "probe_bytes": n,
                 "read_probe": f"{'BF16 twin' if twin else 'input shards (first and last region)'}, cold by {method}",
                 "probes": {"before": before, "after": after}},
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
    ap.add_argument("--verify", choices=("sample", "full"), default="sample", help="the compile's final check")
    ap.add_argument("--note", default="", help="a note for this run's row in the history table")
    ap.add_argument("--quantize", choices=("nvfp4",), default=None,
                    help="synthesize a BF16 checkpoint (fused experts, as released) and compile it with --quantize")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    kind = "bf16" if args.quantize else "nvfp4"
    src = args.work / f"qwen36-{kind}-L{args.layers}"
    out = args.work / f"qwen36-{kind}-L{args.layers}.ftw"
    if not (src / "config.json").is_file():
        check_space(args.work, args.layers, not (args.no_twin or args.quantize), args.disk_bytes,
                    "none" if args.quantize else "nvfp4")
    try:
        result = measure(args, src, out)
    finally:  # tens of GB: never leave them behind, not even on failure or Ctrl-C
        if not args.keep:
            for d in (src, src.with_name(src.name + "-twin"), out, *args.work.glob(f".{src.name}*")):
                shutil.rmtree(d, ignore_errors=True)
    bench = REPO / "benchmarks"
    bench.mkdir(exist_ok=True)
    name = "compile_quantize" if args.quantize else "compile"  # a BF16 source quantized: its own history
    old = bench / f"{name}.json"
    if old.is_file():
        prev = json.loads(old.read_text())
        result["older"] = [{k: v for k, v in prev.items() if k != "older"}, *prev.get("older", [])]
    old.write_text(json.dumps(result, indent=2) + "\n")
    (bench / f"{name}.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
