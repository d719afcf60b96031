"""Where `ft serve`'s start-up time goes: the engine built and warmed up as the server does it
(`server.app.load_engine`), under cProfile.

    python tools/profile_startup.py --ftw DIR --out DIR [--device cuda] [--vram-budget 8GiB] [--runs 2] [--top 40]

Each run is a fresh process (run 1 may compile kernels into Triton's cache; later runs find them there, as a start
with prebuilt kernels does). Per run: the imports, `Engine(...)` and `Engine.warm_up()` (the short request the server
runs before it is ready) timed, the last two profiled (cProfile sees the calling thread only: the background
page-locking shows where that thread waits for it; `tools/bench_coldstart.py --py-spy` samples every thread). Writes
DIR/startup.json (per run: phase seconds, the engine's start-up counters: kernels compiled, graphs captured, pinning)
and DIR/run-N/profile.txt (the profile's top functions by cumulative and by own time)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import subprocess
import sys
import time
from pathlib import Path


def _top(profile: cProfile.Profile, key: str, n: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).strip_dirs().sort_stats(key).print_stats(n)
    return out.getvalue()


def profile_once(args: argparse.Namespace, out: Path) -> dict:
    """One start in this process: phases, counters -> dict; the profile to out/profile.txt."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t = time.perf_counter()
    from ft.runtime.engine import Engine, EngineSettings
    from ft.runtime.gpu.sizing import parse_bytes

    phases = {"import_s": time.perf_counter() - t}
    budget = parse_bytes(args.vram_budget) if args.vram_budget else None
    load, warm = cProfile.Profile(), cProfile.Profile()
    t = time.perf_counter()
    engine = load.runcall(Engine, args.ftw, EngineSettings(device=args.device, vram_budget=budget))
    phases["engine_s"] = time.perf_counter() - t
    t = time.perf_counter()
    warm.runcall(engine.warm_up)
    phases["warm_up_s"] = time.perf_counter() - t
    stats = engine.stats()
    experts, pin = engine._experts, None
    if callable(getattr(experts, "wait_pinned", None)):  # how long the banks' page-locking goes on after ready
        t = time.perf_counter()
        pin = experts.wait_pinned()
        phases["pinning_after_ready_s"] = time.perf_counter() - t
    engine.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.txt").write_text("".join(f"===== {name}: {by} =====\n{_top(p, by, args.top)}"
                                             for name, p in (("engine", load), ("warm_up", warm))
                                             for by in ("cumulative", "tottime")))
    return {**{k: round(v, 3) for k, v in phases.items()}, "startup": stats.get("startup"),
            "kernels": stats.get("kernels"),
            "cuda_graphs": stats.get("cuda_graphs"),
            "pin": {k: v for k, v in (pin or {}).items() if isinstance(v, (int, float, str, bool))}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ftw", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run, its row as JSON on stdout
    args = ap.parse_args()
    if args.child:
        print("ROW " + json.dumps(profile_once(args, args.out), default=str))
        return
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ftw": str(args.ftw),
              "device": args.device, "vram_budget": args.vram_budget, "runs": []}
    for i in range(1, args.runs + 1):
        cmd = [sys.executable, __file__, "--child", "--ftw", str(args.ftw), "--out", str(args.out / f"run-{i}"),
               "--device", args.device, "--top", str(args.top)]
        cmd += ["--vram-budget", args.vram_budget] if args.vram_budget else []
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-4000:])
        rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode != 0 or not rows:
            raise SystemExit(f"run {i} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        row = {"run": i, "process_s": round(time.perf_counter() - t, 3), **json.loads(rows[0])}
        result["runs"].append(row)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "startup.json").write_text(json.dumps(result, indent=1, default=str))  # after each run
        print(json.dumps({k: row[k] for k in row if k not in ("kernels", "pin")}, default=str))


if __name__ == "__main__":
    main()
