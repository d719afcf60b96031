"""Resident NVFP4 MoE decode on one GPU: the device-planned kernels of `nvfp4_decode.py` per tile config.

    python tools/bench_moe_decode.py --out DIR [--tokens 1,2,4,8] [--configs grid | default] [--layers 40]
    python tools/bench_moe_decode.py --compile-only [ARCH] [--configs grid | default]   (any machine: sm_ARCH build)

Experts of Qwen3.6-35B-A3B / qwen3moe-35b-geom by default (hidden 2048, moe_intermediate 512, 256 experts, top-8).
The pool holds `--layers` x 256 random valid records (18 GB for 40) and a timed step makes one call per layer, each
with its own uniform top-8 routing and table, as a decode step does (a call's ~14 MB are not in L2 from the last).
Rows ("kernel"): "gate_up" / "down" (combine "tokens") alone per config of that kernel; "call", a whole
`moe_nvfp4_device` call with the default config, the best gate_up + best down config of this T, and the default with
combine "pairs" (rel_err against the PyTorch reference, deterministic: two calls bit-equal, graph_equal: replay
bit-equal to eager); "hbm", the HBM read rate measured here (torch sum / amax over 4 GiB).
us = per call: the step captured in one CUDA graph, median replay time / layers (launch gaps count as in a decode
graph); bytes = mean over calls of what the kernel must read (the unique routed experts' codes, scales, scale_2 of
its matrix); gbs = bytes / us; frac_hbm = gbs / hbm; regs / spills of the compiled kernel. Prints the best configs per
T and a suggested DECODE_BLOCKS; writes DIR/bench_moe_decode.json ({"meta", "rows", "suggested"}); exits with a
message where CUDA is missing. --compile-only builds each config for sm_ARCH with no GPU and prints regs, stack
(spill) bytes, STS count (a tile staged through shared memory shows as hundreds) and SASS instructions per weight.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import capture, hbm_read_gbs  # noqa: E402
from gpu_timing import graph_us as replay_us  # noqa: E402
from moe_decode_compile import compile_configs, fmt_row  # noqa: E402

# swept tile configs (`DECODE_BLOCKS` keys); the excluded ones spill registers on sm_90
GU_GRID = [dict(BLOCK_N_GU=n, BLOCK_K_GU=k, WARPS_GU=w)
           for n, k, w in itertools.product((4, 8, 16), (512, 2048), (2, 4, 8))
           if not (w == 2 and (n == 16 or (n, k) == (8, 512))) and (n, k, w) != (16, 512, 4)]
D_GRID = [dict(BLOCK_N_D=n, BLOCK_K_D=k, WARPS_D=w)
          for n, k, w in itertools.product((4, 8, 16), (256, 512), (2, 4, 8)) if not (w == 2 and n == 16)]
# tensor-core kernel: each kernel's tiles swept with the other kernel's left at MMA_BLOCKS (one at a time)
MMA_GU = [dict(BN_GU=n, BK_GU=k, WARPS_GU=w, STAGES_GU=s)
          for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (2, 3, 4))]
MMA_D = [dict(BN_D=n, BK_D=k, WARPS_D=w, STAGES_D=s)
         for n, k, w, s in itertools.product((32, 64, 128), (64, 128, 256, 512), (2, 4), (2, 3))]
COMPONENTS = {kn: (kn, kn + "_scale", kn + "_scale_2") for kn in ("gate_up", "down")}  # bytes each kernel reads


def _name(cfg: dict) -> str:
    return "-".join(f"{k.split('_')[1].lower()}{v}" if k.startswith("BLOCK") else f"w{v}" for k, v in cfg.items())


def _mma_name(cfg: dict) -> str:
    return "gu{BN_GU}k{BK_GU}w{WARPS_GU}s{STAGES_GU}-d{BN_D}k{BK_D}w{WARPS_D}s{STAGES_D}".format(**cfg)


def _mma_configs(which: str) -> list[dict]:
    from ft.runtime.gpu.kernels.nvfp4_decode_mma import MMA_BLOCKS

    grid = [dict(MMA_BLOCKS)] + [{**MMA_BLOCKS, **v} for v in MMA_GU + MMA_D]  # the default first, once
    return {"grid": list({_mma_name(c): c for c in grid}.values()), "default": [dict(MMA_BLOCKS)], "none": []}[which]


def _configs(which: str) -> tuple[dict, dict]:
    from ft.runtime.gpu.kernels.nvfp4_decode import DECODE_BLOCKS

    if which == "default":
        gu = [{k: DECODE_BLOCKS[k] for k in ("BLOCK_N_GU", "BLOCK_K_GU", "WARPS_GU")}]
        dn = [{k: DECODE_BLOCKS[k] for k in ("BLOCK_N_D", "BLOCK_K_D", "WARPS_D")}]
    else:
        gu, dn = GU_GRID, D_GRID
    return {_name(c): c for c in gu}, {_name(c): c for c in dn}


def make_pool(layout, slots: int, seed: int, dev) -> torch.Tensor:
    """u8 [slots, stride] valid random records made on the device: random codes, e4m3 scales 2^[-8, -2], scale_2
    in [0.005, 0.015]."""
    g = torch.Generator(device=dev).manual_seed(seed)
    pool = torch.randint(0, 256, (slots, layout.stride), dtype=torch.uint8, device=dev, generator=g)
    for s0 in range(0, slots, 256):
        part = pool[s0:s0 + 256]
        for name in ("gate_up_scale", "down_scale", "gate_up_scale_2", "down_scale_2"):
            off, n = getattr(layout, "off_" + name), layout.nbytes(name)
            if name.endswith("_2"):
                vals = (torch.rand(part.shape[0], n // 4, device=dev, generator=g) * 0.01 + 0.005).view(torch.uint8)
            else:
                vals = torch.exp2(torch.rand(part.shape[0], n, device=dev, generator=g) * 6 - 8)
                vals = vals.to(torch.float8_e4m3fn).view(torch.uint8)
            part[:, off:off + n] = vals
    return pool


def graph_us(fn, calls: int, reps: int = 20) -> float:
    """fn() (running `calls` calls) captured in one CUDA graph; median replay time in us / calls."""
    return replay_us([fn], reps=1, samples=reps) / calls


def bench_rows(*, hidden=2048, inter=512, num_experts=256, top_k=8, tokens=(1, 2, 4, 8), layers=40, gu_configs=None,
               down_configs=None, mma_configs=None, device="cuda", time_us=graph_us, hbm_gbs=None, seed=0,
               log=print) -> list[dict]:
    """The benchmark's rows (module docstring). device "cpu" (interpreter, tiny shapes, `time_us` stubbed) only
    exercises this code in tests."""
    from ft.runtime.gpu.kernels import nvfp4_decode as nd
    from ft.runtime.gpu.kernels.nvfp4_decode_mma import moe_nvfp4_mma
    from ft.runtime.gpu.kernels.moe_reference import moe_ref
    from ft.runtime.gpu.record_layout import RecordLayout

    gu_configs, down_configs = gu_configs or _configs("grid")[0], down_configs or _configs("grid")[1]
    dev = torch.device(device)
    layout = RecordLayout.packed(hidden, inter)
    layers = max(1, layers)
    pool = make_pool(layout, layers * num_experts, seed, dev)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    tables = [(li * num_experts + torch.randperm(num_experts, device=dev, generator=g)).to(torch.int32)
              for li in range(layers)]
    comp_bytes = {kn: sum(layout.nbytes(c) for c in cs) for kn, cs in COMPONENTS.items()}
    hbm = hbm_gbs if hbm_gbs is not None else hbm_read_gbs()
    rows = [{"kernel": "hbm", "gbs": hbm}]
    host = (0, 0)
    for T in tokens:
        x = torch.randn(T, hidden, device=dev, generator=g).to(torch.bfloat16)
        ids = [torch.rand(T, num_experts, device=dev, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
               for _ in range(layers)]
        w = [torch.softmax(torch.randn(T, top_k, device=dev, generator=g), dim=1) for _ in range(layers)]
        unique = sum(len(torch.unique(i)) for i in ids) / layers
        base = {"tokens": T, "experts_per_call": unique, "layers": layers}
        best = {}
        for kname, configs in (("gate_up", gu_configs), ("down", down_configs)):
            nbytes = unique * comp_bytes[kname]
            for name, cfg in configs.items():
                b, info = nd.decode_blocks(cfg), {}
                try:
                    acts = [nd.launch_gate_up(pool, layout, x, ids[li], tables[li], host, b) for li in range(layers)]
                    if kname == "gate_up":
                        def step(b=b, info=info, x=x, ids=ids):
                            for li in range(layers):
                                nd.launch_gate_up(pool, layout, x, ids[li], tables[li], host, b, info)
                    else:
                        def step(b=b, info=info, acts=acts, w=w, ids=ids):
                            for li in range(layers):
                                nd.launch_down(pool, layout, acts[li], w[li].reshape(-1), ids[li], tables[li], host, b,
                                               "tokens", info)
                    step()
                    us = time_us(step, layers)
                    k = info.get(kname)
                    r = {"kernel": kname, "config": name, "blocks": cfg, **base, "us": us, "bytes": nbytes,
                         "gbs": nbytes / us / 1e3, "frac_hbm": nbytes / us / 1e3 / hbm,
                         "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)}
                    if kname not in best or us < best[kname][1]:
                        best[kname] = (cfg, us)
                except Exception as e:  # noqa: BLE001 - report, keep the other configs' rows
                    r = {"kernel": kname, "config": name, "blocks": cfg, **base, "error": f"{type(e).__name__}: {e}"}
                rows.append(r)
                log(fmt_row(r))
        ref = moe_ref(pool, layout, x, tables[0].long()[ids[0].long()], w[0]).double()
        calls = {"default": ({}, "tokens"), "pairs": ({}, "pairs")}
        if len(best) == 2:
            calls["best"] = ({**best["gate_up"][0], **best["down"][0]}, "tokens")
        calls.update({"mma-" + _mma_name(c): (c, "mma") for c in (mma_configs or [])})
        for name, (cfg, combine) in calls.items():
            def call(li=0, cfg=cfg, combine=combine, x=x, ids=ids, w=w):
                if combine == "mma":
                    return moe_nvfp4_mma(pool, layout, x, ids[li], tables[li], w[li], blocks=cfg)
                return nd.moe_nvfp4_device(pool, layout, x, ids[li], tables[li], w[li], blocks=cfg, combine=combine)

            def step(call=call):
                for li in range(layers):
                    call(li)
            r = {"kernel": "call", "config": name, "combine": combine, **base,
                 "blocks": cfg if combine == "mma" else nd.decode_blocks(cfg)}
            try:
                y = call()
                us = time_us(step, layers)
                nbytes = unique * (comp_bytes["gate_up"] + comp_bytes["down"])
                r.update(us=us, bytes=nbytes, gbs=nbytes / us / 1e3, frac_hbm=nbytes / us / 1e3 / hbm,
                         rel_err=float((y.double() - ref).norm() / ref.norm()),
                         deterministic=bool(torch.equal(y, call())),
                         graph_equal=_graph_equal(call, y) if dev.type == "cuda" else "n/a")
            except Exception as e:  # noqa: BLE001 - report
                r["error"] = f"{type(e).__name__}: {e}"
            rows.append(r)
            log(fmt_row(r))
    return rows


def _graph_equal(call, eager) -> bool:
    _, out = capture(call)
    torch.cuda.synchronize()
    return bool(torch.equal(out, eager))


def suggest(rows: list[dict]) -> dict:
    """Per kernel, the config with the least sum over T of us / (best us at that T): DECODE_BLOCKS to paste."""
    out = {}
    for kname in ("gate_up", "down"):
        done = [r for r in rows if r["kernel"] == kname and "us" in r]
        best_t = {t: min(r["us"] for r in done if r["tokens"] == t) for t in {r["tokens"] for r in done}}
        score = {}
        for r in done:
            score.setdefault(r["config"], [0.0, r["blocks"]])[0] += r["us"] / best_t[r["tokens"]]
        if score:
            out.update(min(score.values(), key=lambda s: s[0])[1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for bench_moe_decode.json (required unless --compile-only)")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--configs", default="grid", choices=("grid", "default"))
    ap.add_argument("--mma", default="grid", choices=("grid", "default", "none"),
                    help="tensor-core kernel configs (nvfp4_decode_mma) timed as whole calls")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--scheme", default="nvfp4", choices=("nvfp4", "mxfp4"), help="--compile-only: the record format")
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=40, help="calls per timed step, each with its own experts")
    ap.add_argument("--compile-only", type=int, nargs="?", const=90, metavar="ARCH",
                    help="no GPU needed: build the configs' kernels for sm_ARCH (default 90), print regs / spills")
    args = ap.parse_args(argv)
    gu, dn = _configs(args.configs)
    if args.compile_only:
        rows = compile_configs(gu, dn, hidden=args.hidden, inter=args.inter, top_k=args.top_k, arch=args.compile_only,
                               scheme=args.scheme)
        return 1 if any("error" in r for r in rows) else 0
    if not torch.cuda.is_available():
        print("bench_moe_decode: no CUDA device here; run it on the GPU machine (or use --compile-only)")
        return 0
    import triton

    rows = bench_rows(hidden=args.hidden, inter=args.inter, num_experts=args.experts, top_k=args.top_k,
                      tokens=tuple(int(t) for t in args.tokens.split(",")), layers=args.layers,
                      gu_configs=gu, down_configs=dn, mma_configs=_mma_configs(args.mma))
    hbm = rows[0]["gbs"]
    print(f"\nHBM read {hbm:.0f} GB/s. Best per T (us per MoE layer call; x{args.layers} layers = MoE per token):")
    for T in sorted({r["tokens"] for r in rows if "tokens" in r}):
        line = [f"  T={T}"]
        for kname in ("gate_up", "down", "call"):
            done = [r for r in rows if r["kernel"] == kname and r.get("tokens") == T and "us" in r]
            if done:
                r = min(done, key=lambda r: r["us"])
                line.append(f"{kname} {r['config']} {r['us']:.1f} us ({r['frac_hbm']:.0%} HBM)")
        print("; ".join(line))
    suggested = suggest(rows)
    print(f"suggested DECODE_BLOCKS = {suggested}")
    out = Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "args": vars(args), "hbm_read_gbs": hbm}
    (out / "bench_moe_decode.json").write_text(json.dumps({"meta": meta, "rows": rows, "suggested": suggested},
                                                          indent=1))
    print(f"wrote {out / 'bench_moe_decode.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
