"""Time the dense decode projections on cuBLAS in the call forms torch offers, to pick one per shape.

    python tools/bench_dense.py --out DIR        # writes DIR/bench_dense.json, prints one line per row

At decode a dense linear is a GEMV (T = 1) or a skinny GEMM (T = 8) that should stream its bf16 weight at HBM speed;
cuBLAS picks its kernel by the call's shape and layout, e.g. split-K plus a reduce kernel for `F.linear` of
[1, 4096] x [2048, 4096]^T. Forms timed for the projections of the two target models:
  linear   F.linear(x, W)                          (what the layers call)
  mv       torch.mv(W, x[0])                       (T = 1 only)
  wx       (W @ x.T).T                              (the transposed problem: weight as the left operand)
Each call reads a different copy of W (copies cycle through more than the 50 MB L2) inside one captured CUDA graph;
us is per call, `hbm_frac` the weight bytes per us over the HBM read rate measured here.
"""

from __future__ import annotations

import argparse
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
          ("shared down", 2048, 512)]
L2_BYTES = 128 << 20  # weight copies per shape: at least this many bytes, so every call reads HBM


def forms(T: int):
    yield "linear", lambda x, w: F.linear(x, w)
    if T == 1:
        yield "mv", lambda x, w: torch.mv(w, x[0]).unsqueeze(0)
    yield "wx", lambda x, w: (w @ x.T).T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dense: no CUDA device here; nothing to time")
    args.out.mkdir(parents=True, exist_ok=True)
    hbm = hbm_read_gbs()
    print(f"HBM read {hbm:.0f} GB/s")
    rows = []
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-L2_BYTES // nbytes))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        for T in (1, 8):
            x = torch.randn(T, k, dtype=torch.bfloat16, device="cuda")
            want = F.linear(x, ws[0]).float()
            for form, fn in forms(T):
                diff = float((fn(x, ws[0]).float() - want).abs().max())
                us = graph_us([lambda w=w, fn=fn, x=x: fn(x, w) for w in ws], reps=len(ws))
                row = {"shape": name, "N": n, "K": k, "T": T, "form": form, "us": round(us, 2),
                       "hbm_frac": round(nbytes / us / 1e3 / hbm, 3), "max_abs_diff": diff}
                rows.append(row)
                print(f"{name:20s} [{n:6d},{k:5d}] T={T} {form:6s} {us:7.2f} us {100 * row['hbm_frac']:5.1f}% HBM"
                      f"  max|d| {diff:.3g}")
        del ws
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "hbm_read_gbs": round(hbm, 1),
           "rows": rows}
    (args.out / "bench_dense.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
