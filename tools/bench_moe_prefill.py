"""Resident prefill MoE on one GPU: the device-planned NVFP4 tile kernels over a pool holding every expert of a layer.

    python tools/bench_moe_prefill.py --out DIR [--tokens 512,4096,16384] [--routing uniform,zipf]
                                      [--configs all | name,name] [--peak-tflops 790] [--zipf-a 1.0]
    python tools/bench_moe_prefill.py --compile-only [ARCH]     (any machine: build the configs for sm_ARCH)

Shape defaults: qwen3moe-35b-geom (hidden 2048, 256 experts top-8, moe_intermediate 512). Per (tokens, routing):
  "device"     one `moe_nvfp4_prefill` call: device plan + gate_up + down + sum over k, per tile config (sweep)
  "plan"       `plan_blocks_device` alone (the torch ops grouping the pairs by expert)
  "kernels"    gate_up + down over a prebuilt plan (`moe_blocks`), per tile config
  "host+sync"  the host-planned call (routing to the host, numpy plan, the same kernels), default config
Columns: us per layer call (median of triton.testing.do_bench), tflops = 2 * P * 3 * H * I useful flops / time,
frac_peak = tflops / --peak-tflops (bf16 dense peak measured on the H200), rel_err against the PyTorch reference on
the first --check-tokens tokens, deterministic (two calls bit-equal), sync_free (a call under
torch.cuda.set_sync_debug_mode("error")), default (the config `pick_blocks` chooses for this shape).
Routing "uniform": top-k distinct experts uniformly at random; "zipf": k distinct experts drawn with probability
proportional to 1 / rank^a (Gumbel top-k), so a few experts get most tokens. Weights: softmax over the k logits.
Writes DIR/bench_moe_prefill.json ({"meta": ..., "rows": [...]}); exits with a message where CUDA is missing.
Needs `ft` importable: the project's venv, or `bash tools/gpu_run.sh tools/bench_moe_prefill.py --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# tile configs swept besides nvfp4_triton.TILE_CONFIGS (same keys)
EXTRA_CONFIGS = {
    "m64-swap": {"BLOCK_M": 64, "BLOCK_N_GU": 64, "BLOCK_N_D": 128, "BLOCK_K": 64, "SWAP": 1, "num_warps": 4,
                 "num_stages": 3},
    "m128-swap": {"BLOCK_M": 128, "BLOCK_N_GU": 64, "BLOCK_N_D": 128, "BLOCK_K": 64, "SWAP": 1, "num_warps": 8,
                  "num_stages": 3},
    "m128-gu128": {"BLOCK_M": 128, "BLOCK_N_GU": 128, "BLOCK_N_D": 128, "BLOCK_K": 64, "SWAP": 0, "num_warps": 8,
                   "num_stages": 3},
    "m128-k128": {"BLOCK_M": 128, "BLOCK_N_GU": 64, "BLOCK_N_D": 128, "BLOCK_K": 128, "SWAP": 0, "num_warps": 8,
                  "num_stages": 2},
    "m128-w4": {"BLOCK_M": 128, "BLOCK_N_GU": 64, "BLOCK_N_D": 64, "BLOCK_K": 64, "SWAP": 0, "num_warps": 4,
                "num_stages": 3},
    "m256": {"BLOCK_M": 256, "BLOCK_N_GU": 64, "BLOCK_N_D": 64, "BLOCK_K": 64, "SWAP": 0, "num_warps": 8,
             "num_stages": 3},
    "m32-swap": {"BLOCK_M": 32, "BLOCK_N_GU": 64, "BLOCK_N_D": 128, "BLOCK_K": 128, "SWAP": 1, "num_warps": 4,
                 "num_stages": 3},
}


def _do_bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _routing(kind: str, T: int, k: int, E: int, g: torch.Generator, zipf_a: float, dev) -> tuple:
    if kind == "uniform":
        scores = torch.rand(T, E, generator=g)
    elif kind == "zipf":
        logp = -zipf_a * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
        gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g).clamp_min(1e-20)))
        scores = logp[torch.randperm(E, generator=g)] + gumbel  # hot experts at random ids
    else:
        raise ValueError(f"unknown routing {kind!r} (uniform, zipf)")
    ids = scores.topk(k, dim=1).indices
    w = torch.softmax(torch.randn(T, k, generator=g), dim=1)
    return ids.to(dev), w.to(dev)


def _sync_free(fn) -> bool | str:
    if not torch.cuda.is_available():
        return "n/a"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError as e:
        return f"no: {e}"[:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bench_rows(*, hidden: int = 2048, inter: int = 512, num_experts: int = 256, top_k: int = 8,
               tokens=(512, 4096, 16384), routings=("uniform", "zipf"), configs: dict | None = None,
               device: str = "cuda", time_ms=_do_bench_ms, seed: int = 0, zipf_a: float = 1.0,
               check_tokens: int = 64, peak_tflops: float = 790.0, log=print) -> list[dict]:
    """The benchmark's rows (see the module docstring). device "cpu" (interpreter, tiny shapes, `time_ms` stubbed)
    only exercises this code in tests."""
    from kernel_bench import _bench_records
    from ft.runtime.gpu.kernels.moe_reference import moe_ref
    from ft.runtime.gpu.host_plan import moe_nvfp4
    from ft.runtime.gpu.kernels.nvfp4_triton import TILE_CONFIGS, moe_blocks, pick_blocks
    from ft.runtime.gpu.prefill_plan import moe_nvfp4_prefill, plan_blocks_device
    from ft.runtime.gpu.record_layout import RecordLayout

    configs = configs if configs is not None else {**TILE_CONFIGS, **EXTRA_CONFIGS}
    dev = torch.device(device)
    layout = RecordLayout.packed(hidden, inter)
    g = torch.Generator().manual_seed(seed)
    host = _bench_records(layout, num_experts, seed, g)
    pool = host.to(dev)
    perm = torch.randperm(num_experts, generator=g)
    row = perm.to(torch.int32).to(dev)  # expert -> slot, not the identity
    rows = []
    for T in tokens:
        x = torch.randn(T, hidden, generator=g).to(torch.bfloat16).to(dev)
        P = T * top_k
        flops = 2.0 * P * 3 * hidden * inter
        for routing in routings:
            ids, w = _routing(routing, T, top_k, num_experts, g, zipf_a, dev)
            counts = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts)
            n = min(T, check_tokens)
            ref = moe_ref(pool, layout, x[:n], perm.to(dev).long()[ids[:n].long()], w[:n]).double()
            base = {"tokens": T, "routing": routing, "pairs": P, "rows_per_expert_max": int(counts.max()),
                    "experts_touched": int((counts > 0).sum())}
            default = pick_blocks(P / min(num_experts, P), hidden, inter)

            def err(y):
                return float((y[:n].double() - ref).norm() / ref.norm())

            def add(path, ms, **extra):
                r = {"path": path, **base, "us": ms * 1e3, **extra}
                if path in ("device", "kernels", "host+sync"):
                    r["tflops"] = flops / (ms * 1e-3) / 1e12
                    r["frac_peak"] = r["tflops"] / peak_tflops
                rows.append(r)
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                             if k != "blocks"))

            bm0 = default["BLOCK_M"]
            add("plan", time_ms(lambda: plan_blocks_device(ids, row, bm0)), block_m=bm0)
            for name, cfg in configs.items():
                tag = {"config": name, "blocks": cfg, "default": cfg == default}
                try:
                    fn = lambda c=cfg: moe_nvfp4_prefill(pool, layout, x, ids, row, w, blocks=c)  # noqa: E731
                    y = fn()
                    same = bool(torch.equal(y, fn()))
                    add("device", time_ms(fn), rel_err=err(y), deterministic=same, sync_free=_sync_free(fn), **tag)
                    sp, bs = plan_blocks_device(ids, row, cfg["BLOCK_M"])
                    out = torch.empty(P, hidden, dtype=torch.float32, device=dev)
                    wf = w.reshape(-1).float().contiguous()
                    add("kernels", time_ms(lambda c=cfg: moe_blocks(pool, layout, x, top_k, sp, bs, wf, out, c)),
                        **tag)
                except Exception as e:  # noqa: BLE001 - report, keep the other configs' rows
                    rows.append({"path": "device", **base, **tag, "error": f"{type(e).__name__}: {e}"[:300]})
                    log(f"config {name} failed: {rows[-1]['error']}")

            def host_path():  # a host-planned call: routing to the host, numpy plan, same kernels
                return moe_nvfp4(pool, layout, x, perm.numpy()[ids.to("cpu").numpy().reshape(-1)], w, blocks=default)

            add("host+sync", time_ms(host_path), rel_err=err(host_path()), config="default", blocks=default)
    return rows


def compile_configs(configs: dict, *, hidden: int = 2048, inter: int = 512, top_k: int = 8, arch: int = 90,
                    scheme: str = "nvfp4", log=print) -> list[dict]:
    """Build both kernels of each config for sm_<arch> with no GPU (Triton's CUDA backend and its ptxas), with the
    pointer / stride alignment a real launch specializes on. Rows: registers per thread, stack (spill) bytes, shared
    memory; a config that does not build gets an "error". A check before a GPU run, and a CPU test of the kernels.
    scheme "mxfp4": gpt-oss's records (biases, the clamped SwiGLU)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ft.runtime.gpu.kernels import nvfp4_triton as nt
    from ft.runtime.gpu.record_layout import RecordLayout

    lay = RecordLayout.packed(hidden, inter, scheme, act="clamped_swiglu" if scheme == "mxfp4" else "silu")
    target = GPUTarget("cuda", arch, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    kernels = {  # runtime argument types in order, then the constexpr values by name
        "gate_up": (nt._gate_up_kernel, ("*u8", "i32", "*bf16", "*bf16", "*i32", "*i32", "i32"),
                    dict(TOPK=top_k, H=hidden, I=inter, OFF_GU=lay.off_gate_up, OFF_GUS=lay.off_gate_up_scale,
                         **lay.kernel_args("gate_up"))),
        "down": (nt._down_kernel, ("*u8", "i32", "*bf16", "*fp32", "*fp32", "*i32", "*i32", "i32"),
                 dict(H=hidden, I=inter, OFF_D=lay.off_down, OFF_DS=lay.off_down_scale, **lay.kernel_args("down"))),
    }
    rows = []
    for name, cfg in configs.items():
        b = {**nt.LAUNCH_DEFAULTS, **cfg}
        for kname, (fn, types, consts) in kernels.items():
            bn = b["BLOCK_N_GU"] if kname == "gate_up" else b["BLOCK_N_D"]
            consts = {**consts, "BLOCK_M": b["BLOCK_M"], "BLOCK_N": bn, "SWAP": b["SWAP"], "DOT_F32": False,
                      "BLOCK_K": nt._fit_block_k(b["BLOCK_K"], hidden if kname == "gate_up" else inter)}
            names = fn.arg_names
            sig = {n: (types[i] if i < len(types) else "constexpr") for i, n in enumerate(names)}
            aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                       if sig[n].startswith("*") or n == "slot_stride"}
            row = {"config": name, "kernel": kname, "arch": arch, "blocks": cfg}
            try:
                src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=aligned)
                k = triton.compile(src, target=target, options={"num_warps": b["num_warps"],
                                                                "num_stages": b["num_stages"]})
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
                use = {key: int(v) for key, v in re.findall(r"(REG|STACK):(\d+)", res)}
                row.update(regs=use.get("REG"), stack=use.get("STACK"), shared=k.metadata.shared)
            except Exception as e:  # noqa: BLE001 - report every config
                row["error"] = f"{type(e).__name__}: {e}"[-400:]
            rows.append(row)
            log(" ".join(f"{k}={v}" for k, v in row.items() if k != "blocks"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for bench_moe_prefill.json (required unless --compile-only)")
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--configs", default="all", help="all, or comma-separated names of TILE_CONFIGS / EXTRA_CONFIGS")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--zipf-a", type=float, default=1.0)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--layers", type=int, default=40, help="layers of the model, for the projected prefill time")
    ap.add_argument("--compile-only", type=int, nargs="?", const=90, metavar="ARCH",
                    help="no GPU needed: build the configs' kernels for sm_ARCH (default 90), print regs / spills")
    ap.add_argument("--scheme", default="nvfp4", choices=("nvfp4", "mxfp4"), help="--compile-only: the record format")
    args = ap.parse_args(argv)
    from ft.runtime.gpu.kernels.nvfp4_triton import TILE_CONFIGS

    every = {**TILE_CONFIGS, **EXTRA_CONFIGS}
    configs = every if args.configs == "all" else {n: every[n] for n in args.configs.split(",")}
    if args.compile_only:
        rows = compile_configs(configs, hidden=args.hidden, inter=args.inter, top_k=args.top_k,
                               arch=args.compile_only, scheme=args.scheme)
        return 1 if any("error" in r for r in rows) else 0
    if not torch.cuda.is_available():
        print("bench_moe_prefill: no CUDA device here; run it on the GPU machine (or use --compile-only)")
        return 0
    import triton

    rows = bench_rows(hidden=args.hidden, inter=args.inter, num_experts=args.experts, top_k=args.top_k,
                      tokens=tuple(int(t) for t in args.tokens.split(",")), routings=tuple(args.routing.split(",")),
                      configs=configs, zipf_a=args.zipf_a, peak_tflops=args.peak_tflops)
    print("\nbest device-planned call per shape (projected MoE time of a prefill over all layers):")
    for T in sorted({r["tokens"] for r in rows}):
        for routing in sorted({r["routing"] for r in rows}):
            done = [r for r in rows if r["path"] == "device" and r["tokens"] == T and r["routing"] == routing
                    and "us" in r]
            if done:
                best = min(done, key=lambda r: r["us"])
                dflt = next((r for r in done if r["default"]), best)
                print(f"  T={T:6d} {routing:8s} best {best['config']:12s} {best['us']:9.1f} us "
                      f"({best['tflops']:.0f} TFLOP/s, {best['frac_peak']:.0%} of peak); default "
                      f"{dflt['config']} {dflt['us']:.1f} us; {args.layers} layers: "
                      f"{args.layers * best['us'] / 1e3:.1f} ms = {T / (args.layers * best['us'] * 1e-6):.0f} tok/s "
                      f"(MoE only)")
    out = Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "args": vars(args)}
    (out / "bench_moe_prefill.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out / 'bench_moe_prefill.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
