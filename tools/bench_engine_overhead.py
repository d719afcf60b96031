"""Engine overhead per decode step, on the CPU: `model.forward` alone vs the whole `Engine.step` around it.

    python tools/bench_engine_overhead.py [--label before] [--tokens 32] [--batch 1 4] [--repeats 3]
                                          [--configs greedy,top_p] [--work .cache/engine_overhead] [--out benchmarks]

Model: synthetic qwen3_5_moe preset `demo` cut to `--layers` layers (hidden 128, 64 experts top-8, NVFP4 experts)
with the REAL Qwen3.6 vocabulary (248,320 rows), so everything vocab-sized the engine does per step (logits,
sampling, logprobs, penalties) has the real cost while the layers stay cheap. Built once under --work.

Per sampling config and batch size (B requests decoding together), after a warm-up generation:
  direct   ms/step of `model.forward` + argmax in a plain greedy loop;
  engine   ms/step of `Engine.step` on decode-only steps, split by wrapping the engine's pieces in this tool (nothing
           in the runtime is edited): forward, sample, accept (detokenize + stop strings), prepare (input ids and
           segments), schedule/admit, and the rest (input tensor creation, accounting);
  sample   ms of `sample()` alone on fixed random [B, V] logits (the least noisy figure of the sampler's cost);
  counts   per decode step, outside `model.forward`: tensor reads to the host (tolist/item/int/bool/float: each is a
           device sync on CUDA) and ops producing a tensor of >= V elements (one full-vocab pass each on the device).
  offload  the GPU expert scheduler's CPU emulation under the engine vs the direct loop (same expert work?).
Rounds interleave direct and engine runs so machine load hits both alike; each figure is the median over rounds of
the per-round median step. Results are merged into <out>/engine_overhead.json under --label; the tables of
<out>/engine_overhead.md are rewritten from all labels, the text after its ANALYSIS marker line is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from engine_probe import PHASES, engine_round  # noqa: E402

CONFIGS = {  # name -> SamplingParams keywords
    "greedy": dict(temperature=0.0),
    "greedy+logprobs5": dict(temperature=0.0, logprobs=5),
    "top_p": dict(temperature=0.8, top_p=0.95),
    "top_k": dict(temperature=0.8, top_k=50),
    "top_p+logprobs5": dict(temperature=0.8, top_p=0.95, logprobs=5),
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5),
}
ANALYSIS = "<!-- analysis (kept when the tables are regenerated) -->"


def build_ftw(work: Path, layers: int) -> Path:
    from ft.compiler import compile_checkpoint
    from ft.compiler.synth import synth

    ftw = work / f"demo-{layers}L-nvfp4.ftw"
    if (ftw / "model.ftw").is_file():
        return ftw
    hf = synth("qwen3_5_moe", "demo", work / f"demo-{layers}L-nvfp4-hf", quant="nvfp4", num_layers=layers,
               force=True, twin=False, seed=0)
    compile_checkpoint(hf, ftw)
    shutil.rmtree(hf, ignore_errors=True)
    return ftw


def direct_round(model, prompts: list[list[int]], tokens: int) -> list[float]:
    """ms per step of model.forward + argmax over B sequences decoding together (no engine)."""
    from ft.runtime.model import Segment

    states = [model.new_state(len(p) + tokens + 1) for p in prompts]
    toks = []
    for st, p in zip(states, prompts):
        toks.append(int(model.forward(torch.tensor(p), [Segment(st, len(p))])[0][-1].argmax()))
    times = []
    for _ in range(tokens - 1):
        t = time.perf_counter()
        logits = model.forward(torch.tensor(toks), [Segment(st, 1) for st in states])
        toks = torch.cat([lg[-1:] for lg in logits]).argmax(-1).tolist()
        times.append((time.perf_counter() - t) * 1e3)
    for st in states:
        st.free()
    return times


def sample_alone(params, batch: int, vocab: int, prompt: list[int], repeats: int = 15) -> float:
    """Median ms of sample() on fixed random [B, V] logits (std 2.5, like the synthetic lm_head)."""
    from ft.runtime.sampling import RequestSampler, sample

    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 2.5
    samplers = [RequestSampler(params, prompt, vocab) for _ in range(batch)]
    sample(logits, samplers)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sample(logits, samplers)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def offload_compare(ftw: Path, prompt: list[int], tokens: int, repeats: int, slots: int) -> dict:
    """The GPU expert scheduler's CPU emulation (host-planned calls, `slots` slots, misses fetched) under the engine
    and under the direct loop: ms per decode step and the scheduler's counters per run (prefill + decode, same work
    in both)."""
    from ft.formats import FtwReader
    from ft.runtime.engine import Engine, EngineSettings, SamplingParams
    from ft.runtime.gpu.offload_config import OffloadConfig
    from ft.runtime.gpu.store import GpuExperts
    from ft.runtime.model import load_model

    reader = FtwReader(ftw)
    opts = OffloadConfig(num_slots=slots, b_cpu=1.0)  # b_cpu 1 B/s: every miss fetched while slots last
    ex = GpuExperts(reader, opts, device="cpu")
    model = load_model(reader, device="cpu", experts=ex)
    engine = Engine(reader, EngineSettings(device="cpu"), offload=opts)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    keys = ("calls", "hits", "misses", "fetched", "prefill_streamed", "bytes_h2d")
    out = {}
    for name, run, experts in (("direct", lambda: direct_round(model, [prompt], tokens), ex),
                               ("engine", lambda: [s["step"] for s in engine_round(engine, [prompt], params)],
                                engine._experts)):
        run()  # warm: fills the cache
        ms, stats = [], []
        for _ in range(repeats):
            experts.reset_stats()
            ms.append(statistics.median(run()))
            stats.append(experts.stats())
        out[name] = {"ms_per_step": statistics.median(ms), **{k: statistics.median(s[k] for s in stats) for k in keys}}
        print(f"offload emulation, {name}: {out[name]}", flush=True)
    engine.close()
    ex.close()
    return {"slots": slots, **out}


def measure(args) -> dict:
    from bench_cpu_decode import _result_args, machine_info

    from ft.runtime.engine import Engine, EngineSettings, SamplingParams

    torch.set_num_threads(args.threads)
    ftw = build_ftw(Path(args.work), args.layers)
    engine = Engine(ftw, EngineSettings(device="cpu", max_running_requests=max(args.batch), kv_reserve_tokens=16384))
    cfg = engine.config
    g = torch.Generator().manual_seed(1)
    rows = []
    for batch in args.batch:
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(batch)]
        for name in args.configs:
            params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=7, **CONFIGS[name])
            engine_round(engine, prompts, SamplingParams(max_tokens=4, ignore_eos=True, **CONFIGS[name]))  # warm
            direct, eng = [], []
            for _ in range(args.repeats):
                direct.append(statistics.median(direct_round(engine.model, prompts, args.tokens)))
                eng.append(engine_round(engine, prompts, params))
            counted = engine_round(engine, prompts, dataclasses.replace(params, max_tokens=6), count=True)
            row = {"config": name, "batch": batch, "direct_ms": statistics.median(direct),
                   "sample_alone_ms": sample_alone(params, batch, cfg.vocab_size, prompts[0]),
                   "host_reads_per_step": statistics.median(s["reads"] for s in counted),
                   "vocab_ops_per_step": statistics.median(s["big_ops"] for s in counted)}
            for key in ("step", *PHASES, "other"):
                row[f"engine_{key}_ms"] = statistics.median(statistics.median(s[key] for s in r) for r in eng)
            row["overhead_ms"] = row["engine_step_ms"] - row["engine_forward_ms"]
            rows.append(row)
            print(f"B={batch} {name:18s} direct {row['direct_ms']:6.2f} ms, engine step {row['engine_step_ms']:6.2f} "
                  f"(forward {row['engine_forward_ms']:6.2f}, sample {row['engine_sample_ms']:6.2f}, accept "
                  f"{row['engine_accept_ms']:5.2f}), sample alone {row['sample_alone_ms']:6.2f} ms, "
                  f"host reads {row['host_reads_per_step']}, vocab ops {row['vocab_ops_per_step']}", flush=True)
    engine.close()
    offload = offload_compare(ftw, prompts[0], args.tokens, args.repeats, args.offload_slots) \
        if args.offload_slots else None
    argv = " ".join(shlex.quote(a) for a in _result_args(sys.argv[1:]))
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": f"python tools/bench_engine_overhead.py {argv}",
            "machine": machine_info(),
            "model": {"preset": "demo", "layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                      "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok},
            "prompt": args.prompt, "tokens": args.tokens, "repeats": args.repeats, "rows": rows, "offload": offload}


def write_report(all_runs: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_overhead.json").write_text(json.dumps(all_runs, indent=1) + "\n")
    md = out / "engine_overhead.md"
    kept = md.read_text().split(ANALYSIS, 1)[1] if md.exists() and ANALYSIS in md.read_text() else "\n"
    lines = ["# Engine overhead per decode step (CPU)", "",
             "What `Engine.step` costs around `model.forward`, measured by `tools/bench_engine_overhead.py` (see its "
             "docstring for the method). ms are medians; `host reads` and `vocab ops` count, per decode step and "
             "outside `model.forward`, tensor reads to the host (a device sync each on CUDA) and ops that produce a "
             "tensor of >= vocab elements (a full-vocab pass each on the device).", ""]
    for label, res in all_runs.items():
        m, mod = res["machine"], res["model"]
        lines += [f"## {label}", "", f"Date: {res['date']}  ", f"Command: `{res['command']}`  ",
                  f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} thread), "
                  f"Python {m['python']}; 1-minute load average {m['load_avg_1min']} (the cores are shared: "
                  f"compare rows of one run, not absolute ms across runs)  ",
                  f"Model: synthetic qwen3_5_moe `demo` cut to {mod['layers']} layers, hidden {mod['hidden']}, "
                  f"{mod['experts']} experts top-{mod['top_k']}, vocab {mod['vocab']}; {res['prompt']}-token prompts, "
                  f"{res['tokens']} new tokens, {res['repeats']} rounds.", "",
                  "| config | B | direct ms | engine step ms | forward | sample | accept | prepare | schedule | other "
                  "| overhead ms | sample alone ms | host reads | vocab ops |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append(f"| {r['config']} | {r['batch']} | {r['direct_ms']:.2f} | {r['engine_step_ms']:.2f} | "
                         f"{r['engine_forward_ms']:.2f} | {r['engine_sample_ms']:.2f} | {r['engine_accept_ms']:.3f} | "
                         f"{r['engine_prepare_ms']:.3f} | {r['engine_schedule_ms']:.3f} | {r['engine_other_ms']:.3f} | "
                         f"{r['overhead_ms']:.2f} | {r['sample_alone_ms']:.2f} | {r['host_reads_per_step']:g} | "
                         f"{r['vocab_ops_per_step']:g} |")
        off = res.get("offload")
        if off:
            keys = [k for k in off["direct"] if k != "ms_per_step"]
            lines += ["", f"GPU expert scheduler, CPU emulation (host-planned calls, {off['slots']} slots, misses "
                      "fetched), "
                      "greedy B=1: ms per decode step and the scheduler's counters per run (prefill + decode).", "",
                      "| path | ms/step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
            lines += [f"| {p} | {off[p]['ms_per_step']:.2f} | " + " | ".join(f"{off[p][k]:g}" for k in keys) + " |"
                      for p in ("direct", "engine")]
        lines.append("")
    md.write_text("\n".join(lines) + ANALYSIS + kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="run", help="key of this run in the JSON (e.g. before / after)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--offload-slots", type=int, default=64, help="slots of the offload emulation (0 = skip it)")
    ap.add_argument("--work", default=str(REPO / ".cache" / "engine_overhead"))
    ap.add_argument("--out", default=str(REPO / "benchmarks"))
    args = ap.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    bad = sorted(set(args.configs) - set(CONFIGS))
    if bad:
        raise SystemExit(f"unknown configs {bad}; known: {', '.join(CONFIGS)}")
    out = Path(args.out)
    path = out / "engine_overhead.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[args.label] = measure(args)
    write_report(runs, out)
    print(f"wrote {out / 'engine_overhead.md'}")


if __name__ == "__main__":
    main()
