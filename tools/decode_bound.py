"""The physical bound of each VRAM-budget decode row of a gpu_full run, beside what the row measured, and the ratio
to llama.cpp measured beside it.

    python tools/decode_bound.py [--json benchmarks/gpu_full.json] [--run -1] [--miss-gbs 86] [--llama-run 68]

Per token, batch 1 (no time of ours in it): the dense weights plus the routed records Belady's optimum keeps resident,
read at the run's measured HBM rate, plus Belady's miss bytes over `--miss-gbs`, what the GPU's copies and the CPU
lane move together (86 GB/s: runs 42-43 on the H200 host). The records a token routes are (MoE layers x top-k); the
hit rate is Belady's with bypass over the row's own routing trace (`belady` in the row).
`--llama-run N`: the geom rows also divided by llama.cpp's run N of benchmarks/llamacpp.json (decode: tg128; prefill
4k: pp4096 at -ub 4096), twice: at the `-ncmoe` whose weights fit the row's budget (NCMOE; llama.cpp's peak is then
~1.2 GiB above it: KV and compute buffers), and at the fewest CPU layers whose measured peak (nvidia-smi, as our rows'
`peak`) stays within the budget, the same rule our rows obey (`same_peak`; None when no measured -ncmoe fits).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

MISS_GBS = 86.0


def bound_tok_s(row: dict, hbm_gbs: float, miss_gbs: float = MISS_GBS) -> float | None:
    """Tokens/s a decode step of `row` (one budget row of gpu_full.json) cannot beat; None without a Belady replay."""
    belady, moe, plan = row.get("belady"), row.get("moe"), row.get("plan")
    if not (belady and moe and plan and moe.get("tokens")):
        return None
    records = len(row["trace"]["moe_layers"]) * moe["pairs"] / moe["tokens"]  # routed records a token
    hit = belady["hit_rate"]
    resident = plan["dense"] + records * hit * moe["record_bytes"]
    missed = records * (1 - hit) * moe["record_bytes"]
    return 1 / (resident / (hbm_gbs * 1e9) + missed / (miss_gbs * 1e9))


# llama.cpp's placement for each budget: the -ncmoe whose weights fit it (.peer's device_run.sh: ~7.9 GiB of weights
# on the GPU at -ncmoe 24, ~12.1 at 14); only for the model of its GGUF, geom's geometry
NCMOE = {8.0: 24, 12.0: 14}
PEER_MODEL = "qwen3moe-35b-geom"


def llama_rates(entry: dict) -> dict[int, dict[str, float]]:
    """-ncmoe -> {test: tok/s ("tg128", "pp512", "pp4096"), "peak:" + test: the peak MiB of the llama-bench run that
    measured it, where recorded} of one benchmarks/llamacpp.json entry."""
    out: dict[int, dict[str, float]] = {}
    for bench in entry.get("benches", []):
        for t in bench.get("tests", []):
            rates = out.setdefault(int(bench["n_cpu_moe"]), {})
            rates[t["test"]] = float(t["avg_ts"])
            if bench.get("peak_gpu_mem_mib") is not None:
                rates["peak:" + t["test"]] = float(bench["peak_gpu_mem_mib"])
    return out


def same_peak(llama: dict[int, dict[str, float]], budget_gib: float, test: str) -> tuple[int, float] | None:
    """(-ncmoe, tok/s) of `test` at the fewest CPU layers whose measured peak is within `budget_gib`; None if none."""
    fits = [n for n, r in llama.items() if test in r and r.get("peak:" + test, math.inf) <= budget_gib * 1024]
    return (min(fits), llama[min(fits)][test]) if fits else None


def rows(run: dict, miss_gbs: float = MISS_GBS, llama: dict[int, dict[str, float]] | None = None) -> list[dict]:
    """One dict per budget row of `run`: model, budget, decode after 256 tokens, its bound and the ratio; with
    `llama` (`llama_rates`), the geom rows' ratios to it too (decode `vs_llama`, prefill 4k `prefill_vs_llama`)."""
    out = []
    for model, v in run.get("models", {}).items():
        for row in v.get("budgets", []):
            bound = bound_tok_s(row, run["hbm_read_gbs"], miss_gbs)
            tok_s = (row.get("decode_warm") or {}).get("tok_s")
            r = {"model": model, "budget_gib": row["budget_gib"], "variant": row.get("variant") or {},
                 "tok_s": tok_s, "bound_tok_s": bound, "of_bound": tok_s / bound if tok_s and bound else None}
            peer = (llama or {}).get(NCMOE.get(row["budget_gib"], -1), {}) if model == PEER_MODEL else {}
            prefill = (row.get("prefill") or {}).get("tok_s")
            r["vs_llama"] = tok_s / peer["tg128"] if tok_s and "tg128" in peer else None
            r["prefill_vs_llama"] = prefill / peer["pp4096"] if prefill and "pp4096" in peer else None
            for key, test, ours in (("", "tg128", tok_s), ("prefill_", "pp4096", prefill)):
                fit = same_peak(llama or {}, row["budget_gib"], test) if model == PEER_MODEL else None
                r[f"{key}llama_same_peak"] = fit  # (-ncmoe, tok/s)
                r[f"{key}vs_llama_same_peak"] = ours / fit[1] if ours and fit else None
            out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parents[1] / "benchmarks/gpu_full.json")
    ap.add_argument("--run", type=int, default=-1, help="index into the JSON's runs (default: the latest)")
    ap.add_argument("--miss-gbs", type=float, default=MISS_GBS)
    ap.add_argument("--llama-run", type=int, default=None, help="llama.cpp's run in --llama-json to divide by")
    ap.add_argument("--llama-json", type=Path,
                    default=Path(__file__).resolve().parents[1] / "benchmarks/llamacpp.json")
    args = ap.parse_args()
    run = json.loads(args.json.read_text())[args.run]
    llama = None
    if args.llama_run is not None:
        entry = next((e for e in json.loads(args.llama_json.read_text()) if e.get("run") == args.llama_run), None)
        if entry is None:
            raise SystemExit(f"no run {args.llama_run} in {args.llama_json}")
        llama = llama_rates(entry)
    print(f"{run['date']} {run.get('gpu', '?')}, HBM {run['hbm_read_gbs']:.0f} GB/s, misses at {args.miss_gbs:g} GB/s")
    def fmt(x: float | None, spec: str = ",.1f") -> str:
        return "-" if x is None else format(x, spec)

    for r in rows(run, args.miss_gbs, llama):
        peer = "" if r["vs_llama"] is None else (f"; {r['vs_llama']:.2f}x llama.cpp's decode, prefill 4k "
                                                 f"{fmt(r['prefill_vs_llama'], '.2f')}x")
        for key, what in (("", "decode"), ("prefill_", "prefill 4k")):
            fit = r.get(f"{key}llama_same_peak")
            if fit:
                peer += (f"; {what} {r[f'{key}vs_llama_same_peak']:.2f}x llama.cpp's at the same peak VRAM "
                         f"(-ncmoe {fit[0]}: {fit[1]:,.1f} tok/s)")
        print(f"  {r['model']} {r['budget_gib']:g} GiB {r['variant'] or ''}: {fmt(r['tok_s'])} tok/s, bound "
              f"{fmt(r['bound_tok_s'])}, {fmt(r['of_bound'], '.2f')} of it{peer}")

if __name__ == "__main__":
    main()
