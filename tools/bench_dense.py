"""Time the dense decode projections on cuBLAS (the call forms torch offers) and on the Triton skinny GEMM.

    python tools/bench_dense.py --out DIR [--quick] [--tokens 1,8] [--shapes NAMES] [--quantized-only]
                                [--quant-tiles 'R,BKW,WARPS;...'] [--mma ['BN,BK,WARPS;...']]
                                                                      # writes DIR/bench_dense.json, one line per row
    python tools/bench_dense.py --compile-only [ARCH] [--quick]       # any machine: the quantized GEMV for sm_ARCH

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

The JSON's "quantized" rows time the dequantizing GEMV of linears kept quantized (`gpu/kernels/dense_quant.py`,
`--dense-weights quantized`) on the stored formats of the two models' releases (`QUANT_SHAPES`), with its TILES and,
without --quick, over `QUANT_SWEEP`; `hbm_frac` counts the stored bytes (codes and scales), `bf16_us` is the
dense_gemv row of the same shape, the time the default (dequantized) placement spends. Its "dequant_rows" rows time
the prefill side of kept-quantized linears: the whole weight dequantized to bf16 by `gpu/kernels/dense_dequant.py`
against the PyTorch ops (`ft.formats.quant`) it replaced. `--mma` adds "quantized_mma" rows: the tensor-core product
of the same stored weights (`gpu/kernels/dense_quant_mma.py`, which `Linear` runs from `rows_from` rows of x) with
its TILES and the tiles given, each checked against the same fp32 reference.
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

# (name, scheme, out, in): the linears the releases store quantized (geom: NVFP4 attention as nvidia/Qwen3-30B-A3B-FP4;
# qwen3.6: FP8 attention / DeltaNet projections, NVFP4 shared expert and LM head as nvidia/Qwen3.6-35B-A3B-NVFP4)
QUANT_SHAPES = [("qkv_proj geom", "nvfp4", 5120, 2048), ("o_proj geom", "nvfp4", 2048, 4096),
                ("in_proj_qkvz", "fp8_row", 12288, 2048), ("out_proj", "fp8_row", 2048, 4096),
                ("qkv_proj 3.6 gated", "fp8_row", 9216, 2048), ("o_proj 3.6", "fp8_row", 2048, 4096),
                ("shared gate_up", "nvfp4", 1024, 2048), ("shared down", "nvfp4", 2048, 512),
                ("lm_head 3.6", "nvfp4", 248320, 2048)]
QUANT_SWEEP = [{"R": r, "BKW": b, "num_warps": w}
               for r, b, w in itertools.product((2, 4, 8, 16), (32, 64, 128, 256, 512), (4, 8))]


def quantized_weights(scheme: str, n: int, k: int, copies: int, device) -> list[tuple]:
    """`copies` random stored weights (weight, weight_scale, weight_scale_2) as `Linear` keeps them on the device."""
    out = []
    for _ in range(copies):
        if scheme == "nvfp4":  # codes and scales in one allocation, codes first
            buf = torch.randint(0, 256, (n * k // 2 + n * k // 16,), dtype=torch.uint8, device=device)
            scales = buf[n * k // 2:].view(torch.float8_e4m3fn)
            scales.copy_((torch.rand(scales.shape, device=device) + 0.5).to(torch.float8_e4m3fn))
            out.append((buf[:n * k // 2].view(n, k // 2), scales.view(n, k // 16),
                        torch.full((1,), 0.003, device=device)))
        else:
            w = (torch.randn(n, k, device=device) * 8).to(torch.float8_e4m3fn)
            out.append((w, torch.rand(n, device=device) * 0.01, None))
    return out


def quantized(shapes, tokens, hbm: float, *, sweep: bool, device="cuda", time_us=None,
              l2_bytes: int = L2_BYTES, configs: list[dict] | None = None, mma: bool = False,
              log=lambda line: None) -> list[dict]:
    """The dequantizing GEMV per shape and T (TILES, then `configs` (default QUANT_SWEEP) if `sweep`) -> rows {shape,
    scheme, N, K, T, tiles, us, hbm_frac, max_rel_diff (against the fp32 reference), default}; `mma`: the tensor-core
    product (`dense_quant_mma`) instead, its TILES then `configs`. `time_us(fns)`: us per call (graph_us; tests pass a
    stand-in), over weight copies of at least `l2_bytes` together; `log` gets a line per row as it is timed (a long
    sweep killed at its deadline still shows what it measured)."""
    from ft.runtime.gpu.kernels import dense_quant_mma
    from ft.runtime.gpu.kernels.dense_quant import quantized_gemv, reference_linear, tiles_for

    run = dense_quant_mma.quantized_mma if mma else quantized_gemv
    time_us = time_us or (lambda fns: graph_us(fns, reps=len(fns)))
    rows = []
    for name, scheme, n, k in shapes:
        stored = n * k // 2 + n * k // 16 if scheme == "nvfp4" else n * k
        ws = quantized_weights(scheme, n, k, max(2, -(-l2_bytes // stored)), device)
        for T in tokens:
            x = torch.randn(T, k, device=device).to(torch.bfloat16)
            want = reference_linear(scheme, x.cpu(), *(t.cpu() if t is not None else None for t in ws[0]))
            base = dense_quant_mma.TILES[scheme] if mma else tiles_for(scheme, T)
            for cfg in [None] + ((configs or ([] if mma else QUANT_SWEEP)) if sweep else []):
                try:
                    got = run(scheme, x, *ws[0], tiles=cfg).float().cpu()
                    us = time_us([lambda w=w, c=cfg: run(scheme, x, *w, tiles=c) for w in ws])
                except Exception as e:  # noqa: BLE001 - e.g. too many registers for a large tile: skip it, say so
                    print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows.append({"shape": name, "scheme": scheme, "N": n, "K": k, "T": T,
                             "tiles": {**base, **(cfg or {})}, "us": round(us, 2),
                             "hbm_frac": round(stored / us / 1e3 / hbm, 3), "default": cfg is None,
                             "max_rel_diff": float((got - want).abs().max() / want.abs().max())})
                r = rows[-1]
                log(f"{name:20s} {scheme:7s} T={T}{' mma' if mma else ''} {r['us']:7.2f} us "
                    f"{100 * r['hbm_frac']:5.1f}% HBM  {r['tiles']}")
        del ws
    return rows


def dequant_rows(shapes, hbm: float, *, device="cuda", time_us=None, log=lambda line: None) -> list[dict]:
    """A kept-quantized linear's prefill dequantization per shape: the whole weight into bf16 by
    `dense_dequant.dequantize_rows` (one launch) and by the PyTorch ops it replaced (`ft.formats.quant`'s exact
    dequantization, then the cast) -> rows {shape, scheme, N, K, kernel_us, torch_us, hbm_frac (bytes read and
    written by the kernel over the HBM rate)}."""
    from ft.formats.quant import fp8, nvfp4
    from ft.runtime.gpu.kernels.dense_dequant import dequantize_rows

    time_us = time_us or (lambda fns: graph_us(fns, reps=len(fns)))
    rows = []
    for name, scheme, n, k in shapes:
        ws = quantized_weights(scheme, n, k, 1, device)[0]
        stored = n * k // 2 + n * k // 16 if scheme == "nvfp4" else n * k
        exact = nvfp4.dequantize if scheme == "nvfp4" else lambda w, s, _: fp8.dequantize(w, s)
        kernel_us = time_us([lambda ws=ws: dequantize_rows(scheme, *ws, 0, n, torch.bfloat16)])
        torch_us = time_us([lambda ws=ws: exact(*ws).to(torch.bfloat16)])
        moved = stored + 2 * n * k
        rows.append({"shape": name, "scheme": scheme, "N": n, "K": k, "kernel_us": round(kernel_us, 2),
                     "torch_us": round(torch_us, 2), "hbm_frac": round(moved / kernel_us / 1e3 / hbm, 3)})
        log(f"{name:20s} {scheme:7s} dequantize to bf16: kernel {kernel_us:8.2f} us "
            f"({100 * rows[-1]['hbm_frac']:5.1f}% HBM), PyTorch ops {torch_us:8.2f} us")
    return rows


def compile_quantized(shapes, tokens, arch: int, *, sweep: bool, log=print) -> list[dict]:
    """The dequantizing GEMV built for sm_<arch> with no GPU, per distinct (scheme, K), T and tile config: registers,
    spill bytes and SASS instructions per weight (`moe_decode_compile.sass_stats`; the whole K is unrolled, so the
    static count is what a program executes)."""
    from moe_decode_compile import fmt_row, sass_stats

    from ft.runtime.gpu.kernels import dense_quant as dq

    rows = []
    for scheme, k in dict.fromkeys((sc, k) for _, sc, _, k in shapes):
        for T in tokens:
            for cfg in [None] + (QUANT_SWEEP if sweep else []):
                consts = dict(dq.launch_consts(scheme, k, T, cfg), ASM=True, XBF16=True, PDL=True)
                warps = consts.pop("num_warps")
                tile = {"R": consts["R"], "BKW": consts["BKW"], "num_warps": warps}  # as launched
                if scheme == "nvfp4":
                    fn, consts = dq._nvfp4_gemv_kernel, dict(consts, S2_PER_ROW=False)
                    values = dict(w="*u8", OFF_S=16, s2="*fp32", x="*bf16", out="*bf16", N=4096, T=T)
                else:
                    fn = dq._fp8_rows_gemv_kernel
                    values = dict(w="*u8", scale="*fp32", x="*bf16", out="*bf16", N=4096, T=T)
                row = {"scheme": scheme, "K": k, "T": T, "tiles": tile, "arch": arch}
                try:
                    st = sass_stats(fn, values, consts, warps, arch)
                    row.update(regs=st["regs"], stack=st["stack"],
                               instr_per_weight=round(st["instructions"] * warps * 32 / (consts["R"] * k), 2))
                except Exception as e:  # noqa: BLE001 - report every config
                    row["error"] = f"{type(e).__name__}: {e}"[-400:]
                rows.append(row)
                log(fmt_row({**row, **{f"t_{a}": b for a, b in tile.items()}}))
    return rows


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
    ap.add_argument("--out", type=Path, help="directory for bench_dense.json (required unless --compile-only)")
    ap.add_argument("--quick", action="store_true", help="dense_gemv with its default tiles only, no sweep")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts T, comma-separated")
    ap.add_argument("--compile-only", type=int, nargs="?", const=90, metavar="ARCH",
                    help="build the quantized GEMV's configs for sm_ARCH (no GPU needed) and print their SASS figures")
    ap.add_argument("--shapes", help="only these shapes (comma-separated names, e.g. 'qkv_proj geom,o_proj geom')")
    ap.add_argument("--quantized-only", action="store_true", help="only the quantized GEMV rows (no bf16 forms)")
    ap.add_argument("--quant-tiles", help="sweep these quantized tiles instead of QUANT_SWEEP: 'R,BKW,WARPS;...'")
    ap.add_argument("--mma", nargs="?", const="", metavar="'BN,BK,WARPS;...'",
                    help="also time the tensor-core product of the quantized shapes (its TILES, then these tiles)")
    args = ap.parse_args()
    shapes, quant_shapes = SHAPES, QUANT_SHAPES
    if args.shapes:
        names = {n.strip() for n in args.shapes.split(",")}
        unknown = names - {s[0] for s in SHAPES + QUANT_SHAPES}
        if unknown:
            raise SystemExit(f"bench_dense: unknown shapes {sorted(unknown)}")
        shapes = [s for s in SHAPES if s[0] in names]
        quant_shapes = [s for s in QUANT_SHAPES if s[0] in names]
    if args.quantized_only:
        shapes = []
    if args.compile_only:
        compile_quantized(quant_shapes, list(map(int, args.tokens.split(","))), args.compile_only,
                          sweep=not args.quick)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_dense: no CUDA device here; nothing to time (--compile-only builds without one)")
    if args.out is None:
        raise SystemExit("bench_dense: --out DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    hbm = hbm_read_gbs()
    print(f"HBM read {hbm:.0f} GB/s")
    from ft.runtime.gpu.kernels.dense_gemv import TILES, launch_tiles

    rows, swept, best = [], [], []
    for name, n, k in shapes:
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
    configs = [dict(zip(("R", "BKW", "num_warps"), map(int, c.split(",")))) for c in args.quant_tiles.split(";")] \
        if args.quant_tiles else None
    quant = quantized(quant_shapes, list(map(int, args.tokens.split(","))), hbm, sweep=not args.quick,
                      configs=configs, log=print)
    dequant = dequant_rows(quant_shapes, hbm, log=print)
    mma = [] if args.mma is None else quantized(
        quant_shapes, list(map(int, args.tokens.split(","))), hbm, sweep=True, mma=True, log=print,
        configs=[dict(zip(("BN", "BK", "num_warps"), map(int, c.split(",")))) for c in args.mma.split(";") if c])
    bf16_us = {(r["shape"], r["T"]): r["us"] for r in rows if r["form"] == "triton"}
    for r in quant:
        r["bf16_us"] = bf16_us.get((r["shape"], r["T"]))
    for r in (r for r in quant if r["default"]):
        fastest = min((q for q in quant if (q["shape"], q["T"]) == (r["shape"], r["T"])), key=lambda q: q["us"])
        print(f"{r['shape']:20s} {r['scheme']:7s} T={r['T']} {r['us']:7.2f} us {100 * r['hbm_frac']:5.1f}% HBM "
              f"(bf16 {r['bf16_us']} us; best {fastest['us']} us {fastest['tiles']})")
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "hbm_read_gbs": round(hbm, 1),
           "default_tiles": TILES, "rows": rows, "best": best, "sweep": swept, "quantized": quant,
           "dequant_rows": dequant, "quantized_mma": mma}
    (args.out / "bench_dense.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
