"""Summary lines printed at the end of tools/gpu_bench.py: per placement tok/s, hit rate, bytes per token, the
fraction of the Belady bound and the ratio to the static (llama.cpp --n-cpu-moe style) placement at the same budget;
prefill per length against the PCIe roofline; the engine's per-step split; the profile stage's per-path summary;
what the time plan skipped."""

from __future__ import annotations

import json


def print_summary(results: dict) -> None:
    print(json.dumps({k: v for k, v in results.items() if k in ("env", "tests", "stage_seconds", "errors")},
                     indent=1, default=str)[:6000])
    plan = results.get("time_plan") or {}
    if plan.get("skipped"):
        print("time plan skipped:", json.dumps(plan["skipped"], indent=1))
    if "bw" in results:
        print(json.dumps(results["bw"]["gbs"], indent=1))
    for row in results.get("kernel", []):
        print(row)
    for name, p in (results.get("profile") or {}).items():
        if isinstance(p, dict) and "ms_per_token" in p:
            tags = {t: d["cpu_ms"] for t, d in p.get("by_tag_per_token", {}).items()}
            print(f"profile {name:18s} {p['ms_per_token']:7.2f} ms/token (profiled {p['ms_per_token_profiled']:.2f}, "
                  f"device busy {p['device_busy_ms_per_token']:.2f}) tags ms {tags} syncs {p['syncs_per_token']}")
    for routing, r in results.get("e2e", {}).get("routings", {}).items():
        host = r.get("resident_host_planned", {})
        eager = r.get("resident_eager", {})
        print(routing, "logits", r.get("logits_vs_cpu"), "resident", round(r.get("resident", {}).get("tok_s", 0), 1),
              "graphs", r.get("resident", {}).get("graphs"), "eager", round(eager.get("tok_s", 0), 1),
              f"(greedy {eager.get('greedy_prefix_equal')}/{eager.get('greedy_len')})",
              "host-planned", round(host.get("tok_s", 0), 1), "greedy host-planned vs resident",
              f"{host.get('greedy_prefix_equal')}/{host.get('greedy_len')}")
        for key, d in r.get("decode", {}).items():
            b = d.get("bound") or {}
            static = r["decode"].get("static@" + key.split("@")[1], {}).get("tok_s")
            vs = f"{d['tok_s'] / static:.2f}x static" if static and not key.startswith("static") else ""
            print(f"  {key:20s} {d['tok_s']:7.1f} tok/s hit {d['stats']['hit_rate'] or 0:.2f} "
                  f"h2d {d.get('h2d_mb_per_token', 0):6.1f} MB/t cpu {d.get('cpu_mb_per_token', 0):6.1f} MB/t "
                  f"mapped {d.get('mapped_mb_per_token', 0):6.1f} MB/t "
                  f"bound {b.get('bound_tok_s', 0):7.1f} frac {b.get('fraction_of_bound', 0):.2f} {vs} "
                  f"direct {d['stats'].get('uploads_direct')}/{d['stats'].get('uploads')} "
                  f"greedy {d.get('greedy_prefix_equal')}/{d.get('greedy_len')} "
                  f"replays {(d.get('graphs') or {}).get('replays')}")
            if b.get("gap_ms"):
                print(f"  {'':20s} ms/token {d['ms_per_token']:.2f} = bound {b['bound_ms']:.2f} + "
                      + " + ".join(f"{k} {v:.2f}" for k, v in b["gap_ms"].items()))
        if r.get("engine"):
            print("  engine", {k: v for k, v in r["engine"].items() if k not in ("moe", "vram")})
        for key, d in r.get("prefill", {}).items():
            if key == "skipped":
                print(f"  prefill skipped: {d}")
                continue
            frac = f" = {d['fraction_of_roofline']:.2f} of the roofline" if "fraction_of_roofline" in d else ""
            print(f"  prefill {key:22s} {d['tok_s']:8.0f} tok/s, roofline {d.get('pcie_roofline_tok_s', 0):8.0f}{frac}")
