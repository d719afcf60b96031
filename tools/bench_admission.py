"""Mode mapped's cache admission against its two yardsticks, on routing a real engine produced (CPU, no GPU needed).

    python tools/bench_admission.py --out benchmarks [--preset small] [--tokens 400] [--slots 0.25,0.5]

Per routing (uniform, skewed): `ft synth qwen3_moe PRESET --routing R`, compiled with `--quantize nvfp4`, is decoded
greedily for --tokens tokens after a random 32-token prompt by the engine with the GPU expert store on the CPU
emulation (mode mapped, slots for the shares of all experts given by --slots, the routing trace kept). On the steps
after the first third (earlier ones warm the cache), per slot share:
  belady   Belady's MIN with bypass: knows every future step (`tools/belady.py`)
  static   the best fixed set of experts for those steps, chosen with their own counts (`belady.static_oracle`):
           near what an online policy can reach when routing is drawn independently step after step from fixed
           popularities, as a synthetic model's is, though above it by the counts' sampling noise
           (`belady.static_from_history` chooses from earlier steps only: benchmarks/admission.md)
  mapped   the engine's own admission replayed on the trace (`belady.replay_mapped`) at several admit_max /
           admit_margin settings, the first being the default; and the engine's measured hit rate (same as its replay)
Writes OUT/admission.md (a section per run, newest first) and OUT/admission.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from belady import belady, replay_mapped, static_oracle
from ft.compiler import compile_checkpoint
from ft.compiler.synth import synth
from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.gpu.offload_config import OffloadConfig

SETTINGS = ((2, 2.0), (1, 2.0), (2, 1.0), (4, 1.0), (8, 0.0))  # (admit_max, admit_margin); the first: the default


def trace_of(ftw: Path, slots: int, tokens: int) -> tuple[list, dict, int, int]:
    """The engine's routing trace over a greedy decode -> (trace, its stats, layers, experts)."""
    eng = Engine(ftw, EngineSettings(device="cpu", kv_reserve_tokens=tokens + 64, prefix_cache_entries=0),
                 offload=OffloadConfig(num_slots=slots, trace_limit=10**7))
    ex = eng._experts
    ex.device_plan = True  # the sync-free mapped path, as on a GPU (the CPU emulation runs its kernels' reference)
    prompt = np.random.default_rng(0).integers(100, eng.config.vocab_size - 100, 32).tolist()
    generate(eng, prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    ex.settle()
    out = (list(ex.trace), ex.stats(), ex.L, ex.E)
    eng.close()
    return out


def rate(r: dict) -> float:
    return r["hits"] / max(1, r["accesses"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--slots", default="0.25,0.5", help="slot counts as shares of all experts")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for routing in ("uniform", "skewed"):
            hf = Path(synth("qwen3_moe", args.preset, Path(tmp) / f"{routing}-hf", routing=routing, seed=0))
            ftw = compile_checkpoint(hf, Path(tmp) / f"{routing}.ftw", quantize="nvfp4", progress=False)
            for share in (float(x) for x in args.slots.split(",")):
                t = time.perf_counter()
                probe = Engine(ftw, EngineSettings(device="cpu"), offload=OffloadConfig(num_slots=1))
                total = len(probe._experts.moe_layers) * probe._experts.E
                probe.close()
                slots = int(share * total)
                trace, stats, L, E = trace_of(ftw, slots, args.tokens)
                window = len(trace) // 3
                row = {"routing": routing, "slots": slots, "experts": total, "steps": len(trace) - window,
                       "belady": rate(belady(trace, E, slots, count_from=window)),
                       "static": rate(static_oracle(trace, E, slots, count_from=window)),
                       "engine_all_steps": stats["hits"] / max(1, stats["hits"] + stats["misses"]), "mapped": {}}
                for am, mg in SETTINGS:
                    r = replay_mapped(trace, L, E, slots, admit_max=am, admit_margin=mg, count_from=window)
                    row["mapped"][f"{am}/{mg:g}"] = {"hit_rate": rate(r),
                                                     "admitted_per_step": r["admitted"] / len(trace)}
                row["seconds"] = time.perf_counter() - t
                rows.append(row)
                print(json.dumps(row))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit, "preset": args.preset,
            "tokens": args.tokens, "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}"}
    (args.out / "admission.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    default = "{}/{:g}".format(*SETTINGS[0])
    lines = [f"## {meta['date']}, qwen3_moe `{args.preset}` (NVFP4), {args.tokens} greedy tokens, commit {commit}", "",
             f"Command: `python tools/bench_admission.py --out benchmarks --preset {args.preset} --tokens "
             f"{args.tokens} --slots {args.slots}` ({meta['machine']}). Hit rates over the steps after the first "
             "third; mapped a/m = admit_max / admit_margin, the default first.", "",
             "| routing | slots | belady | static | mapped " + " | mapped ".join(f"{a}/{m:g}" for a, m in SETTINGS)
             + " | default / static | default / belady |", "|---" * (5 + len(SETTINGS)) + "|"]
    for r in rows:
        cells = " | ".join(f"{v['hit_rate']:.3f} ({v['admitted_per_step']:.2f}/step)" for v in r["mapped"].values())
        d = r["mapped"][default]["hit_rate"]
        lines.append(f"| {r['routing']} | {r['slots']} of {r['experts']} | {r['belady']:.3f} | {r['static']:.3f} | "
                     f"{cells} | {d / r['static']:.2f} | {d / r['belady']:.2f} |")
    md = args.out / "admission.md"
    old = md.read_text().split("\n", 2)[2] if md.exists() else ""
    head = "# Mode mapped's admission vs Belady and the static oracle\n\n"
    md.write_text(head + "\n".join(lines) + "\n\n" + old)


if __name__ == "__main__":
    main()
