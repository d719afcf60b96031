"""Time the dense decode projections on cuBLAS (the call forms torch offers) and on the Triton skinny GEMM.

    python tools/bench_dense.py --out DIR [--quick] [--tokens 1,8]   # writes DIR/bench_dense.json, one line per row

At decode a dense linear is a GEMV (T = 1) or a skinny GEMM (T = 8) that should stream its bf16 weight at HBM speed;
cuBLAS picks its kernel by the call's shape and layout, e.g. split-K plus a reduce kernel for `F.linear` of
[1, 4096] x [2048, 4096]^T. Forms timed for the projections of the two target models:
  linear   F.linear(x, W)                          (what the layers call)
  mv       torch.mv(W, x[0])                       (T = 1 only)
  wx       (W @ x.T).T                              (the transposed problem: weight as the left operand)
  triton   dense_gemv(x, W)                         (gpu/kernels/dense_gemv.py with its TILES; `tiles` in the row)
Each call reads a different copy of W (copies cycle through more than the 50 MB L2) inside one captured CUDA graph;
us is per call, `hbm_frac` the weight bytes per us over the HBM read rate measured here.
Without --quick dense_gemv is also timed over `SWEEP` (FMA and tensor-core tiles; configurations whose launched tiles
coincide are timed once): the JSON's "sweep" holds every timing, "best" the fastest tiles per shape and T, each
printed against the default tiles and F.linear.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import graph_us, hbm_read_gbs

# (name, out, in): qwen3moe-35b-geom and qwen3.6-35b-a3b decoder projections (hidden 2048)
SHAPES = [("qkv_proj geom", 5120, 2048), ("o_proj geom", 2048, 4096), ("router", 256, 2048),
          ("in_proj_qkvz", 12288, 2048), ("in_proj_ba", 64, 2048), ("out_proj", 2048, 4096),
          ("qkv_proj 3.6 gated", 9216, 2048), ("o_proj 3.6", 2048, 4096), ("shared gate_up", 1024, 2048),
          ("shared down", 2048, 512), ("lm_head geom", 151936, 2048), ("lm_head 3.6", 248320, 2048)]
L2_BYTES = 128 << 20  # weight copies per shape: at least this many bytes, so every call reads HBM
TOKENS = (1, 8)  # default --tokens
# dense_gemv tiles swept (each over the default entry for T; FMA BLOCK_K is capped by acc_elems, see launch_tiles)
SWEEP = ([{"DOT": False, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "acc_elems": acc, "num_stages": 2}
          for bn, bk, nw, acc in itertools.product((1, 2, 4, 8, 16), (512, 2048), (2, 4, 8), (8192, 16384))]
         + [{"DOT": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}     # num_warps 0: TILES'
            for bn, bk, nw, ns in itertools.product((8, 16, 32, 64), (128, 256, 512), (0, 4), (3, 4))])


def forms(T: int):
    from ft.runtime.gpu.kernels.dense_gemv import dense_gemv

    yield "linear", lambda x, w: F.linear(x, w)
    if T == 1:
        yield "mv", lambda x, w: torch.mv(w, x[0]).unsqueeze(0)
    yield "wx", lambda x, w: (w @ x.T).T
    yield "triton", lambda x, w: dense_gemv(x, w)


def sweep(name, n, k, T, x, ws, want, hbm) -> list[dict]:
    """dense_gemv over SWEEP for one shape and T -> rows {shape, N, K, T, tiles (as launched), us, hbm_frac,
    max_abs_diff}, one per distinct launched tiles."""
    from ft.runtime.gpu.kernels.dense_gemv import dense_gemv, launch_tiles

    rows, seen = [], set()
    for cfg in SWEEP:
        tiles = launch_tiles(n, k, T, cfg)
        key = tuple(tiles.values())
        if key in seen:
            continue
        seen.add(key)
        try:
            diff = float((dense_gemv(x, ws[0], tiles=cfg).float() - want).abs().max())
            us = graph_us([lambda w=w, c=cfg: dense_gemv(x, w, tiles=c) for w in ws], reps=len(ws))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile: skip it, say so
            print(f"  {tiles}: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows.append({"shape": name, "N": n, "K": k, "T": T, "tiles": tiles, "us": round(us, 2),
                     "hbm_frac": round(n * k * 2 / us / 1e3 / hbm, 3), "max_abs_diff": diff})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="dense_gemv with its default tiles only, no sweep")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts T, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dense: no CUDA device here; nothing to time")
    args.out.mkdir(parents=True, exist_ok=True)
    hbm = hbm_read_gbs()
    print(f"HBM read {hbm:.0f} GB/s")
    from ft.runtime.gpu.kernels.dense_gemv import TILES, launch_tiles

    rows, swept, best = [], [], []
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-L2_BYTES // nbytes))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        for T in map(int, args.tokens.split(",")):
            x = torch.randn(T, k, dtype=torch.bfloat16, device="cuda")
            want = F.linear(x, ws[0]).float()
            us_of = {}
            for form, fn in forms(T):
                diff = float((fn(x, ws[0]).float() - want).abs().max())
                us = us_of[form] = graph_us([lambda w=w, fn=fn, x=x: fn(x, w) for w in ws], reps=len(ws))
                row = {"shape": name, "N": n, "K": k, "T": T, "form": form, "us": round(us, 2),
                       "hbm_frac": round(nbytes / us / 1e3 / hbm, 3), "max_abs_diff": diff}
                if form == "triton":
                    row["tiles"] = launch_tiles(n, k, T)
                rows.append(row)
                print(f"{name:20s} [{n:6d},{k:5d}] T={T} {form:6s} {us:7.2f} us {100 * row['hbm_frac']:5.1f}% HBM"
                      f"  max|d| {diff:.3g}")
            if args.quick:
                continue
            part = sweep(name, n, k, T, x, ws, want, hbm)
            swept += part
            if part:
                b = min(part, key=lambda r: r["us"])
                best.append({**b, "default_us": round(us_of["triton"], 2), "linear_us": round(us_of["linear"], 2)})
                print(f"{name:20s} [{n:6d},{k:5d}] T={T} best   {b['us']:7.2f} us {100 * b['hbm_frac']:5.1f}% HBM"
                      f"  {b['tiles']}")
        del ws
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "hbm_read_gbs": round(hbm, 1),
           "default_tiles": TILES, "rows": rows, "best": best, "sweep": swept}
    (args.out / "bench_dense.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
