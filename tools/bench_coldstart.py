"""Cold start with and without prebuilt kernels: `ft serve` launch -> ready (GET /health) -> first token of a short
request (and one of the same length on other tokens: its time is what the first should approach; `ft serve` runs a
warm-up request before it is ready, `Engine.warm_up`), the kernels Triton compiled and
the host launchers it built in the process, each run with an empty Triton cache.

    python tools/bench_coldstart.py --ftw DIR --out benchmarks/coldstart [--vram-budget 8GiB] [--build] [--runs 1]
                                    [--drop-caches] [--modes jit,prebuilt,warm] [--py-spy BIN] [--device cpu]
                                    [--startup-list on|off]

DIR is any FTW (tools/gpu_full.py's "models" stage synthesizes the full-size ones). --build first runs
`ft kernels build --ftw DIR --arch <this GPU>` (its seconds are reported). Runs, each a fresh `ft serve` process with
its own empty TRITON_CACHE_DIR:
  jit       FT_HOME is an empty directory: no kernels are trusted, so the runtime compiles every kernel (today's start)
  prebuilt  FT_HOME as given (the kernels `ft kernels build` trusted): the FTW's kernels for this GPU are installed
  warm      the prebuilt run's cache again (launchers built, nothing to install): the floor
Launchers built = launcher modules (`*.so`) that appeared in the run's Triton cache minus those the start installed
(the engine's `kernels.launchers_installed`). --drop-caches empties the page cache before each run (as root: writes
/proc/sys/vm/drop_caches; otherwise it evicts the FTW's own files with posix_fadvise(DONTNEED), which any reader may
do for clean pages), so ready includes reading the weights from disk. Then the disk bound is reported beside ready:
the bytes the serve process and its read-ahead child had read from storage when it became ready (`read_bytes` of
/proc/PID/io) over the cold read bandwidth measured on the FTW's largest file, evicted first.
Writes OUT/coldstart.json (every run: seconds to ready, to the first token, of the repeated request, the engine's
"kernels" stats, its start-up phases and the page-locking's) and prints a table. Needs a CUDA GPU (or --device cpu);
the port is free on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_compile_lib import drop_cache, read_speed

FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]
PROMPT_TOKENS = 16  # prompt token ids of the timed requests
TIMELINE_S = 0.25  # the read timeline's step until ready
SPY_RATE = 100  # py-spy samples a second


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


def _launchers(cache: Path | None) -> set[str]:
    """The launcher modules in a Triton cache directory (relative paths)."""
    if cache is None or not cache.is_dir():
        return set()
    return {str(p.relative_to(cache)) for p in cache.rglob("*.so")}


def _engine_stats(base: str) -> dict:
    """From /v1/stats (its snapshot follows the engine loop: polled briefly): the engine's kernels stats, its
    start-up phases and the background page-locking's ({} where absent)."""
    for _ in range(50):
        body = _get(f"{base}/v1/stats")[1]
        engine = body.get("engine") or {}
        if engine.get("kernels") or engine.get("startup"):  # a CPU engine has no kernels
            return {"kernels": engine.get("kernels"), "startup": engine.get("startup"),
                    "pin": (body.get("moe") or {}).get("pin")}  # the expert cache's stats sit beside "engine"
        time.sleep(0.1)
    return {}


def _from_log(log_path: Path) -> dict:
    """What the serve log says about kernels (the fallback where /v1/stats had none): the start line, the compiles
    logged one by one once prebuilt kernels were installed, the count logged at shutdown."""
    text = log_path.read_text(errors="replace")
    start = re.search(r"kernels: (?!compiled |\d+ compiled since start).*", text)  # use_prebuilt's one line
    out: dict = {"start": start.group(0) if start else None,
                 "compiled": re.findall(r"kernels: compiled (\S+) \(not prebuilt\)", text)}
    m = re.search(r"kernels: (\d+) compiled since start", text)
    out["compiled_since_start"] = int(m.group(1)) if m else None
    return out


def _read_bytes(pid: int) -> int | None:
    """Bytes process `pid` and its live children (the read-ahead runs in one: `formats/prefetch.py`) have caused to
    be read from storage (page faults on their mmaps included; a reaped child's count is in its parent's), or None."""
    total = None
    for p in [pid, *_children(pid)]:
        try:
            m = re.search(r"^read_bytes: (\d+)", Path(f"/proc/{p}/io").read_text(), re.M)
        except OSError:
            continue
        if m:
            total = (total or 0) + int(m.group(1))
    return total


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return []


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _child(parent: subprocess.Popen, deadline_s: float) -> int:
    """The pid of py-spy's child process (the server), once it exists."""
    end = time.perf_counter() + deadline_s
    while time.perf_counter() < end and parent.poll() is None:
        kids = _children(parent.pid)
        if kids:
            return kids[0]
        time.sleep(0.01)
    raise RuntimeError(f"py-spy did not start the server (exit {parent.poll()})")


def serve_once(ftw: Path | str, serve_args: list[str], env: dict, log_path: Path, deadline_s: float,
               py_spy: str | None = None, wait_list: bool = False) -> dict:
    """One `ft serve --ftw FTW *serve_args` process (an FTW directory or a Hub repo id): seconds to ready, to the
    first token of a PROMPT_TOKENS-token completion and of a second one on other tokens (the same work without
    first-use costs; other tokens, so that the prefix cache cannot serve it), the engine's kernel stats, the host
    launchers built in the process (from its TRITON_CACHE_DIR), and the bytes it had read from storage every
    TIMELINE_S (`read_timeline`: [seconds, bytes]). `py_spy`: a py-spy binary that samples every thread of the
    process from launch to exit into a chrome trace beside the log (stacks with timestamps: `tools/spy_phases.py`
    cuts it into phases). `wait_list`: keep the server up until it has recorded its start-up file list (it does so
    once idle)."""
    cache = Path(env["TRITON_CACHE_DIR"]) if env.get("TRITON_CACHE_DIR") else None
    before = _launchers(cache)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [*FT, "serve", "--ftw", str(ftw), *serve_args, "--port", str(port)]
    if py_spy:  # py-spy starts the server as its child, so that it samples from the first line on
        cmd = [py_spy, "record", "--rate", str(SPY_RATE), "--idle", "--threads", "--nonblocking", "--format",
               "chrometrace", "--output", str(log_path.with_suffix(".trace.json")), "--", *cmd]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:  # proc: the server, or py-spy, which lives as long as the server does
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    pid = _child(proc, deadline_s) if py_spy else proc.pid
    timeline: list[list[float]] = []
    try:
        while _get(f"{base}/health")[0] != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > deadline_s:
                raise RuntimeError(f"ft serve did not become ready (exit {proc.poll()}); see {log_path}")
            now = time.perf_counter() - t0
            if not timeline or now - timeline[-1][0] >= TIMELINE_S:
                timeline.append([round(now, 2), _read_bytes(pid)])
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        read_at_ready = _read_bytes(pid)
        for i, start in enumerate((1000, 2000)):  # then the same work again, on other tokens: no prefix reuse
            body = json.dumps({"prompt": list(range(start, start + PROMPT_TOKENS)), "max_tokens": 1,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=deadline_s) as r:
                r.read()
            if i == 0:
                first = time.perf_counter() - t0
        repeat = time.perf_counter() - t0 - first
        stats = _engine_stats(base)
        if wait_list:
            from ft.formats import startup_files

            while not startup_files.load() and time.perf_counter() - t0 < deadline_s:
                time.sleep(0.2)
    finally:
        _signal(pid, signal.SIGTERM)  # py-spy writes its profile once the server is gone
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            _signal(pid, signal.SIGKILL)
            proc.kill()
    new = _launchers(cache) - before
    kernels = stats.get("kernels")
    installed = (kernels or {}).get("launchers_installed") or 0
    return {"ready_s": round(ready, 3), "read_bytes_at_ready": read_at_ready, "first_token_s": round(first, 3),
            "first_request_s": round(first - ready, 3), "repeat_request_s": round(repeat, 3),
            "launchers_built": max(0, len(new) - installed), "launcher_files_new": len(new),
            "kernels": kernels, "startup": stats.get("startup"), "pin": stats.get("pin"), "log": _from_log(log_path),
            "read_timeline": timeline}


def ftw_files(ftw: Path) -> list[Path]:
    return sorted(p for p in ftw.rglob("*") if p.is_file() and not p.is_symlink())


def cold_read_gbs(ftw: Path, limit: int = 4 << 30) -> float:
    """Sequential read speed of the FTW's largest file (up to `limit` bytes) with its pages dropped first: the disk's
    cold bandwidth as the runtime sees it (through the page cache)."""
    path = max(ftw_files(ftw), key=lambda p: p.stat().st_size)
    bps, _ = read_speed([path], 0, min(limit, path.stat().st_size) // 4096 * 4096, "buffered")
    return bps / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ftw", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--build", action="store_true", help="ft kernels build for this GPU first")
    ap.add_argument("--runs", type=int, default=1, help="repetitions of each run")
    ap.add_argument("--deadline", type=float, default=1800.0, help="seconds before a run is given up")
    ap.add_argument("--drop-caches", action="store_true", help="empty the FTW's page cache before each run")
    ap.add_argument("--modes", default="jit,prebuilt,warm",
                    help="the runs, in order: jit (nothing trusted), prebuilt (an empty Triton cache, the FTW's "
                         "kernels installed), warm (the Triton cache the prebuilt run left)")
    ap.add_argument("--py-spy", default=None, help="a py-spy binary: profile each run's every thread (a chrome "
                    "trace beside its log; `tools/spy_phases.py` cuts it into phases)")
    ap.add_argument("--startup-list", choices=("on", "off"), default="on",
                    help="on: the runs start with a start-up file list (`ft.formats.startup_files`), recorded by one "
                         "untimed start first where this interpreter has none, as on a machine that served before; "
                         "off: the list is deleted before each run")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu: `ft serve --device cpu` (one run per repetition, "
                    "mode cpu; no kernels, no VRAM budget)")
    args = ap.parse_args()
    cuda = args.device != "cpu"
    modes = args.modes.split(",") if cuda else ["cpu"]
    warm_first = "warm" in modes and "prebuilt" not in modes[:modes.index("warm")]
    if not cuda and args.build:
        raise SystemExit("--build builds GPU kernels: not with --device cpu")
    if cuda and (not set(modes) <= {"jit", "prebuilt", "warm"} or warm_first):
        raise SystemExit(f"--modes {args.modes!r}: jit, prebuilt and warm, warm after prebuilt")
    import torch

    from ft.formats import startup_files

    arch = None
    if cuda:
        major, minor = torch.cuda.get_device_capability()
        arch = 10 * major + minor
    serve_args = ["--vram-budget", args.vram_budget] if cuda else ["--device", "cpu"]
    args.out.mkdir(parents=True, exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "ftw": str(args.ftw),
              "gpu": torch.cuda.get_device_name() if cuda else None, "arch": arch,
              "vram_budget": args.vram_budget if cuda else None,
              "page_cache": "dropped before each run" if args.drop_caches else "as found", "runs": []}
    if args.build:
        t = time.perf_counter()
        res = subprocess.run([*FT, "kernels", "build", "--ftw", str(args.ftw), "--arch", str(arch)], env=base_env,
                             capture_output=True, text=True)
        (args.out / "build.log").write_text(res.stdout + res.stderr)
        if res.returncode:
            raise SystemExit(f"ft kernels build failed (exit {res.returncode}); see {args.out / 'build.log'}")
        result["build_s"] = round(time.perf_counter() - t, 1)
        result["build"] = [line for line in res.stdout.splitlines() if line.startswith("sm_")]
        result["build_warnings"] = [line for line in res.stderr.splitlines() if "warning" in line][:40]
        print(f"build {result['build_s']} s: {'; '.join(result['build'])}", flush=True)
    if args.drop_caches:
        result["cold_read_gbs"] = round(cold_read_gbs(args.ftw), 3)
        print(f"cold read {result['cold_read_gbs']} GB/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="ft-coldstart-") as tmp:
        if args.startup_list == "on" and not startup_files.load():
            serve_once(args.ftw, serve_args, {**base_env, "TRITON_CACHE_DIR": str(Path(tmp) / "record")},
                       args.out / "serve-record.log", args.deadline, wait_list=True)
            result["startup_list_recorded_first"] = True
        for i in range(args.runs):
            for mode in modes:
                cache = Path(tmp) / f"cache-{i}-{'prebuilt' if mode == 'warm' else mode}"
                if mode != "warm":
                    shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir()
                env = {**base_env, "TRITON_CACHE_DIR": str(cache)}
                if mode == "jit":
                    env["FT_HOME"] = str(Path(tmp) / "no-trust")  # nothing trusted: every kernel compiles
                if args.startup_list == "off":
                    startup_files.list_path().unlink(missing_ok=True)
                listed = startup_files.load()
                if args.drop_caches:
                    result["page_cache"] = f"dropped before each run ({drop_cache(ftw_files(args.ftw))})"
                run = serve_once(args.ftw, serve_args, env,
                                 args.out / f"serve-{mode}-{i}.log", args.deadline, args.py_spy)
                run.update(mode=mode, rep=i, startup_list_bytes=sum(n for _, _, n in listed))
                if args.drop_caches and run["read_bytes_at_ready"] is not None:  # ready against the disk bound
                    run["disk_bound_s"] = round(run["read_bytes_at_ready"] / 1e9 / result["cold_read_gbs"], 3)
                result["runs"].append(run)
                k = run["kernels"] or {}
                compiled = k.get("compiled_since_start", run["log"]["compiled_since_start"])
                print(f"{mode:9s} ready {run['ready_s']:7.2f} s  first token {run['first_token_s']:7.2f} s  "
                      f"(request {run['first_request_s']:.2f} s, repeated {run['repeat_request_s']:.2f} s)  "
                      f"prebuilt {k.get('prebuilt')} ({k.get('installed')} kernels, {k.get('launchers_installed')} "
                      f"launchers)  compiled {compiled}  launchers built {run['launchers_built']}"
                      + (f"  disk bound {run['disk_bound_s']:.2f} s" if "disk_bound_s" in run else ""), flush=True)
                print(f"          start-up {run['startup']}, page-locking {run['pin']}", flush=True)
                if k.get("compiled"):
                    print(f"          compiled: {', '.join(k['compiled'])}", flush=True)
                (args.out / "coldstart.json").write_text(json.dumps(result, indent=2) + "\n")  # each run kept
    (args.out / "coldstart.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'coldstart.json'}")


if __name__ == "__main__":
    main()
