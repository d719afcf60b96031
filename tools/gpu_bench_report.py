"""Summary lines printed at the end of tools/gpu_bench.py: per placement tok/s, hit rate, bytes per token, the
fraction of the Belady bound and the ratio to the static (llama.cpp --n-cpu-moe style) placement at the same budget."""

from __future__ import annotations

import json


def print_summary(results: dict) -> None:
    print(json.dumps({k: v for k, v in results.items() if k in ("env", "tests", "stage_seconds", "errors")},
                     indent=1, default=str)[:6000])
    if "bw" in results:
        print(json.dumps(results["bw"]["gbs"], indent=1))
    for row in results.get("kernel", []):
        print(row)
    for routing, r in results.get("e2e", {}).get("routings", {}).items():
        print(routing, "logits", r.get("logits_vs_cpu"), "resident", round(r.get("resident", {}).get("tok_s", 0), 1))
        for key, d in r.get("decode", {}).items():
            b = d.get("bound") or {}
            static = r["decode"].get("static@" + key.split("@")[1], {}).get("tok_s")
            vs = f"{d['tok_s'] / static:.2f}x static" if static and not key.startswith("static") else ""
            print(f"  {key:20s} {d['tok_s']:7.1f} tok/s hit {d['stats']['hit_rate'] or 0:.2f} "
                  f"h2d {d.get('h2d_mb_per_token', 0):6.1f} MB/t cpu {d.get('cpu_mb_per_token', 0):6.1f} MB/t "
                  f"bound {b.get('bound_tok_s', 0):7.1f} frac {b.get('fraction_of_bound', 0):.2f} {vs} "
                  f"direct {d['stats'].get('uploads_direct')}/{d['stats'].get('uploads')} "
                  f"greedy {d.get('greedy_equal_to_resident')}/{d.get('greedy_len')}")
        if r.get("engine"):
            print("  engine", {k: v for k, v in r["engine"].items() if k != "moe"})
        for key, d in r.get("prefill", {}).items():
            print(f"  prefill {key}: {d['tok_s']:.0f} tok/s roofline {d.get('pcie_roofline_tok_s', 0):.0f}")
