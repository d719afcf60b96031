"""GPU benchmark of the expert cache / hybrid offload runtime, in one run on a CUDA machine.

    python tools/gpu_bench.py --out results/ [--stages env,tests,bw,kernel,e2e] [--layers 8] [--tokens 64]

Stages:
  env     versions, GPU, CPU flags, disk
  tests   the GPU-runtime test files (the real kernels run on the GPU)
  bw      `ft bench bw` measurements (PCIe, host memory, CPU expert kernel, both at once)
  kernel  NVFP4 MoE kernel check + GB/s, decode and prefill shapes of Qwen3.6-35B-A3B
  e2e     synthetic Qwen3.6-35B-A3B-shaped NVFP4 checkpoint with --layers layers (uniform and skewed routing):
          GPU vs CPU logits, offloaded vs resident greedy tokens, decode tok/s at VRAM budgets 8/12/24 GiB scaled to
          the layer count, fully resident, llama.cpp-style static placement, each against the Belady bound; prefill
          tok/s against the PCIe roofline.
Everything lands in <out>/gpu_bench.json (and a log); the last lines printed are a summary table.
"""

from __future__ import annotations

import argparse
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


def stage_tests(out: Path) -> dict:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/gpu"],
                         capture_output=True, text=True)
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
    from ft.runtime.gpu.kernel_bench import bench_kernel

    return bench_kernel()


def stage_e2e(args, prof: dict, out: dict, flush, deadline: float) -> dict:
    import gpu_bench_e2e as e2e

    from ft.formats import FtwReader
    from ft.runtime.gpu.offload_config import OffloadConfig
    from ft.runtime.model import load_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    b_p, b_c = prof["b_pcie"], prof["b_cpu"]
    h2d_link = prof["gbs"]["h2d_pinned"] * 1e9
    out.update({"layers": args.layers, "full_layers": 40, "b_pcie_gbs": b_p / 1e9, "b_cpu_gbs": b_c / 1e9,
                "routings": {}})
    build_s = 0.0
    for routing in args.routings.split(","):
        t_build = time.perf_counter()
        built = (Path(args.work) / f"q36-{args.layers}L-{routing}.ftw").is_dir()
        if time.time() + (0 if built else build_s) + 45 > deadline:  # 45 s: resident + the 8 GiB runs
            out.setdefault("skipped", []).append(f"{routing}: not enough time left")
            log(f"skipping {routing}: not enough time left")
            continue
        ftw = e2e.build_checkpoint(work, args.layers, routing, log)
        build_s = max(build_s, time.perf_counter() - t_build)
        reader = FtwReader(ftw)
        cfg = reader.config
        E, moe_layers = cfg.num_experts, sum(t == "moe" for t in cfg.mlp_types)
        model = load_model(reader, device=args.device, experts=lambda *a: None)
        r: dict = {"ftw": ftw.name,
                   "dense_allocated_gib": torch.cuda.memory_allocated() / GIB if args.device == "cuda" else None}
        out["routings"][routing] = r
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist()
        common = dict(prefill_slots=args.prefill_slots, prefetch=not args.no_prefetch)
        if args.no_pin:
            common["pin_host_bytes"] = 0
        run = lambda opts: e2e.run_decode(model, reader, opts, prompt, warmup=args.warmup,  # noqa: E731
                                          tokens=args.tokens, profile=prof)
        # Steady state: every record's checksum verified once (the reader checks lazily on first touch, which would
        # otherwise land inside the timed window), and one throw-away run absorbs one-time costs (JIT, allocator).
        t_verify = time.perf_counter()
        for i, kind in enumerate(cfg.mlp_types):
            if kind == "moe":
                bank = reader.bank(f"layers.{i}.mlp.experts")
                for e in range(bank.num_experts):
                    bank.record(e)
        r["verify_records_s"] = time.perf_counter() - t_verify
        run(OffloadConfig(mode="resident", **common))
        resident = run(OffloadConfig(mode="resident", **common))
        for k in ("_trace", "_trace_start", "_steps"):
            resident.pop(k, None)
        from ft.runtime.gpu.hybrid import GpuExperts
        from ft.runtime.gpu.record_layout import RecordLayout

        first_moe = cfg.mlp_types.index("moe")
        layout = RecordLayout.from_bank(reader.bank(f"layers.{first_moe}.mlp.experts"), cfg.hidden_size,
                                        cfg.moe_intermediate_size)
        payload, stride = layout.payload_bytes, layout.stride
        if routing == args.routings.split(",")[0] and not args.no_logits:
            ex = GpuExperts(reader, OffloadConfig(mode="resident", prefetch=False), device=args.device)
            e2e.attach(model, ex)
            r["logits_vs_cpu"] = e2e.check_logits(ftw, model, prompt[:16])
            log(f"logits vs CPU: {r['logits_vs_cpu']}")
            ex.close()
            del ex
            empty_cache()
        r["resident"] = resident
        res_ms = resident["ms_per_token"]
        log(f"{routing} resident: {resident['tok_s']:.1f} tok/s")
        runs = r["decode"] = {}
        flush()
        for gib in args.budgets:
            sc = e2e.scaled_slots(int(gib * GIB), reader, full_layers=40, kv_tokens=args.kv_tokens,
                                  reserve=GIB // 2, prefill_slots=args.prefill_slots)
            for mode in args.modes.split(","):
                key = f"{mode}@{gib}GiB"
                if time.time() + 15 > deadline:
                    continue
                pin = {"pin_host_bytes": 0} if mode.endswith("-staged") else {}  # A/B: no page-locked banks
                res = run(OffloadConfig(mode=mode.removesuffix("-staged"), num_slots=sc["num_slots"], **pin,
                                        **common))
                res["budget"] = sc
                res["bound"] = e2e.bound(res, resident_ms=res_ms, num_experts=E, payload=payload, b_pcie=b_p,
                                         b_cpu=b_c)
                runs[key] = res
                flush()
                log(f"{routing} {key}: {res['tok_s']:.1f} tok/s, hit {res['stats']['hit_rate']:.2f}, "
                    f"bound {res['bound'].get('bound_tok_s', 0):.1f} tok/s")
            n_gpu = min(moe_layers, sc["num_slots"] // E)
            if n_gpu < moe_layers and time.time() + 15 < deadline:
                cpu_layers = tuple(i for i, t in enumerate(cfg.mlp_types) if t == "moe")[: moe_layers - n_gpu]
                res = run(OffloadConfig(mode="static", cpu_layers=cpu_layers, **common))
                res.pop("_trace"), res.pop("_trace_start"), res.pop("_steps")
                res["budget"] = sc
                runs[f"static@{gib}GiB"] = res
                flush()
                log(f"{routing} static@{gib}GiB ({len(cpu_layers)} CPU layers): {res['tok_s']:.1f} tok/s")
        ref_tokens = resident["tokens"]
        for res in (resident, *runs.values()):
            res["greedy_equal_to_resident"] = sum(a == b for a, b in zip(res["tokens"], ref_tokens))
            res["greedy_len"] = len(res["tokens"])
            res.pop("tokens")
        if routing == args.routings.split(",")[0] and args.device == "cuda" and time.time() + 40 < deadline:
            r["engine"] = e2e.engine_run(ftw, reader, budget_gib=args.budgets[0], log=log)
            flush()
        if time.time() + 30 < deadline:
            r["prefill"] = e2e.prefill_runs(model, reader, args, prompt_len=args.prefill_tokens, prof=prof,
                                        h2d_link=h2d_link, stride=stride, deadline=deadline)
        flush()
        del model
        empty_cache()
    return out


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="env,tests,bw,kernel,e2e")
    ap.add_argument("--work", default=".bench", help="where checkpoints are built (ignored by git)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--routings", default="uniform,skewed")
    ap.add_argument("--budgets", type=float, nargs="+", default=[8, 12, 24])
    ap.add_argument("--modes", default="hybrid,offload")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--prefill-slots", type=int, default=32)
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--bw-seconds", type=float, default=2.0)
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--no-pin", action="store_true", help="never page-lock expert banks (staged fetches only)")
    ap.add_argument("--no-logits", action="store_true", help="skip the GPU-vs-CPU logits check")
    ap.add_argument("--device", default="cuda", help="cpu = dry run of the e2e glue on the CPU emulation path")
    ap.add_argument("--profile", default="", help="bandwidth profile JSON to use instead of the bw stage's")
    ap.add_argument("--deadline-s", type=float, default=480, help="stop starting new work after this many seconds")
    ap.add_argument("--bg-ckpt", default="", help="routings (comma-separated) whose checkpoints are built in the background from the start")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    path = out / "gpu_bench.json"
    prof = None
    deadline = time.time() + args.deadline_s
    flush = lambda: path.write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    bg = []  # one background build per routing: CPU/disk-bound, overlaps the GPU-only stages; joined before
    for routing in filter(None, args.bg_ckpt.split(",")):  # anything is timed on the CPU
        d = Path(args.work) / f"ckpt-{routing}"
        d.mkdir(parents=True, exist_ok=True)
        bg.append(subprocess.Popen([sys.executable, __file__, "--out", str(d), "--stages", "ckpt", "--layers",
                                    str(args.layers), "--routings", routing, "--work", args.work],
                                   stdout=open(d / "ckpt.log", "w"), stderr=subprocess.STDOUT))
    for stage in args.stages.split(","):
        if bg and stage in ("bw", "kernel", "e2e", "pin"):
            results["bg_ckpt_returncode"] = [p.wait() for p in bg]
            bg = []
            for routing in filter(None, args.bg_ckpt.split(",")):
                f = Path(args.work) / f"ckpt-{routing}" / "gpu_bench.json"
                results.setdefault("bg_ckpt", {})[routing] = json.loads(f.read_text()).get("ckpt") if f.exists() else None
        t = time.perf_counter()
        log(f"stage {stage}")
        try:
            if stage == "env":
                results["env"] = stage_env()
            elif stage == "tests":
                results["tests"] = stage_tests(out)
            elif stage == "bw":
                prof = results["bw"] = stage_bw(args.bw_seconds, timeout=150)
            elif stage == "pin":  # can this VM page-lock FTW file pages? (isolated: a hang cannot stop the run)
                import gpu_bench_e2e as e2e

                results["pin"] = e2e.pin_probe(Path(args.work), args.layers, args.routings.split(",")[0])
                args.no_pin = args.no_pin or not results["pin"].get("ok")
                log(f"pin probe: {results['pin']}")
            elif stage == "kernel":
                results["kernel"] = stage_kernel()
            elif stage == "ckpt":  # only build (and time) the checkpoints
                import gpu_bench_e2e as e2e

                results["ckpt"] = {}
                for routing in args.routings.split(","):
                    t0 = time.perf_counter()
                    ftw = e2e.build_checkpoint(Path(args.work), args.layers, routing, log)
                    size = sum(f.stat().st_size for f in ftw.rglob("*") if f.is_file())
                    results["ckpt"][routing] = {"seconds": time.perf_counter() - t0, "ftw_gb": size / 1e9}
            elif stage == "e2e":
                from ft.runtime.gpu.benchbw import load_profile

                results["e2e"] = {}
                if args.profile:
                    prof = json.loads(Path(args.profile).read_text())
                prof = prof or load_profile()
                if prof is None:  # the bw stage failed: fall back to the last recorded profile of this machine
                    prof = json.loads((Path(__file__).parent.parent / "benchmarks" / "gpu.profile.json").read_text())
                    results["profile_fallback"] = "benchmarks/gpu.profile.json"
                stage_e2e(args, prof, results["e2e"], flush, deadline)
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
