"""Host time of the expert cache's bookkeeping per decode token, at the full model's geometry.

    python tools/bench_cache_host.py [--slots 2200 4300 10240] [--tokens 200] [--label NAME] [--out benchmarks]

Replays batch-1 decode routing (40 MoE layers x 256 experts, top-8; uniform, and Zipf-skewed like `ft synth
--routing skewed`) through `ExpertCache` with the calls `GpuExperts` makes per MoE layer on the miss path: tick,
observe, unique, lookup, touch, one slot per miss, and with `--prefetch N` one slot per missing expert among N
predicted for the next layer (the true next routing padded with random experts). Slots come from one `victims`
pass per call shared by both (`admit_many`), or with `--per-expert` from one `admit` per expert, the call pattern
before 2026-12-03. This is pure host time on the layer's critical path: the GPU waits for it before
the layer's uploads and kernel are issued. Slot counts: 2200 and 4300 are what the scaled 8 and 12 GiB budgets give
the 40-layer Qwen3.6-35B-A3B model (dense weights dequantized, embedding table on the host; benchmarks/gpu.md),
10240 is every expert. Results are appended to <out>/cache_host.json and the table in <out>/cache_host.md is
rewritten from all runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench_record import append_run, machine  # tools/, next to this script

from ft.runtime.gpu.expert_cache import ExpertCache

L, E, K = 40, 256, 8


def routing(kind: str, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """[tokens, L, K] expert ids: uniform, or Zipf(1) popularity over a per-layer permutation (top-k without
    replacement, like a router with a per-expert bias)."""
    if kind == "uniform":
        return np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(tokens)])
    pop = 1.0 / np.arange(1, E + 1)
    perms = [rng.permutation(E) for _ in range(L)]
    p = [pop[np.argsort(perm)] / pop.sum() for perm in perms]
    return np.stack([[rng.choice(E, K, replace=False, p=p[layer]) for layer in range(L)] for _ in range(tokens)])


def replay(ids: np.ndarray, slots: int, per_expert: bool, prefetch: int, rng: np.random.Generator
           ) -> tuple[float, int]:
    """(host seconds per token, misses per token) of the cache calls over `ids`."""
    c = ExpertCache(L, E, slots)
    flat = ids.reshape(-1, K)  # routing of consecutive layer calls
    preds = [np.unique(np.concatenate([flat[i + 1][: prefetch // 2], rng.choice(E, prefetch, replace=False)]))[
        :prefetch] for i in range(len(flat) - 1)] + [np.empty(0, np.int64)]
    misses = 0
    t = time.perf_counter()
    for i, routed in enumerate(flat):
        layer, nxt = i % L, (i + 1) % L
        c.tick()
        c.observe(layer, routed, 1)
        uniq = np.unique(routed)
        s = c.lookup(layer, uniq)
        c.touch(s[s >= 0])
        miss = uniq[s < 0]
        misses += len(miss)
        pred = preds[i] if prefetch else preds[-1]
        if per_expert:
            for e in miss:
                c.admit(layer, int(e))
            for e in pred[c.slot_of[nxt, pred] < 0]:
                if c.admit(nxt, int(e))[0] < 0:
                    break
        else:
            chosen = c.victims(len(miss) + len(pred))
            c.admit_many(layer, miss, chosen)
            c.admit_many(nxt, pred[c.slot_of[nxt, pred] < 0], chosen[len(miss):])
    return (time.perf_counter() - t) / len(ids), misses // len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[2200, 4300, 10240])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--per-expert", action="store_true", help="one admit() per miss (the old call pattern)")
    ap.add_argument("--prefetch", type=int, default=0, help="experts predicted for the next layer per call")
    ap.add_argument("--label", default="")
    ap.add_argument("--note", default="", help="how this run differs from its command line (kept with the run)")
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("uniform", "skewed"):
        ids = routing(kind, args.tokens + 20, rng)
        for slots in args.slots:
            replay(ids[:20], slots, args.per_expert, args.prefetch, rng)  # warm-up (allocations, caches)
            sec, miss = replay(ids[20:], slots, args.per_expert, args.prefetch, rng)
            rows.append({"routing": kind, "slots": slots, "prefetch": args.prefetch,
                         "ms_per_token": round(sec * 1e3, 3),
                         "misses_per_token": miss, "us_per_layer_call": round(sec * 1e6 / L, 1)})
            print(f"{kind:8s} {slots:6d} slots: {sec * 1e3:7.2f} ms/token host, {miss} misses/token")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    run = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "label": args.label,
           "commit": commit, "pattern": "per-expert admit" if args.per_expert else "admit_many",
           "machine": machine(f"numpy {np.__version__}"),
           "command": "python tools/bench_cache_host.py " + " ".join(sys.argv[1:]),
           "note": args.note, "rows": rows}
    out = Path(args.out)
    runs = append_run(out, "cache_host", run)
    lines = ["# Expert-cache bookkeeping: host time per decode token", "",
             "What `tools/bench_cache_host.py` measures (see its docstring): the cache calls `GpuExperts` makes",
             "per MoE layer on the miss path, for the 40-layer Qwen3.6-35B-A3B geometry at batch 1, as host",
             "milliseconds per token. The GPU waits for this before each layer's uploads and kernel.", "",
             "| date | label | commit | call pattern | routing | slots | prefetch | misses/token | ms/token "
             "| µs per layer call |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for row in r["rows"]:
            lines.append(f"| {r['date']} | {r['label']} | {r['commit']} | {r['pattern']} | {row['routing']} | "
                         f"{row['slots']} | {row.get('prefetch', 0)} | {row['misses_per_token']} | "
                         f"{row['ms_per_token']} | "
                         f"{row['us_per_layer_call']} |")
    lines += ["", "Machines and commands:", ""]
    lines += [f"- {r['date']} ({r['label'] or r['pattern']}): {r['machine']}; `{r['command']}`"
              + (f"; {r['note']}" if r.get("note") else "") for r in runs]
    (out / "cache_host.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'cache_host.md'}")


if __name__ == "__main__":
    main()
