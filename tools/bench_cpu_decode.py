"""CPU decode benchmark: synthesize a preset, compile it to FTW, generate greedily, compare with the bandwidth bound.

    python tools/bench_cpu_decode.py [--arch qwen3_moe] [--preset small] [--prompt-tokens 128] [--new-tokens 64]
                                     [--repeats 3] [--threads 2,1] [--work DIR] [--out DIR]

Decode on the CPU is memory-bound: every token reads the dense weights (attention, norms, routers, shared experts,
the LM head: everything but the embedding table, of which one row is read) plus the `top_k` routed experts of each
MoE layer, plus the KV cache. `bound tok/s = host read bandwidth / bytes per token`, where the bandwidth is measured
here (a large fp32 reduction, best of several runs, on the first thread count). The ratio measured / bound says how
far the runtime is from the hardware limit. Writes benchmarks/cpu_decode.md and benchmarks/cpu_decode.json.

Run it on a quiet machine: when other processes share the cores, torch's multi-threaded kernels stall on descheduled
threads and decode drops several-fold (the report records the 1-minute load average for that reason).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Host read bandwidth in bytes/s: sum a buffer larger than any cache, best of `repeats`."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def bytes_per_decode_token(reader, context: int, kv_elem_bytes: int) -> dict[str, int]:
    """Bytes one decode token reads: dense weights, routed experts, and sequence state (KV at `context` tokens,
    DeltaNet recurrent state)."""
    cfg = reader.config
    tensors = reader.records.tensors
    dense = sum(t.nbytes for name, t in tensors.items() if name != "embed_tokens.weight")
    if cfg.tie_word_embeddings:
        dense += tensors["embed_tokens.weight"].nbytes  # the tied table is the LM head: read whole
    else:
        dense += tensors["embed_tokens.weight"].nbytes // cfg.vocab_size  # one embedding row
    experts = 0
    for name in reader.bank_names():
        bank = reader.bank(name)
        per_expert = sum(c.nbytes for c in bank.components.values())
        experts += cfg.num_experts_per_tok * per_expert
    kv = 0
    for kind in cfg.layer_types:
        if kind == "full_attention":
            kv += 2 * cfg.num_kv_heads * cfg.head_dim * context * kv_elem_bytes
        else:  # the fp32 DeltaNet recurrent state, whatever the context
            kv += cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return {"dense": dense, "experts": experts, "kv": kv, "total": dense + experts + kv}


def machine_info() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    # Other processes compete for the same cores and memory bus; the 1-minute load average says how quiet it was.
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "memory_gib": round(mem_gib, 1), "load_avg_1min": load, "python": platform.python_version(),
            "torch": torch.__version__,
            "os": f"{platform.system()} {platform.release()}"}


def build_ftw(arch: str, preset: str, work: Path) -> Path:
    from ft.compiler import compile_checkpoint
    from ft.compiler.synth import synth

    ftw = work / f"{arch}-{preset}.ftw"
    if (ftw / "model.ftw").is_file():  # built by an earlier run with the same --work
        return ftw
    hf_dir = synth(arch, preset, work / f"{arch}-{preset}-hf", seed=0, force=True)
    return compile_checkpoint(hf_dir, ftw)


def run(args: argparse.Namespace, work: Path) -> dict[str, object]:
    from ft.formats import FtwReader
    from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate

    print(f"synthesizing {args.arch}/{args.preset} and compiling to FTW in {work} ...", flush=True)
    t0 = time.perf_counter()
    ftw = build_ftw(args.arch, args.preset, work)
    print(f"  built in {time.perf_counter() - t0:.1f} s", flush=True)
    reader = FtwReader(ftw)
    engine = Engine(reader, EngineSettings(kv_reserve_tokens=args.prompt_tokens + args.new_tokens + 16,
                                           max_prefill_length=args.prompt_tokens))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    print("warm-up run (first touch of every weight and expert) ...", flush=True)
    generate(engine, prompt, params)
    # Rounds interleave the thread counts, so a change in machine load hits every configuration alike.
    runs: dict[int, list[dict]] = {n: [] for n in args.threads}
    for i in range(args.repeats):
        for n in args.threads:
            torch.set_num_threads(n)
            timings = generate(engine, prompt, params).timings
            runs[n].append(timings)
            print(f"  round {i + 1}, {n} thread(s): prefill {timings['prefill_tok_s']:.1f} tok/s, "
                  f"decode {timings['decode_tok_s']:.2f} tok/s", flush=True)
    torch.set_num_threads(args.threads[0])
    print("measuring host read bandwidth ...", flush=True)
    bandwidth = measure_read_bandwidth()
    per_token = bytes_per_decode_token(reader, args.prompt_tokens + args.new_tokens // 2,
                                       engine.model.dtype.itemsize)
    bound = bandwidth / per_token["total"]
    configs = []
    for n, rs in runs.items():
        decode = max(t["decode_tok_s"] for t in rs)
        configs.append({
            "threads": n, "prefill_tok_s": max(t["prefill_tok_s"] for t in rs), "decode_tok_s": decode,
            "decode_tok_s_median": statistics.median(t["decode_tok_s"] for t in rs),
            "ttft_s": min(t["ttft_s"] for t in rs), "ratio_to_bound": decode / bound, "runs": rs,
        })
    best = max(configs, key=lambda c: c["decode_tok_s"])
    cfg = engine.config
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python tools/bench_cpu_decode.py " + " ".join(shlex.quote(a) for a in _result_args(sys.argv[1:])),
        "machine": machine_info(),
        "model": {"arch": args.arch, "preset": args.preset, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
                  "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "vocab": cfg.vocab_size,
                  "expert_scheme": reader.quant.get("experts")},
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "bytes_per_decode_token": per_token,
        "host_read_bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_bound_tok_s": bound,
        "decode_tok_s": best["decode_tok_s"], "best_threads": best["threads"],
        "ratio_to_bound": best["ratio_to_bound"],
        "configs": configs,
    }


def _result_args(argv: list[str]) -> list[str]:
    """argv without --work/--out (where files go does not change the result, and paths are machine-specific)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--work", "--out"):
            skip = True
        elif not a.startswith(("--work=", "--out=")):
            out.append(a)
    return out


def write_report(res: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cpu_decode.json").write_text(json.dumps(res, indent=2) + "\n")
    m, b = res["machine"], res["bytes_per_decode_token"]
    mib = 2**20
    lines = [
        "# CPU decode benchmark", "",
        f"Date: {res['date']}  ", f"Command: `{res['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, "
        f"{m['os']}, Python {m['python']}, torch {m['torch']}; 1-minute load average {m['load_avg_1min']} "
        "when measured", "",
        f"Model: synthetic `{res['model']['arch']}` preset `{res['model']['preset']}` "
        f"({res['model']['layers']} layers, hidden {res['model']['hidden']}, {res['model']['experts']} experts top-"
        f"{res['model']['top_k']}, vocab {res['model']['vocab']}, experts `{res['model']['expert_scheme']}`), "
        f"greedy, {res['prompt_tokens']}-token prompt, {res['new_tokens']} new tokens, {res['repeats']} rounds per "
        "thread count after a warm-up.", "",
        "| threads | prefill (best) | decode (best) | decode (median) | TTFT (best) | decode / bound |",
        "|---|---|---|---|---|---|",
        *(f"| {c['threads']} | {c['prefill_tok_s']:.1f} tok/s | {c['decode_tok_s']:.2f} tok/s | "
          f"{c['decode_tok_s_median']:.2f} tok/s | {c['ttft_s'] * 1000:.0f} ms | {c['ratio_to_bound']:.3f} |"
          for c in res["configs"]),
        "",
        f"Bytes per decode token: {b['total'] / mib:.1f} MiB (dense {b['dense'] / mib:.1f}, routed experts "
        f"{b['experts'] / mib:.1f}, KV {b['kv'] / mib:.2f}). Host read bandwidth (measured): "
        f"{res['host_read_bandwidth_gb_s']:.1f} GB/s. Bandwidth bound: {res['bandwidth_bound_tok_s']:.1f} tok/s.",
        "",
        "The bound assumes every byte a decode token needs is read once from DRAM at the measured rate; compute, "
        "dequantization and Python overhead are what separate the measurement from it.", "",
    ]
    (out_dir / "cpu_decode.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default=None,
                    help="comma-separated torch thread counts to compare, e.g. 2,1 (default: all cores, then 1)")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep (and reuse) the synthesized model here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = ap.parse_args()
    default = [os.cpu_count() or 1, 1] if (os.cpu_count() or 1) > 1 else [1]
    args.threads = [int(n) for n in args.threads.split(",")] if args.threads else default
    if args.work is not None:
        res = run(args, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="ft-bench-") as tmp:
            res = run(args, Path(tmp))
    write_report(res, args.out)
    print(f"decode {res['decode_tok_s']:.2f} tok/s ({res['best_threads']} thread(s)) = {res['ratio_to_bound']:.3f} x "
          f"the bandwidth bound ({res['bandwidth_bound_tok_s']:.1f} tok/s); wrote {args.out / 'cpu_decode.md'}")


if __name__ == "__main__":
    main()
