"""Cold start with and without prebuilt kernels: `ft serve` launch -> ready (GET /health) -> first token of a short
request, and the kernels Triton compiled, each run with an empty Triton cache.

    python tools/bench_coldstart.py --ftw DIR --out benchmarks/coldstart [--vram-budget 8GiB] [--build] [--runs 1]

DIR is any FTW (tools/gpu_full.py's "models" stage synthesizes the full-size ones). --build first runs
`ft kernels build --ftw DIR --arch <this GPU>` (its seconds are reported). Runs, each a fresh `ft serve` process with
its own empty TRITON_CACHE_DIR:
  jit       FT_HOME is an empty directory: no kernels are trusted, so the runtime compiles every kernel (today's start)
  prebuilt  FT_HOME as given (the kernels `ft kernels build` trusted): the FTW's kernels for this GPU are installed
  warm      the prebuilt run's cache again (launchers built, nothing to install): the floor
Writes OUT/coldstart.json (every run: seconds to ready, to the first token, the engine's "kernels" stats) and prints a
table. Needs a CUDA GPU; the port is free on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


def serve_once(ftw: Path | str, serve_args: list[str], env: dict, log_path: Path, deadline_s: float) -> dict:
    """One `ft serve --ftw FTW *serve_args` process (an FTW directory or a Hub repo id): seconds to ready and to the
    first token of a 16-token completion, and the engine's kernel stats."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*FT, "serve", "--ftw", str(ftw), *serve_args, "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while _get(f"{base}/health")[0] != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > deadline_s:
                raise RuntimeError(f"ft serve did not become ready (exit {proc.poll()}); see {log_path}")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        body = json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 2, "max_tokens": 1,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=deadline_s) as r:
            r.read()
        first = time.perf_counter() - t0
        stats = _get(f"{base}/v1/stats")[1]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"ready_s": round(ready, 3), "first_token_s": round(first, 3),
            "kernels": (stats.get("engine") or {}).get("kernels")}  # /v1/stats: the engine's stats under "engine"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ftw", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--build", action="store_true", help="ft kernels build for this GPU first")
    ap.add_argument("--runs", type=int, default=1, help="repetitions of each run")
    ap.add_argument("--deadline", type=float, default=1800.0, help="seconds before a run is given up")
    args = ap.parse_args()
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    args.out.mkdir(parents=True, exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "ftw": str(args.ftw),
              "gpu": torch.cuda.get_device_name(), "arch": arch, "vram_budget": args.vram_budget, "runs": []}
    if args.build:
        t = time.perf_counter()
        subprocess.run([*FT, "kernels", "build", "--ftw", str(args.ftw), "--arch", str(arch)], env=base_env,
                       check=True)
        result["build_s"] = round(time.perf_counter() - t, 1)
    with tempfile.TemporaryDirectory(prefix="ft-coldstart-") as tmp:
        for i in range(args.runs):
            for mode in ("jit", "prebuilt", "warm"):
                cache = Path(tmp) / f"cache-{i}-{'prebuilt' if mode == 'warm' else mode}"
                if mode != "warm":
                    shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir()
                env = {**base_env, "TRITON_CACHE_DIR": str(cache)}
                if mode == "jit":
                    env["FT_HOME"] = str(Path(tmp) / "no-trust")  # nothing trusted: every kernel compiles
                run = serve_once(args.ftw, ["--vram-budget", args.vram_budget], env,
                                 args.out / f"serve-{mode}-{i}.log", args.deadline)
                run.update(mode=mode, rep=i)
                result["runs"].append(run)
                k = run["kernels"] or {}
                print(f"{mode:9s} ready {run['ready_s']:7.2f} s  first token {run['first_token_s']:7.2f} s  "
                      f"prebuilt {k.get('prebuilt')} ({k.get('installed')})  compiled {k.get('compiled_since_start')}",
                      flush=True)
    (args.out / "coldstart.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'coldstart.json'}")


if __name__ == "__main__":
    main()
