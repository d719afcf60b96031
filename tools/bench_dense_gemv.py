"""Time the decode GEMV for dense linears (`ft.runtime.gpu.dense_gemv`) against `F.linear` (cuBLAS).

    python tools/bench_dense_gemv.py --out DIR     # writes DIR/bench_dense_gemv.json; exits 0 without CUDA

Shapes of Qwen3.6's dense linears (bf16, [N, K]) at T = 1, 4, 8 rows. Each config of `dense_gemv.SWEEP` (plus the
table's pick) and F.linear is timed as decode runs it: `REPS` calls captured in one CUDA graph, each on its own copy
of the weight (so the weight comes from HBM, not L2), replayed; us = median replay / REPS. `gbs` counts the weight
bytes (x and y are negligible) and `hbm_frac` is that over the HBM read rate measured here. Prints the best config
per shape and T and whether it beats cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_ops import graph_us, hbm_read_gbs  # noqa: E402

REPS = 20
TOKENS = (1, 4, 8)
SHAPES = {  # name: (N, K)
    "qkv_proj": (5120, 2048), "o_proj": (2048, 4096), "router": (256, 2048), "lm_head": (151936, 2048),
    "gdn_in_proj_qkvz": (12288, 2048), "gdn_in_proj_ba": (64, 2048), "gdn_out_proj": (2048, 4096),
    "shared_gate_up": (1024, 2048), "shared_down": (2048, 512), "shared_expert_gate": (1, 2048),
    "attn_qkv_gate": (9216, 2048),
}
COPY_BYTES = 256 << 20  # distinct weight copies per shape: at least this many bytes (> L2), at most REPS copies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_dense_gemv: no CUDA device here; nothing to time")
        return 0
    from ft.runtime.gpu.dense_gemv import SWEEP, gemv, pick_config, reference

    args.out.mkdir(parents=True, exist_ok=True)
    hbm = hbm_read_gbs()
    print(f"HBM read {hbm:.0f} GB/s")
    rows, best = [], []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        nbytes = N * K * 2
        copies = max(1, min(REPS, -(-COPY_BYTES // nbytes)))
        g = torch.Generator(device="cuda").manual_seed(N + K)
        ws = [torch.randn(N, K, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for T in TOKENS:
            x = torch.randn(T, K, generator=g, device="cuda", dtype=torch.bfloat16)
            want = reference(x, ws[0])
            table = pick_config(N, K, torch.bfloat16)
            cands = [("cublas", None)] + [(f"gemv{c}", c) for c in dict.fromkeys([table, *SWEEP])]
            res = {}
            for impl, cfg in cands:
                if cfg is None:
                    it = iter(range(10**9))
                    fn = lambda: F.linear(x, ws[next(it) % copies])  # noqa: E731
                    diff = 0.0
                else:
                    try:
                        diff = float((gemv(x, ws[0], config=cfg).float() - want.float()).abs().max())
                    except Exception as e:  # noqa: BLE001 - a config that fails to build: report, go on
                        print(f"{name} T={T} {impl}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    it = iter(range(10**9))
                    fn = lambda cfg=cfg, it=it: gemv(x, ws[next(it) % copies], config=cfg)  # noqa: E731
                us = graph_us(fn)
                res[impl] = us
                row = {"shape": name, "N": N, "K": K, "T": T, "impl": impl, "config": cfg, "table": cfg == table,
                       "us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1),
                       "hbm_frac": round(nbytes / us / 1e3 / hbm, 4), "max_abs_diff": diff}
                rows.append(row)
                print(f"{name:19s} [{N},{K}] T={T} {impl:22s} {us:8.2f} us {row['gbs']:7.1f} GB/s "
                      f"({100 * row['hbm_frac']:5.1f}% HBM){' table' if row['table'] else ''}  max|d| {diff:.3g}")
            gem = {k: v for k, v in res.items() if k != "cublas"}
            if gem:
                k_best = min(gem, key=gem.get)
                b = {"shape": name, "T": T, "best": k_best, "us": round(gem[k_best], 2),
                     "cublas_us": round(res["cublas"], 2), "beats_cublas": gem[k_best] < res["cublas"],
                     "table_us": round(res.get(f"gemv{table}", float("nan")), 2)}
                best.append(b)
                print(f"  best {name} T={T}: {k_best} {b['us']} us vs cuBLAS {b['cublas_us']} us "
                      f"({'beats' if b['beats_cublas'] else 'loses to'} cuBLAS; table pick {b['table_us']} us)")
        del ws
        torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "hbm_read_gbs": round(hbm, 1),
           "reps_per_graph": REPS, "rows": rows, "best": best}
    path = args.out / "bench_dense_gemv.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
