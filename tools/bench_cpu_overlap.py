"""Does the CPU expert kernel overlap with a busy GPU-driving thread? Host time of one hybrid CPU job.

    python tools/bench_cpu_overlap.py [--experts 2] [--threads 1] [--busy-ms 0 1 2 5] [--out benchmarks]

In a hybrid MoE layer call the thread that drives the GPU submits the CPU experts' job, then goes on in Python
(uploads, kernel launches, prefetch) and finally waits for the job. The job should run meanwhile, so the call waits
max(kernel, Python work), not their sum. This measures submit -> result for a job of `--experts` Qwen3.6-35B-A3B
NVFP4 experts (batch 1) while the submitting thread spins in Python for `--busy-ms`, two ways:
  python-thread  a ThreadPoolExecutor worker calls the kernel (the implementation before 2026-12-03): it needs the
                 GIL to start, which a busy thread hands over only after the switch interval (5 ms)
  native-worker  `CpuMoe.submit`: the library's own pthread runs the kernel; no Python thread involved
Results are appended to <out>/cpu_overlap.json; <out>/cpu_overlap.md is rewritten from all runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from bench_record import append_run, machine  # tools/, next to this script

from ft.runtime.gpu.benchbw import _synthetic_records
from ft.runtime.gpu.cpu.kernel import CpuMoe
from ft.runtime.gpu.record_layout import RecordLayout


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads of the kernel")
    ap.add_argument("--busy-ms", type=float, nargs="+", default=[0, 1, 2, 5])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    layout = RecordLayout.packed(2048, 512)
    records = _synthetic_records(layout, args.experts)
    moe = CpuMoe(layout, threads=args.threads)
    x = torch.randn(1, layout.hidden)
    job = ([records[i] for i in range(args.experts)], [np.array([i]) for i in range(args.experts)],
           np.zeros(args.experts, np.int32), np.full(args.experts, 1 / args.experts, np.float32), x)
    for _ in range(5):
        moe(*job)
    t = time.perf_counter()
    for _ in range(args.repeats):
        moe(*job)
    kernel = (time.perf_counter() - t) / args.repeats
    pool = ThreadPoolExecutor(1)
    rows = []
    for busy in args.busy_ms:
        row = {"busy_ms": busy, "kernel_ms": round(kernel * 1e3, 3), "ideal_ms": round(max(kernel * 1e3, busy), 3)}
        for how in ("python-thread", "native-worker"):
            lat = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fut = pool.submit(moe, *job) if how == "python-thread" else moe.submit(*job)
                spin(busy / 1e3)
                fut.result()
                lat.append(time.perf_counter() - t)
            row[how + "_ms"] = round(float(np.median(lat)) * 1e3, 3)
        rows.append(row)
        print(row)
    moe.close()
    run = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": machine(f"torch {torch.__version__}, backend {moe.backend}"),
           "command": "python tools/bench_cpu_overlap.py " + " ".join(sys.argv[1:]),
           "experts": args.experts, "threads": args.threads, "switch_interval_s": sys.getswitchinterval(),
           "rows": rows}
    out = Path(args.out)
    runs = append_run(out, "cpu_overlap", run)
    lines = ["# CPU expert job beside a busy GPU-driving thread", "",
             "What `tools/bench_cpu_overlap.py` measures (see its docstring): submit -> result of one hybrid CPU job",
             "while the submitting thread spins in Python, with the kernel started by a Python worker thread (the",
             "implementation before 2026-12-03) and by the library's native worker (`CpuMoe.submit`). Ideal:",
             "max(kernel, busy).", "",
             "| date | experts | threads | busy ms | kernel ms | ideal ms | python thread ms | native worker ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for row in r["rows"]:
            lines.append(f"| {r['date']} | {r['experts']} | {r['threads']} | {row['busy_ms']:g} | {row['kernel_ms']} | "
                         f"{row['ideal_ms']} | {row['python-thread_ms']} | {row['native-worker_ms']} |")
    lines += ["", "Machines and commands:", ""]
    lines += [f"- {r['date']}: {r['machine']}; `{r['command']}`" for r in runs]
    (out / "cpu_overlap.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'cpu_overlap.md'}")


if __name__ == "__main__":
    main()
