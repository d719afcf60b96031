"""Time the fused elementwise kernels (`ft.runtime.gpu.kernels.fused_ops`) against the PyTorch ops they replace.

    python tools/bench_fused_ops.py --out DIR        # writes DIR/bench_fused_ops.json, prints one line per row

Shapes of the target models' decoder layers (hidden 2048, bf16): the layer norms and residual add+norm [T, 2048],
the q/k norm over 32 heads of 128 read in place from a qkv split, routing over 256 experts top-8 with renorm, the
shared expert's SiLU*mul [T, 1024] -> [T, 512] and its sigmoid-gated add, for T = 1, 8 (decode) and 4096 (prefill).

Each op is timed as decode runs it: `REPS` back-to-back calls captured in one CUDA graph, replayed; us is the
median replay time / REPS (launch gaps inside a graph included, host launch cost not). `gbs` counts the bytes the op
must move at least (inputs read once, outputs written once) and `hbm_frac` is that rate over the HBM read rate
measured here (a large bf16 reduction). Each fused row also carries `max_abs_diff` to the torch reference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import graph_us as timed, hbm_read_gbs  # noqa: E402

REPS = 20           # calls per captured graph
HIDDEN, HEADS, HEAD_DIM, KV_HEADS = 2048, 32, 128, 4
EXPERTS, TOP_K, SHARED_I = 256, 8, 512
TOKENS = (1, 8, 4096)


def graph_us(fn) -> float:
    return timed(fn if isinstance(fn, list) else [fn], reps=REPS)


def _diff(a, b) -> float:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def cases(T: int):
    """(op, shape text, bytes moved, fused fn, reference fn) for T tokens."""
    from ft.runtime.gpu.kernels import fused_ops as fo

    g = torch.Generator(device="cuda").manual_seed(T)
    bf = dict(dtype=torch.bfloat16, device="cuda")

    def rand(*shape, **kw):
        return torch.randn(*shape, generator=g, **(kw or bf))

    x, delta, w = rand(T, HIDDEN), rand(T, HIDDEN), rand(HIDDEN, dtype=torch.float32, device="cuda")
    qkv = rand(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, : HEADS * HEAD_DIM].view(T, HEADS, HEAD_DIM)
    wq = rand(HEAD_DIM, dtype=torch.float32, device="cuda")
    logits = rand(T, EXPERTS)
    gate_up, gate = rand(T, 2 * SHARED_I), rand(T, 1)
    b = 2  # bytes per bf16 element
    yield ("rms_norm", f"[{T},{HIDDEN}]", 2 * T * HIDDEN * b + HIDDEN * 4,
           lambda: fo.rms_norm(x, w, 1e-6), lambda: fo.rms_norm_ref(x, w, 1e-6))
    yield ("add_rms_norm", f"[{T},{HIDDEN}]", 4 * T * HIDDEN * b + HIDDEN * 4,
           lambda: fo.add_rms_norm(x, delta, w, 1e-6), lambda: fo.add_rms_norm_ref(x, delta, w, 1e-6))
    yield ("rms_norm_heads", f"[{T},{HEADS},{HEAD_DIM}] strided", 2 * T * HEADS * HEAD_DIM * b,
           lambda: fo.rms_norm(q, wq, 1e-6), lambda: fo.rms_norm_ref(q, wq, 1e-6))
    yield ("route_topk", f"[{T},{EXPERTS}] k={TOP_K}", T * EXPERTS * b + T * TOP_K * 12,
           lambda: fo.route_topk(logits, TOP_K, True), lambda: fo.route_topk_ref(logits, TOP_K, True))
    yield ("silu_mul", f"[{T},{2 * SHARED_I}]", 3 * T * SHARED_I * b,
           lambda: fo.silu_mul(gate_up), lambda: fo.silu_mul_ref(gate_up))
    yield ("sigmoid_gate_add", f"[{T},{HIDDEN}]", 3 * T * HIDDEN * b + T * b,
           lambda: fo.sigmoid_gate_add(x, gate, delta), lambda: fo.sigmoid_gate_add_ref(x, gate, delta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fused_ops: no CUDA device here; nothing to time")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    hbm = hbm_read_gbs()
    print(f"HBM read {hbm:.0f} GB/s")
    rows = []
    for T in TOKENS:
        for op, shape, nbytes, fused, ref in cases(T):
            got, want = fused(), ref()
            diff = _diff(got[1], want[1]) if op == "route_topk" else _diff(got, want)  # route: ids may differ in ties
            for impl, fn in (("fused", fused), ("torch", ref)):
                us = graph_us(fn)
                row = {"op": op, "T": T, "shape": shape, "impl": impl, "us": round(us, 2),
                       "gbs": round(nbytes / us / 1e3, 1), "hbm_frac": round(nbytes / us / 1e3 / hbm, 4)}
                if impl == "fused":
                    row["max_abs_diff"] = diff
                rows.append(row)
                print(f"{op:17s} T={T:<5d} {shape:28s} {impl:5s} {us:8.2f} us {row['gbs']:8.1f} GB/s"
                      f" ({100 * row['hbm_frac']:5.1f}% HBM)" + (f"  max|d| {diff:.3g}" if impl == "fused" else ""))
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "hbm_read_gbs": round(hbm, 1),
           "reps_per_graph": REPS, "rows": rows}
    path = args.out / "bench_fused_ops.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
