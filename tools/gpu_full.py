"""Full-model GPU benchmark: the whole 40-layer models, resident, as a user runs them, against llama.cpp and the HBM
bound. One command on the GPU machine (tools/gpu_run.sh runs it there):

    python tools/gpu_full.py --out DIR [--models qwen3moe-35b-geom,qwen3.6-35b-a3b,gpt-oss-20b,glm-4.5-air]
                             [--routing uniform]
                             [--stages tests,models,kernels] [--deadline-s 560] [--quick] [--budgets 8,12]
                             [--synth-dir /dev/shm/ft] [--context 8192 --prefill-chunk 4096]

Stages (run in the order given):
  kernels  the kernel benchmarks (tools/bench_*.py): each kernel's us per call and GB/s or TFLOP/s vs the peak
  tests    the GPU-runtime tests (tests/runtime/gpu: the real kernels on the GPU)
  models   per model: synth (NVFP4, full size; gpt-oss-20b: MXFP4 experts as released) -> ft checkpoint -> load
           resident (CUDA graphs for batch 1..8) -> decode batch 1 at a short and an 8k context, batch 4 and 8
           aggregate, prefill of 512 / 4k / 16k tokens (4k chunks); graphed vs eager greedy tokens, fused kernels
           vs the PyTorch reference ops (max |dlogit|, also with the reference's routing forced on the fused path);
           where an engine step's time goes; with --budgets, the default scheduler at each VRAM budget (decode,
           prefill 4k, peak device memory, `ft plan`'s prediction for the row; a `ft bench bw` profile is measured
           first where the host has none)
Each decode row carries its bound: bytes read per token (dense weights, routed experts' records, KV or DeltaNet state)
over the HBM read rate measured in the same run, and the ratio to llama.cpp's number for the same placement
(qwen3moe-35b-geom only: same geometry as llama.cpp's table).
Results: DIR/gpu_full.json (the kernel benchmarks' JSON folded in) and DIR/logs.txt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from bench_record import host_cpu
from gpu_full_after import AFTER, run_after
from gpu_timing import hbm_read_gbs

GIB = 1 << 30
ARCH = {"qwen3moe-35b-geom": "qwen3_moe", "qwen3.6-35b-a3b": "qwen3_5_moe", "gpt-oss-20b": "gpt_oss",
        "glm-4.5-air": "glm4_moe"}  # glm-4.5-air: ~62 GB synthesized + ~62 GB compiled: --synth-dir /dev/shm/ft
# the experts' format of each synthetic checkpoint: NVFP4 (ModelOpt), or the release's MXFP4 for gpt-oss
QUANT = {"gpt_oss": "mxfp4"}
ROUTING_ONLY = {"gpt_oss": "uniform"}  # fused 3-D experts on disk: `ft synth` cannot skew their routing


def routing_of(preset: str, routing: str) -> str:
    """The routing `preset` is synthesized with when --routing asks for `routing`."""
    return ROUTING_ONLY.get(ARCH[preset], routing)
# llama.cpp on the same H200, same geometry (qwen3moe, Q4_0 experts), all experts on the GPU:
# tg128, pp512, pp4096 (-ub 4096); the project's peer reference, table "llama.cpp on our GPU test machine"
LLAMA_CPP = {"decode_b1": 360.0, "prefill_512": 7443.0, "prefill_4096": 11924.0,
             "decode_8gib": 84.5, "decode_12gib": 123.0}  # -ncmoe 24 / 14: the experts that fit 8 / 12 GiB
KERNEL_BENCHES = ("bench_attention", "bench_router", "bench_dense", "bench_moe_decode", "bench_fused_ops",
                  "bench_deltanet", "bench_moe_prefill")
T0 = time.perf_counter()
MODEL_MIN_S = 150  # a model starts only with this many seconds left before --deadline-s (synth + compile ~60-100 s)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def run_script(name: str, out: Path, timeout: float, quick: bool = False, tests: str = "tests/runtime/gpu") -> dict:
    """Run a kernel benchmark (its JSON lands in a scratch folder and is folded into the result) or pytest; the
    output goes to <out>/logs.txt (the results folder keeps few files)."""
    t = time.perf_counter()
    scratch = Path("/tmp/ft-bench")
    scratch.mkdir(exist_ok=True)
    cmd = [sys.executable, f"tools/{name}.py", "--out", str(scratch)] if name != "pytest" else \
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests.split(",")]
    if quick and name != "pytest" and "--quick" in Path(f"tools/{name}.py").read_text():
        cmd.append("--quick")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text, rc = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout:.0f} s", None
    text = text if isinstance(text, str) else text.decode(errors="replace")
    with open(out / "logs.txt", "a") as f:
        f.write(f"\n===== {name} (rc {rc}) =====\n{text}")
    tail = text.strip().splitlines()[-12:]
    log(f"{name}: rc {rc} in {time.perf_counter() - t:.0f} s\n    " + "\n    ".join(tail))
    row = {"returncode": rc, "seconds": time.perf_counter() - t, "tail": tail}
    result = scratch / f"{name}.json"
    if result.exists():
        row["result"] = json.loads(result.read_text())
    return row


def parse_variants(text: str) -> tuple[dict, ...]:
    """'a=1,b=False;c=2.0' -> ({"a": 1, "b": False}, {"c": 2.0}) (values as Python literals)."""
    import ast

    return tuple({k.strip(): ast.literal_eval(v.strip()) for k, v in (kv.split("=", 1) for kv in part.split(","))}
                 for part in text.split(";") if part.strip())


def ensure_bw_profile() -> dict:
    """This GPU's `ft bench bw` profile, measured now if there is none (a fresh GPU host has none): the engine's CPU
    lane starts from its rates and the rows' plan predictions use them."""
    from ft.runtime.gpu.benchbw import load_profile, run_bench, save_profile

    if load_profile(0) is not None:
        return {"measured": False}
    t = time.perf_counter()
    path = save_profile(run_bench(progress=log))
    log(f"`ft bench bw` profile measured in {time.perf_counter() - t:.0f} s: {path}")
    return {"measured": True, "seconds": time.perf_counter() - t, "profile": load_profile(0)}


def build(work: Path, preset: str, routing: str, synth_dir: Path | None = None) -> Path:
    """The FTW of `preset` in `work`, synthesized into `synth_dir` (default: `work`) and compiled; the synthesized
    checkpoint is deleted after (glm-4.5-air's ~62 GB twice do not fit one GPU host's disk: synthesize into
    /dev/shm)."""
    from ft.compiler import compile_checkpoint
    from ft.compiler.synth import synth

    routing = routing_of(preset, routing)
    ftw, hf = work / f"{preset}-{routing}.ftw", (synth_dir or work) / f"{preset}-{routing}-hf"
    if ftw.is_dir() and any(ftw.iterdir()):
        return ftw
    t = time.perf_counter()
    overrides = {"vision": dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                num_position_embeddings=16, patch_size=16)} if ARCH[preset] == "qwen3_5_moe" else None
    synth(ARCH[preset], preset, hf, quant=QUANT.get(ARCH[preset], "nvfp4"), routing=routing, force=True,
          overrides=overrides, twin=False)
    t_synth = time.perf_counter() - t
    compile_checkpoint(hf, ftw)
    log(f"{preset} {routing}: synth {t_synth:.0f} s, compile {time.perf_counter() - t - t_synth:.0f} s")
    shutil.rmtree(hf, ignore_errors=True)
    return ftw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ft-full"))
    ap.add_argument("--synth-dir", type=Path, default=None,
                    help="where synthesized checkpoints go before compiling (default: --work), e.g. /dev/shm/ft")
    ap.add_argument("--models", default="qwen3moe-35b-geom,qwen3.6-35b-a3b")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--stages", default="tests,models,kernels")
    ap.add_argument("--deadline-s", type=float, default=560.0)
    ap.add_argument("--kernel-timeout-s", type=float, default=90.0)
    ap.add_argument("--benches", default=",".join(KERNEL_BENCHES), help="kernel benchmarks of stage kernels")
    ap.add_argument("--tests", default="tests/runtime/gpu", help="comma-separated pytest paths of stage tests")
    ap.add_argument("--quick", action="store_true", help="kernel benchmarks without their config sweeps")
    ap.add_argument("--budgets", default="", help="comma-separated VRAM budgets in GiB to run each model at too")
    ap.add_argument("--skip-resident", action="store_true",
                    help="models: only the --budgets rows (peak memory is then the budget engine's alone)")
    ap.add_argument("--after", default="", help=f"models: after each model's rows, these tools on its FTW, in order "
                                                f"({', '.join(AFTER)}; tool@model: after that model only), each into "
                                                f"<out>/<tool>-<model>/")
    ap.add_argument("--keep-ftw", action="store_true",
                    help="keep each model's FTW in --work after its rows (a later call on the same warm machine "
                         "starts from it: put --work in a git-ignored folder of the repo, e.g. build/ft-full)")
    ap.add_argument("--context", type=int, default=8192, help="the long-context decode row's context (KV reserved)")
    ap.add_argument("--prefill-chunk", type=int, default=4096, help="the engines' and prefill forwards' chunk")
    ap.add_argument("--variants", default="",
                    help="each budget also with these scheduler options, after the default: ';'-separated variants of "
                         "','-separated OffloadConfig fields, e.g. 'cpu_lane=False;admit_margin=2.0'")
    ap.add_argument("--no-dense-mma", action="store_true",
                    help="A/B: kept-quantized dense linears never take the tensor-core product (`rows_from` answers "
                         "None in this process), so calls of several rows run the GEMV or the chunked path")
    args = ap.parse_args()
    if args.no_dense_mma:
        from ft.runtime.gpu.kernels import dense_quant_mma

        dense_quant_mma.rows_from = lambda scheme, n, k: None
    if "models" in args.stages.split(",") and args.deadline_s < MODEL_MIN_S + 30:
        ap.error(f"--deadline-s {args.deadline_s:g}: a model starts only with {MODEL_MIN_S} s left (synthesis and "
                 "compile included), after this tool's own start-up: give it at least "
                 f"{MODEL_MIN_S + 30} s")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.synth_dir is not None:
        args.synth_dir.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    from gpu_full_decode import set_sizes

    set_sizes(args.context, args.prefill_chunk)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "host": host_cpu(),
                 "context": args.context, "prefill_chunk": args.prefill_chunk, "dense_mma": not args.no_dense_mma}
    import triton

    res["triton"] = triton.__version__
    res["hbm_read_gbs"] = hbm_read_gbs()
    log(f"HBM read {res['hbm_read_gbs']:.0f} GB/s; host {res['host']}")

    def flush() -> None:
        (args.out / "gpu_full.json").write_text(json.dumps(res, indent=1, default=str) + "\n")

    flush()
    for stage in stages:  # in the order given
        left = args.deadline_s - (time.perf_counter() - T0)
        if stage == "kernels":
            res["kernels"] = {}
            for name in args.benches.split(","):
                left = args.deadline_s - (time.perf_counter() - T0)
                if Path(f"tools/{name}.py").exists() and left > 30:
                    res["kernels"][name] = run_script(name, args.out, min(args.kernel_timeout_s, left - 20), args.quick)
                    flush()
        elif stage == "tests":
            res["tests"] = run_script("pytest", args.out, min(240.0, left - 30), tests=args.tests)
        elif stage == "models":
            from gpu_full_models import bench_model

            if args.budgets:
                res["bench_bw"] = ensure_bw_profile()
            res["models"] = {}
            for preset in args.models.split(","):
                left = args.deadline_s - (time.perf_counter() - T0)
                if left < MODEL_MIN_S:
                    log(f"{preset}: skipped, {left:.0f} s left")
                    res["models"][preset] = {"skipped": f"{left:.0f} s left before the deadline"}
                    continue
                ftw = None
                try:
                    ftw = build(args.work, preset, args.routing, args.synth_dir)
                    res["models"][preset] = bench_model(ftw, preset, hbm_gbs=res["hbm_read_gbs"], log=log,
                                                        llama=LLAMA_CPP if preset == "qwen3moe-35b-geom" else None,
                                                        deadline=T0 + args.deadline_s,
                                                        budgets=tuple(float(b) for b in args.budgets.split(",") if b),
                                                        resident=not args.skip_resident, traces=args.out,
                                                        variants=parse_variants(args.variants))
                    res["models"][preset]["routing"] = routing_of(preset, args.routing)
                except Exception:  # noqa: BLE001 - the next model and stage still run
                    res["models"][preset] = {"error": traceback.format_exc()[-3000:]}
                    log(f"{preset} failed:\n{res['models'][preset]['error']}")
                flush()
                for entry in filter(None, args.after.split(",")):
                    tool, _, only = entry.partition("@")  # tool@model: after that model's rows only
                    if only and only != preset:
                        continue
                    left = args.deadline_s - (time.perf_counter() - T0)
                    if ftw is not None and left > 60:
                        out = args.out / f"{tool}-{preset}"
                        res.setdefault(tool, {})[preset] = run_after(tool, ftw, out, left, log)
                        flush()
                if ftw is not None and not args.keep_ftw:
                    shutil.rmtree(ftw, ignore_errors=True)  # the disk holds one full-size FTW at a time
        else:
            raise SystemExit(f"unknown stage {stage!r}")
        flush()
    flush()
    log("done")
    packed = pack_for_return(args.out)
    if packed:
        log(f"packed {packed} files into {args.out / PACKED} (more than {RETURN_FILES} files would not all come back)")


RETURN_FILES = 8  # the GPU machine hands back at most this many files of the output folder
PACKED = "more.tar.gz"


def pack_for_return(out: Path, keep: tuple[str, ...] = ("gpu_full.json", "logs.txt")) -> int:
    """When `out` holds more than RETURN_FILES files, every file but the top-level `keep` ones goes into one
    PACKED archive (then removed, with the folders left empty), so that the whole run comes back. Returns how many
    files were packed (0: nothing to do)."""
    import tarfile

    files = sorted(p for p in out.rglob("*") if p.is_file())
    if len(files) <= RETURN_FILES:
        return 0
    rest = [p for p in files if not (p.parent == out and p.name in (*keep, PACKED))]
    tmp = out / (PACKED + ".partial")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in rest:
            tar.add(p, arcname=str(p.relative_to(out)))
    tmp.replace(out / PACKED)
    for p in rest:
        p.unlink()
    for d in sorted((d for d in out.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return len(rest)


if __name__ == "__main__":
    main()
