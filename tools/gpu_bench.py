"""GPU benchmark of the expert cache / hybrid offload runtime, in one run on a CUDA machine.

    python tools/gpu_bench.py --out results/ [--stages env,tests,bw,kernel,e2e] [--layers 8] [--tokens 64]
    bash tools/gpu_run.sh --out $OUT --plan full      # the whole matrix of the GPU issue, one command

Stages:
  env     versions, GPU, CPU flags, disk
  tests   the GPU-runtime test files (the real kernels run on the GPU)
  bw      `ft bench bw` measurements (PCIe, host memory, CPU expert kernel, both at once)
  kernel  NVFP4 MoE kernel check + GB/s, decode and prefill shapes of Qwen3.6-35B-A3B
  e2e     synthetic Qwen3.6-35B-A3B-shaped NVFP4 checkpoint with --layers layers (uniform and skewed routing):
          GPU vs CPU logits, offloaded vs resident greedy tokens, decode tok/s at VRAM budgets 8/12/24 GiB scaled to
          the layer count, fully resident, llama.cpp-style static placement, each against the Belady bound; prefill
          tok/s at --prefill-lengths (chunked like the engine) against the PCIe roofline; the engine path with its
          per-step split (forward / sample / accept / schedule).
  profile torch.profiler over --profile-tokens decode tokens: resident and offloaded direct loops, the engine at the
          first budget and resident (tools/gpu_bench_profile.py): top-30 op tables, per-tag times, syncs per token.
  pin     can this VM page-lock FTW file pages (child process with a timeout)
Time plan: each stage (e2e: each routing, profile: each path) runs only if its estimate fits before --deadline-s;
the estimates and what was skipped, and why, are in the results (tools/gpu_bench_plan.py).
Everything lands in <out>/gpu_bench.json (and a log); the last lines printed are a summary table.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 1 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage_env() -> dict:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"failed: {e}"

    import triton

    flags = sh("grep -m1 -o 'avx512[a-z_0-9]*\\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\\n' ' '")
    return {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0), "nvidia_smi": sh("nvidia-smi -L"),
            "cpu": sh("lscpu | grep 'Model name' | head -1"), "cpu_count": sh("nproc"), "cpu_flags": flags,
            "mem": sh("free -g | head -2"), "disk": sh("df -h . | tail -1"), "gcc": sh("gcc --version | head -1"),
            "platform": platform.platform()}


def stage_tests(out: Path, timeout: float) -> dict:
    t = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/gpu"],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hung test must not take the whole run
        from gpu_bench_parts import text_of

        text = text_of(e.stdout) + text_of(e.stderr)
        (out / "tests.log").write_text(f"{text}\ntimed out after {timeout:.0f} s")
        return {"returncode": None, "summary": f"timed out after {timeout:.0f} s", "seconds": timeout}
    (out / "tests.log").write_text(res.stdout + res.stderr)
    return {"returncode": res.returncode, "summary": (res.stdout.strip().splitlines() or [""])[-1],
            "seconds": time.perf_counter() - t}


def stage_bw(seconds: float, timeout: float) -> dict:
    """`ft bench bw --json` in a child process (a wedged driver call cannot take the whole run with it)."""
    cmd = [sys.executable, "-c", "from ft.cli.main import main; main()", "bench", "bw", "--json",
           "--seconds", str(seconds)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"ft bench bw failed ({res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout)


def stage_kernel() -> list[dict]:
    from kernel_bench import bench_kernel

    return bench_kernel()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    from gpu_bench_plan import PLANS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", default="", help=f"named defaults ({', '.join(PLANS)}); explicit flags still win")
    ap.add_argument("--stages", default="env,tests,bw,kernel,e2e")
    ap.add_argument("--work", default=".bench", help="where checkpoints are built (ignored by git)")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b", help="qwen3_5_moe synth preset (demo: CPU dry runs)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--routings", default="uniform,skewed")
    ap.add_argument("--budgets", type=float, nargs="+", default=[8, 12, 24])
    ap.add_argument("--modes", default="hybrid,offload")
    ap.add_argument("--tokens", type=int, default=64, help="timed decode tokens per placement")
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before the timed decode")
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[2048, 16384, 32768])
    ap.add_argument("--prefill-budgets", type=float, nargs="+", default=None,
                    help="budgets of the streamed prefill runs (default: the first of --budgets)")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill forward (engine default)")
    ap.add_argument("--prefill-slots", type=int, default=32)
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--bw-seconds", type=float, default=2.0)
    ap.add_argument("--profile-tokens", type=int, default=16)
    ap.add_argument("--profile-trace", action="store_true", help="also write gzipped Chrome traces (2 files)")
    ap.add_argument("--dense", choices=("dequantized", "quantized"), default="dequantized",
                    help="quantized dense linears on the GPU dequantized to bf16 (the engine's default) or as stored "
                         "(OffloadConfig(dense='quantized')); one model serves every placement of the direct runs")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--no-pin", action="store_true", help="never page-lock expert banks (staged fetches only)")
    ap.add_argument("--no-logits", action="store_true", help="skip the GPU-vs-CPU logits check")
    ap.add_argument("--device", default="cuda", help="cpu = dry run of the e2e glue on the CPU emulation path")
    ap.add_argument("--profile", default="", help="bandwidth profile JSON to use instead of the bw stage's")
    ap.add_argument("--deadline-s", type=float, default=480, help="start no work that would end after this")
    ap.add_argument("--bg-ckpt", default="",
                    help="routings (comma-separated) whose checkpoints are built in the background from the start")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    from gpu_bench_plan import apply_plan

    args = apply_plan(build_parser(), argv)
    if args.prefill_budgets is None:
        args.prefill_budgets = args.budgets[:1]
    return args


def bandwidth_profile(args, prof: dict | None, results: dict) -> dict:
    """The bw stage's profile, else --profile, else the saved one of this GPU, else benchmarks/gpu.profile.json."""
    from ft.runtime.gpu.benchbw import load_profile

    if prof is None and args.profile:
        prof = json.loads(Path(args.profile).read_text())
    prof = prof or (load_profile() if args.device == "cuda" else None)
    if prof is None:
        prof = json.loads((Path(__file__).parent.parent / "benchmarks" / "gpu.profile.json").read_text())
        results["profile_fallback"] = "benchmarks/gpu.profile.json"
    return prof


def main(argv: list[str] | None = None) -> None:
    import gpu_bench_parts as parts
    from gpu_bench_plan import TimePlan, estimate

    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                     "args": vars(args)}
    path = out / "gpu_bench.json"
    # a run still going 25 s past its deadline is hung: write every thread's stack where the results go
    stacks = open(out / "stacks.txt", "w")  # noqa: SIM115 - open for the life of the process
    faulthandler.dump_traceback_later(args.deadline_s + 25, repeat=True, file=stacks)
    prof = None
    plan = TimePlan(time.time() + args.deadline_s)
    results["time_plan"] = {"estimates": plan.estimates, "skipped": plan.skipped}
    flush = lambda: path.write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    bg = []  # one background build per routing: CPU/disk-bound, overlaps the GPU-only stages; joined before
    for routing in filter(None, args.bg_ckpt.split(",")):  # anything is timed on the CPU
        d = Path(args.work) / f"ckpt-{routing}"
        d.mkdir(parents=True, exist_ok=True)
        bg.append(subprocess.Popen([sys.executable, __file__, "--out", str(d), "--stages", "ckpt", "--layers",
                                    str(args.layers), "--routings", routing, "--work", args.work,
                                    "--preset", args.preset],
                                   stdout=open(d / "ckpt.log", "w"), stderr=subprocess.STDOUT))
    stages = args.stages.split(",")
    for stage in stages:
        if bg and stage in ("bw", "kernel", "e2e", "pin", "profile"):
            results["bg_ckpt_returncode"] = [p.wait() for p in bg]
            bg = []
            for routing in filter(None, args.bg_ckpt.split(",")):
                f = Path(args.work) / f"ckpt-{routing}" / "gpu_bench.json"
                results.setdefault("bg_ckpt", {})[routing] = json.loads(f.read_text()).get("ckpt") \
                    if f.exists() else None
        built = frozenset(r for r in args.routings.split(",")
                          if parts.ftw_path(Path(args.work), args.layers, r, args.preset).is_dir())
        est = estimate(stage, args, built) if stage != "ckpt" else 0.0
        log(f"stage {stage}: estimated {est:.0f} s, {plan.left():.0f} s left")
        # e2e and profile are admitted piece by piece inside (a partial result beats none)
        if stage not in ("e2e", "profile", "ckpt") and not plan.admit(stage, est):
            log(f"skipping {stage}: {plan.skipped[stage]}")
            flush()
            continue
        t = time.perf_counter()
        try:
            if stage == "env":
                results["env"] = stage_env()
            elif stage == "tests":
                later = 300 if stage != stages[-1] else 10  # time the stages after it need
                results["tests"] = stage_tests(out, timeout=max(30.0, min(180.0, plan.left() - later)))
            elif stage == "bw":
                prof = results["bw"] = stage_bw(args.bw_seconds, timeout=max(30.0, min(150.0, plan.left())))
            elif stage == "pin":  # can this VM page-lock FTW file pages? (isolated: a hang cannot stop the run)
                results["pin"] = parts.pin_probe(parts.ftw_path(Path(args.work), args.layers,
                                                                args.routings.split(",")[0], args.preset))
                pinned = results["pin"].get("ok") or results["pin"].get("partial", {}).get("registered_True")
                args.no_pin = args.no_pin or not pinned
                log(f"pin probe: {results['pin']}")
            elif stage == "kernel":
                results["kernel"] = stage_kernel()
            elif stage == "ckpt":  # only build (and time) the checkpoints
                results["ckpt"] = {}
                for routing in args.routings.split(","):
                    t0 = time.perf_counter()
                    ftw = parts.build_checkpoint(Path(args.work), args.layers, routing, log, preset=args.preset)
                    size = sum(f.stat().st_size for f in ftw.rglob("*") if f.is_file())
                    results["ckpt"][routing] = {"seconds": time.perf_counter() - t0, "ftw_gb": size / 1e9}
            elif stage == "profile":
                from gpu_bench_profile import stage_profile

                results["profile"] = {}
                stage_profile(args, bandwidth_profile(args, prof, results), out, results["profile"], plan, log)
            elif stage == "e2e":
                from gpu_bench_e2e import stage_e2e

                results["e2e"] = {}
                stage_e2e(args, bandwidth_profile(args, prof, results), results["e2e"], flush, plan, log)
            else:
                raise SystemExit(f"unknown stage {stage!r}")
        except Exception as e:  # keep what the other stages measured
            import traceback

            results.setdefault("errors", {})[stage] = traceback.format_exc()
            log(f"stage {stage} FAILED: {e!r}")
        results.setdefault("stage_seconds", {})[stage] = time.perf_counter() - t
        flush()
    import gpu_bench_report

    gpu_bench_report.print_summary(results)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv"])


if __name__ == "__main__":
    main()
