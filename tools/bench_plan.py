"""Predicted against measured: `ft plan` for a full-size FTW at VRAM budgets, then the engine started from the plan,
decode batch 1 timed as `tools/gpu_full_models.py` times it. One command on the GPU machine:

    bash tools/gpu_run.sh tools/bench_plan.py --out DIR [--model qwen3moe-35b-geom] [--routing uniform]
                                              [--budgets 8,12] [--calibrate 4096] [--baseline] [--deadline-s 560]

Per budget: the plan (routing from `--calibrate N` tokens of built-in text run by an engine at that budget, or the
uniform prior with 0), written into the FTW; a new engine that must pick it by itself (same settings as gpu_full's
budget rows: 8448 KV tokens, 8 running requests, 4k prefill chunks); decode at a 32-token context for tokens 16-80
and again after 256 tokens (the steady state the prediction is for), the hit rate over that window, prefill of 4096
tokens (the second of two: the first compiles). `--baseline` also times the same engine with `--plan none` (a cold
cache). Without a `ft bench bw` profile for this GPU one is measured first (the prediction's rates come from it).
Results: DIR/bench_plan.json; the table goes to stdout. Pass: measured steady decode within 20 % of the prediction.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from ft.formats import FtwReader
from ft.runtime.engine import Engine, EngineSettings
from ft.runtime.plan.build import make_plan, write_plan
from ft.runtime.plan.routing import RoutingProfile

T0 = time.perf_counter()
WARM_TOKENS = 256


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def settings(gib: float, plan: str | None = None) -> EngineSettings:
    return EngineSettings(device="cuda", vram_budget=int(gib * (1 << 30)), kv_reserve_tokens=8192 + 256,
                          max_prefill_length=4096, max_running_requests=8, plan=plan)


def measure(ftw: Path, gib: float, plan: str | None, steps: int) -> dict:
    from gpu_full_decode import decode, prefill

    eng = Engine(ftw, settings(gib, plan))
    ex = eng._experts
    try:
        res = {"placement": eng.placement.stats() if eng.placement else None, "slots": ex.num_slots,
               "pin": {k: v for k, v in ex.wait_pinned(timeout=120).items() if isinstance(v, (int, float, str))}}
        res["decode_early"] = decode(eng, 1, 32, steps, warmup=16)["tok_s"]
        ex.settle()
        ex.reset_stats()
        res["decode_warm"] = decode(eng, 1, 32, steps, warmup=WARM_TOKENS)["tok_s"]
        ex.settle()
        c = ex.stats()
        res["hit_rate"] = c["hits"] / max(1, c["hits"] + c["misses"])
        prefill(eng.model, 4096, repeat=1)  # the process's first compiles the prefill kernels
        res["prefill"] = prefill(eng.model, 4096, repeat=1)["tok_s"]
    finally:
        eng.close()
        del eng, ex
        gc.collect()
        torch.cuda.empty_cache()
    return res


def bench_budget(ftw: Path, gib: float, *, calibrate: int, steps: int, baseline: bool) -> dict:
    reader = FtwReader(ftw)
    t = time.perf_counter()
    measured_split = None
    if calibrate:
        from ft.runtime.plan.calibrate import calibrate as run_calibration

        routing, measured_split = run_calibration(reader, calibrate, settings(gib))
        gc.collect()
        torch.cuda.empty_cache()
    else:
        routing = RoutingProfile.uniform("bench_plan: no calibration")
    plan = make_plan(reader, settings(gib), routing, name=f"bench-{gib:g}gib", measured=measured_split)
    write_plan(ftw, plan)
    pr = plan.prediction
    row = {"budget_gib": gib, "plan": plan.name, "plan_s": time.perf_counter() - t, "routing": routing.source,
           "predicted": {"decode_tok_s": pr.decode_tok_s, "prefill_tok_s": pr.prefill_tok_s, "hit_rate": pr.hit_rate,
                         "expert_slots": plan.vram.expert_slots, "arithmetic": list(pr.arithmetic),
                         "rates": plan.machine.rates.source}}
    log(f"{gib:g} GiB: plan {plan.name}, predicted decode {pr.decode_tok_s:.1f} tok/s (hit {pr.hit_rate:.3f})")
    row["measured"] = measure(ftw, gib, None, steps)  # the engine must pick the plan made for this machine itself
    row["picked_the_plan"] = (row["measured"]["placement"] or {}).get("plan") == plan.name
    if baseline:
        row["baseline_no_plan"] = measure(ftw, gib, "none", steps)
    m = row["measured"]
    row["decode_ratio"] = m["decode_warm"] / pr.decode_tok_s
    row["within_20pct"] = abs(row["decode_ratio"] - 1) <= 0.20
    log(f"{gib:g} GiB: engine started from {m['placement']}; measured decode {m['decode_warm']:.1f} (tokens 16-80: "
        f"{m['decode_early']:.1f}), hit {m['hit_rate']:.3f}, prefill {m['prefill']:.0f}; measured / predicted "
        f"{row['decode_ratio']:.3f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ft-full",
                    help="where the synthetic checkpoint and its FTW are built (shared with tools/gpu_full.py)")
    ap.add_argument("--model", default="qwen3moe-35b-geom")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--budgets", default="8,12")
    ap.add_argument("--calibrate", type=int, default=4096, help="calibration tokens per budget (0: uniform prior)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--baseline", action="store_true", help="also time each budget with --plan none")
    ap.add_argument("--deadline-s", type=float, default=560.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_full import build

    from ft.runtime.gpu.benchbw import load_profile, run_bench, save_profile

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "gpu": torch.cuda.get_device_name(0), "model": args.model, "routing": args.routing, "budgets": []}
    out = args.out / "bench_plan.json"
    if load_profile(0) is None:
        log("no `ft bench bw` profile for this GPU: measuring one")
        res["bench_bw"] = str(save_profile(run_bench(progress=log)))
    ftw = build(args.work, args.model, args.routing)
    for gib in (float(b) for b in args.budgets.split(",") if b):
        if time.perf_counter() - T0 > args.deadline_s - 120:
            res["budgets"].append({"budget_gib": gib, "skipped": "deadline"})
            continue
        try:
            res["budgets"].append(bench_budget(ftw, gib, calibrate=args.calibrate, steps=args.steps,
                                               baseline=args.baseline))
        except Exception:  # noqa: BLE001 - the next budget still runs
            res["budgets"].append({"budget_gib": gib, "error": traceback.format_exc()[-3000:]})
            log(res["budgets"][-1]["error"])
        out.write_text(json.dumps(res, indent=1) + "\n")
    print("| budget | routing | predicted decode | measured (steady / tokens 16-80) | ratio | hit predicted / "
          "measured | prefill bound / measured |")
    for r in res["budgets"]:
        if "measured" in r:
            p, m = r["predicted"], r["measured"]
            pf = f"{p['prefill_tok_s']:.0f}" if p["prefill_tok_s"] else "-"
            print(f"| {r['budget_gib']:g} GiB | {r['routing']} | {p['decode_tok_s']:.1f} | {m['decode_warm']:.1f} / "
                  f"{m['decode_early']:.1f} | {r['decode_ratio']:.3f} | {p['hit_rate']:.3f} / {m['hit_rate']:.3f} | "
                  f"{pf} / {m['prefill']:.0f} |")
    out.write_text(json.dumps(res, indent=1) + "\n")
    log(f"done: {out}")


if __name__ == "__main__":
    main()
