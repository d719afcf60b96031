"""Time the one-launch decode router (`ft.runtime.gpu.kernels.router.router_topk`) against the launches it replaces.

    python tools/bench_router.py --out DIR [--quick]   # writes DIR/bench_router.json, prints one line per row

Shapes of the target models' MoE layers at decode: x [T, 2048] bf16 for T = 1, 8, router [256, 2048], top-8 with
renorm, with and without the shared expert gate [1, 2048]. `fused` is router_topk with `TILES`; `torch` is the path
it replaces: F.linear (cuBLAS) + `fused_ops.route_topk` (+ F.linear for the shared gate), two or three launches.

The sigmoid routers of glm4_moe / glm_moe_dsa (`SIGMOID_SHAPES`: GLM-4.5-Air, GLM-4.5, GLM-5 and a grouped
DeepSeek-V3-style one) are timed as `sigmoid` rows: router_topk with a `SigmoidRoute` against the torch ops the layer
ran before (fp32 F.linear + `route_sigmoid`, about 15 launches) and the prefill path (fp32 F.linear + the selection).

Timing as in tools/bench_fused_ops.py: `REPS` back-to-back calls captured in one CUDA graph, replayed; us is the
median replay time / REPS. `gbs` counts the bytes moved at least (weights and x read once, outputs written once) and
`hbm_frac` is that rate over the HBM read rate measured here. Every row carries `max_abs_diff` (routing weights) and
`ids_equal` (fraction of ids equal) against `router_topk_ref` (ids may differ where bf16 logits tie or where a
logit's rounding differs by the summation order). Without --quick the fused kernel is also timed over BLOCK_E x
BLOCK_K x num_warps (`SWEEP`; configurations whose launched tiles coincide are timed once) and the best per case and
per T (least total us with and without the shared gate; `router.TILES` is one entry for every T) are reported.
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
from gpu_timing import graph_us as timed, hbm_read_gbs  # noqa: E402

REPS = 20           # calls per captured graph
HIDDEN, EXPERTS, TOP_K = 2048, 256, 8
TOKENS = (1, 8)
SWEEP = {"BLOCK_E": (2, 4, 8), "BLOCK_K": (256, 512, 1024, 2048), "num_warps": (1, 2, 4, 8)}


def graph_us(fn) -> float:
    return timed([fn], reps=REPS)


def cases():
    """(T, extra?, bytes moved, inputs (x, weight, extra or None)) for each decode shape."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(EXPERTS, HIDDEN, generator=g, **bf) * 0.02
    gate = torch.randn(1, HIDDEN, generator=g, **bf) * 0.02
    for T in TOKENS:
        x = torch.randn(T, HIDDEN, generator=g, **bf)
        for extra in (None, gate):
            rows = EXPERTS + (extra is not None)
            nbytes = (rows + T) * HIDDEN * 2 + T * TOP_K * 12 + (0 if extra is None else T * 2)
            yield T, extra is not None, nbytes, (x, weight, extra)


# the sigmoid routers (glm4_moe, glm_moe_dsa): (name, E, H, k, n_group, topk_group), top-k renormalised, bias on
SIGMOID_SHAPES = (("GLM-4.5-Air", 128, 4096, 8, 1, 1), ("GLM-4.5", 160, 5120, 8, 1, 1), ("GLM-5", 256, 6144, 8, 1, 1),
                  ("grouped 8/4", 256, 7168, 8, 8, 4))


def sigmoid_rows(hbm: float) -> list[dict]:
    """The sigmoid router at T = 1 and 8: `fused` (router_topk, one launch), `select` (F.linear in fp32 + the
    selection kernel, the prefill path) and `torch` (F.linear in fp32 + route_sigmoid: the layer's path before)."""
    from ft.runtime.gpu.kernels import fused_ops, router
    from ft.runtime.gpu.kernels.sigmoid_topk import SigmoidRoute
    from ft.runtime.layers.moe import route_sigmoid

    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for name, E, H, k, ng, tg in SIGMOID_SHAPES:
        weight = torch.randn(E, H, generator=g, device="cuda").to(torch.bfloat16) * 0.02
        how = SigmoidRoute(torch.randn(E, generator=g, device="cuda") * 0.01, ng, tg, 2.5)
        for T in TOKENS:
            x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
            want = router.router_topk_ref(x, weight, k, True, sigmoid=how)
            logits = lambda: F.linear(x.float(), weight.float())  # noqa: E731
            impls = {"fused": lambda: router.router_topk(x, weight, k, True, sigmoid=how),
                     "select": lambda: fused_ops.route_topk(logits(), k, True, how),
                     "torch": lambda: route_sigmoid(logits(), how.bias, k, ng, tg, True, how.scale)}
            nbytes = (E + T) * H * 2 + T * k * 12
            if ng > 1:  # torch's group mask (repeat_interleave of a count) syncs: it cannot be captured
                del impls["torch"]
            for impl, fn in impls.items():
                us = graph_us(fn)
                got = fn()
                order, ref_order = got[0].argsort(-1), want[0].argsort(-1)   # compare as sets per token
                acc = accuracy((got[0].gather(1, order), got[1].gather(1, order)),
                               (want[0].gather(1, ref_order), want[1].gather(1, ref_order)))
                rows.append({"model": name, "E": E, "H": H, "k": k, "n_group": ng, "topk_group": tg, "T": T,
                             "impl": impl, "us": round(us, 2), "hbm_frac": round(nbytes / us / 1e3 / hbm, 4), **acc})
                print(f"sigmoid {name:12s} T={T} {impl:6s} {us:7.2f} us ({100 * rows[-1]['hbm_frac']:5.1f}% HBM)"
                      f"  max|dw| {acc['max_abs_diff']:.3g}  ids_equal {acc['ids_equal']:.3f}")
    return rows


def torch_path(x, weight, extra):
    from ft.runtime.gpu.kernels import fused_ops

    ids, wts = fused_ops.route_topk(F.linear(x, weight), TOP_K, True)
    return ids, wts, None if extra is None else F.linear(x, extra)


def accuracy(got, want) -> dict:
    return {"max_abs_diff": float((got[1] - want[1]).abs().max()),
            "ids_equal": round(float((got[0] == want[0]).float().mean()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the default tiles only, no sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_router: needs a CUDA device (none found)")
    from ft.runtime.gpu.kernels import router

    args.out.mkdir(parents=True, exist_ok=True)
    hbm = hbm_read_gbs()
    print(f"HBM read {hbm:.0f} GB/s; default tiles {router.TILES}")
    rows, sweep = [], []
    for T, has_extra, nbytes, (x, weight, extra) in cases():
        want = router.router_topk_ref(x, weight, TOP_K, True, extra)
        impls = {"fused": lambda: router.router_topk(x, weight, TOP_K, True, extra),
                 "torch": lambda: torch_path(x, weight, extra)}
        for impl, fn in impls.items():
            us = graph_us(fn)
            row = {"T": T, "extra": has_extra, "impl": impl, "us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1),
                   "hbm_frac": round(nbytes / us / 1e3 / hbm, 4), **accuracy(fn(), want)}
            if impl == "fused":
                row["tiles"] = router.launch_tiles(HIDDEN)
            rows.append(row)
            print(f"T={T} extra={int(has_extra)} {impl:5s} {us:7.2f} us {row['gbs']:7.1f} GB/s"
                  f" ({100 * row['hbm_frac']:5.1f}% HBM)  max|dw| {row['max_abs_diff']:.3g}"
                  f"  ids_equal {row['ids_equal']:.3f}")
        if args.quick:
            continue
        seen = set()
        for be, bk, nw in itertools.product(*SWEEP.values()):
            tiles = router.launch_tiles(HIDDEN, {"BLOCK_E": be, "BLOCK_K": bk, "num_warps": nw})
            key = (tiles["BLOCK_E"], tiles["BLOCK_K"], tiles["num_warps"])
            if key in seen:
                continue
            seen.add(key)
            fn = lambda: router.router_topk(x, weight, TOP_K, True, extra, tiles=tiles)  # noqa: E731
            acc = accuracy(fn(), want)
            sweep.append({"T": T, "extra": has_extra, "tiles": dict(zip(("BLOCK_E", "BLOCK_K", "num_warps"), key)),
                          "us": round(graph_us(fn), 2), **acc})
        best = min((s for s in sweep if s["T"] == T and s["extra"] == has_extra), key=lambda s: s["us"])
        print(f"T={T} extra={int(has_extra)} best  {best['us']:7.2f} us  {best['tiles']}")
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "hbm_read_gbs": round(hbm, 1),
           "reps_per_graph": REPS, "default_tiles": router.TILES, "rows": rows, "sweep": sweep,
           "sigmoid": sigmoid_rows(hbm)}
    if sweep:  # per T, the launched tiles with the least total us over the cases with and without the shared gate
        out["best_per_T"] = {}
        for T in TOKENS:
            totals = {}
            for s in sweep:
                if s["T"] == T:
                    key = tuple(s["tiles"].values())
                    totals[key] = totals.get(key, 0.0) + s["us"]
            key, total = min(totals.items(), key=lambda kv: kv[1])
            out["best_per_T"][T] = {**dict(zip(("BLOCK_E", "BLOCK_K", "num_warps"), key)), "total_us": round(total, 2)}
            print(f"T={T} best tiles {out['best_per_T'][T]}")
    path = args.out / "bench_router.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
