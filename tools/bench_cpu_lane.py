"""The CPU lane's job time against experts per job, threads and build options, alone or beside a GPU copy loop.

    python tools/bench_cpu_lane.py [--threads 8,11,13,14] [--experts 1,2,3,4,8] [--jobs 300] [--bank-gib 4]
                                   [--builds "GU_ROWS=8;GU_ROWS=16,DOWN_ROWS=64"] [--concurrent] [--out DIR]
                                   [--schemes nvfp4,mxfp4] [--geometry 2880,2880] [--stem cpu_lane]
                                   [--libraries "before=OLD.so;after=NEW.so"]

In a decode step at a VRAM budget the lane (`runtime/gpu/cpu/lane.c`) computes ~2 of a layer's ~6 misses while the
GPU copies the rest from the same host memory, so its job time at 1-4 experts, with that copy running, sets the
split. This tool posts jobs into a lane's mailbox from this thread, as the GPU's post kernel would: each job is one
token routed to n distinct random experts of a bank larger than the caches (by default qwen3moe-35b-geom's experts,
H 2048, I 512, NVFP4; `--geometry H,I` and `--schemes` for others, e.g. gpt-oss-20b's 2880,2880 in NVFP4 and MXFP4),
and reads the lane's own timing of it (post seen -> answer written). Per configuration it fits
job seconds = fixed + per * experts. `--concurrent`: a CUDA side stream copies a 1 GiB page-locked buffer to the
device in a loop meanwhile (its rate is reported). `--builds`: the C kernel built with these macro settings
(`cpu/kernel.c`: GU_ROWS, DOWN_ROWS, FT_PREFETCH), each with -march=native. `--libraries`: these built libraries
instead (an A/B of two sources: each `build.py` prebuilt, its lane API unchanged). Writes <stem>.md / <stem>.json
under --out.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import shlex
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ft.runtime.gpu.cpu.lane import MB_DONE, MB_EXPERT, MB_LAYER, MB_N, MB_REQ, MB_T, MB_TOKEN, MB_WEIGHT, MB_X
from ft.runtime.gpu.cpu.kernel import bind, c_layout, load_library
from ft.runtime.gpu.record_layout import RecordLayout

TMAX = 8
UNIT_SCALE = {"nvfp4": 0x38, "mxfp4": 127}  # e4m3 1.0, E8M0 2^0
ROW_FLOATS = {"nvfp4": ("gate_up_scale_2", "down_scale_2"), "mxfp4": ("gate_up_bias", "down_bias")}


def make_bank(layout: RecordLayout, gib: float) -> tuple[torch.Tensor, int]:
    """[N, stride] uint8 records (page-locked when CUDA is here): random codes, unit block scales, per-row scale_2 of
    1 (NVFP4) or biases of 1 (MXFP4): finite values."""
    n = max(16, int(gib * (1 << 30)) // layout.stride)
    bank = torch.empty(n, layout.stride, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    bank.copy_(torch.randint(0, 256, (n, layout.stride), dtype=torch.uint8))
    for name in ("gate_up_scale", "down_scale"):
        off = getattr(layout, "off_" + name)
        bank[:, off:off + layout.nbytes(name)] = UNIT_SCALE[layout.scheme]
    for name in ROW_FLOATS[layout.scheme]:
        off = getattr(layout, "off_" + name)
        bank[:, off:off + layout.nbytes(name)].view(torch.float32).fill_(1.0)
    return bank, n


class CopyLoad:
    """A side-stream H2D copy loop from page-locked memory (the GPU's share of the host memory traffic)."""

    def __init__(self):
        self.src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()

    def _run(self):
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.bytes += self.src.numel()

    def close(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.bytes / (time.perf_counter() - self.t0)


def run_config(lib, layout, bank, n_rec, threads, experts, jobs, rng) -> list[dict]:
    H = layout.hidden
    mb = np.zeros(MB_X.value + 2 * TMAX * H + 16, np.int32)  # 64-byte aligned by numpy's allocator
    words, floats = mb, mb.view(np.float32)
    floats[MB_X.value:MB_X.value + H] = rng.standard_normal(H).astype(np.float32)
    clay = c_layout(layout)
    base = (ctypes.c_void_p * 1)(bank.data_ptr())
    stride = np.array([layout.stride], np.int64)
    count = np.array([n_rec], np.int32)
    lane = lib.ft_lane_new(ctypes.byref(clay), mb.ctypes.data, TMAX, 1, base, stride.ctypes.data, count.ctypes.data,
                           threads)
    if not lane:
        raise RuntimeError("ft_lane_new failed")
    seq, rows = 0, []
    try:
        for n in experts:
            picks = [rng.choice(n_rec, n, replace=False).astype(np.int32) for _ in range(jobs + 20)]
            words[MB_N.value], words[MB_T.value], words[MB_LAYER.value] = n, 1, 0
            words[MB_TOKEN.value:MB_TOKEN.value + n] = 0
            floats[MB_WEIGHT.value:MB_WEIGHT.value + n] = 1.0 / n
            before = stats = np.zeros(10, np.int64)
            t0, job_ns = 0.0, []
            for j, ids in enumerate(picks):
                if j == 20:  # warm-up done
                    lib.ft_lane_stats(lane, stats.ctypes.data)
                    before, stats, t0 = stats.copy(), np.zeros(10, np.int64), time.perf_counter()
                words[MB_EXPERT.value:MB_EXPERT.value + n] = ids
                seq += 1
                words[MB_REQ.value] = seq
                while words[MB_DONE.value] != seq:
                    os.sched_yield()  # a core to spare for the lane where there are few (2-core machines)
                if j >= 20:  # this job's busy time: the lane's cumulative counter, read between jobs
                    lib.ft_lane_stats(lane, stats.ctypes.data)
                    job_ns.append(int(stats[3]) - sum(job_ns) - int(before[3]))
            wall = time.perf_counter() - t0
            d = stats - before
            busy_us = d[3] / 1e3 / d[0]
            median_us = float(np.median(job_ns)) / 1e3
            rows.append({"experts": n, "jobs": int(d[0]), "busy_us": busy_us, "median_us": median_us,
                         "wall_us": wall * 1e6 / jobs, "gbs": n * layout.payload_bytes / (busy_us * 1e3)})
    finally:
        lib.ft_lane_free(lane)
    return rows


def fit(rows, stat: str = "busy_us") -> tuple[float, float]:
    """(fixed, per expert) us of the line through the rows' job times (`stat`: busy_us, the mean; median_us)."""
    x = np.array([r["experts"] for r in rows], float)
    y = np.array([r[stat] for r in rows], float)
    per, fixed = np.polyfit(x, y, 1)
    return float(fixed), float(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="8,11,13,14")
    ap.add_argument("--experts", default="1,2,3,4,8")
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--bank-gib", type=float, default=4.0)
    ap.add_argument("--builds", default="GU_ROWS=8", help="';'-separated builds, each ','-separated NAME=VALUE")
    ap.add_argument("--concurrent", action="store_true")
    ap.add_argument("--libraries", default="", help="';'-separated LABEL=PATH of built libraries to time instead "
                    "of --builds")
    ap.add_argument("--schemes", default="nvfp4", help="','-separated record schemes (nvfp4, mxfp4)")
    ap.add_argument("--geometry", default="2048,512", help="hidden,intermediate of the experts")
    ap.add_argument("--out", type=Path, default=Path("benchmarks"))
    ap.add_argument("--stem", default="cpu_lane", help="names of the written .md / .json")
    ap.add_argument("--median", action="store_true", help="fit and report median job times (a shared machine) "
                    "instead of means")
    args = ap.parse_args()
    H, I = (int(v) for v in args.geometry.split(","))
    rng = np.random.default_rng(0)
    threads = [int(t) for t in args.threads.split(",")]
    experts = [int(e) for e in args.experts.split(",")]
    loads = [False, True] if args.concurrent and torch.cuda.is_available() else [False]
    results, stat = [], "median_us" if args.median else "busy_us"
    for scheme in args.schemes.split(","):
        act = "clamped_swiglu" if scheme == "mxfp4" else "silu"  # each format's model family's activation
        layout = RecordLayout.packed(H, I, scheme, act=act)
        bank, n_rec = make_bank(layout, args.bank_gib)
        libs = ([tuple(kv.split("=", 1)) for kv in args.libraries.split(";")] if args.libraries
                else [(b, None) for b in args.builds.split(";")])
        for build, path in libs:
            lib = bind(path) if path else load_library(tuple(f"-D{kv}" for kv in build.split(",") if kv))
            for conc in loads:
                for t in threads:
                    load = CopyLoad() if conc else None
                    rows = run_config(lib, layout, bank, n_rec, t, experts, args.jobs, rng)
                    copy_gbs = load.close() / 1e9 if load else None
                    fixed, per = fit(rows, "median_us" if args.median else "busy_us")
                    results.append({"scheme": scheme, "hidden": H, "inter": I, "payload_bytes": layout.payload_bytes,
                                    "build": build, "concurrent": conc, "threads": t, "rows": rows,
                                    "fixed_us": fixed, "per_expert_us": per,
                                    "per_expert_gbs": layout.payload_bytes / (per * 1e3), "copy_gbs": copy_gbs})
                    print(f"{scheme} {build:20s} copy={'on ' if conc else 'off'} threads={t:2d}  fixed {fixed:6.1f} us"
                          f"  per expert {per:7.1f} us ({layout.payload_bytes / (per * 1e3):5.1f} GB/s)  "
                          + "  ".join(f"{r['experts']}:{r[stat]:.0f}" for r in rows)
                          + (f"  copy {copy_gbs:.1f} GB/s" if copy_gbs else ""), flush=True)
        del bank
    write(args, results, experts)


def write(args, results, experts) -> None:
    stat = "median_us" if args.median else "busy_us"
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "command": "python tools/bench_cpu_lane.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    (args.out / f"{args.stem}.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    lines = [f"# CPU lane job time ({meta['date']}, {meta['machine']}, GPU {meta['gpu']})", "",
             f"`{meta['command']}`", "",
             "| scheme | H, I | record MB | build | GPU copy | threads | fixed us | per expert us (GB/s) | "
             f"{stat[:-3]} job us at {' / '.join(map(str, experts))} experts | copy GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        jobs = " / ".join(f"{x[stat]:.0f}" for x in r["rows"])
        copy = f"{r['copy_gbs']:.1f}" if r["copy_gbs"] else ""
        lines.append(f"| {r['scheme']} | {r['hidden']}, {r['inter']} | {r['payload_bytes'] / 1e6:.2f} | {r['build']} | "
                     f"{'on' if r['concurrent'] else 'off'} | {r['threads']} | {r['fixed_us']:.1f} | "
                     f"{r['per_expert_us']:.1f} ({r['per_expert_gbs']:.1f}) | {jobs} | {copy} |")
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
