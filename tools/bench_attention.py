"""Time the fused full-attention decode kernel (`ft.runtime.gpu.kernels.decode_attention`) at the real model shapes.

    python tools/bench_attention.py --out DIR [--quick]     # writes DIR/bench_attention.json, prints one line per row

Geometries (bf16): qwen3moe-35b-geom (32 q / 4 kv heads x 128, q/k norm, full rotary) and qwen3.6-35b-a3b (16 q /
2 kv heads x 256, q/k norm, rotary_dim 64, output gate); B = 1, 4, 8 sequences, each attending over `ctx` = 32,
512, 8192, 32768 keys (every sequence at the same length, its own buffers; ctx <= BLOCK_N: one live split).

Rows (`kind`):
  check      the kernel against the torch reference at mixed lengths (max abs diff of the written k / v rows and
             of the output; bf16 rounding only);
  attention  one `decode_attention` call (one launch: q/k norm + RoPE + KV write, splits + last-block merge), i.e.
             what one attention layer adds to a decode step besides its projections, for one config: the default
             `CONFIG` (`config: "default"`) and, unless --quick, a sweep of tiles (BLOCK_N, num_warps, num_stages) x
             splits (S/2, S, 2S around the default S), then of min_chunk (MIN_CHUNKS keys, default tile and S;
             `config: "min_chunk"`); `best` marks the fastest per shape.
Each call is timed as decode runs it: REPS calls captured in one CUDA graph, replayed; us = median replay / REPS
(launch gaps inside a graph included, host launch cost not). Consecutive calls use different buffer sets (together
>= 2x the L2 size) so KV reads come from HBM, as in a real step where a layer's KV has left L2 by its next call.
`kv_gbs` = KV bytes read (B * ctx * nkv * hd * 2 tensors * 2 bytes) / time; `hbm_frac` = that over the HBM read
rate measured here (a large bf16 reduction).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import graph_us, hbm_read_gbs  # noqa: E402

REPS = 20
GEOMS = {
    "qwen3moe-35b-geom": dict(nq=32, nkv=4, hd=128, rd=128, gated=False),
    "qwen3.6-35b-a3b": dict(nq=16, nkv=2, hd=256, rd=64, gated=True),
}
BATCHES = (1, 4, 8)
CONTEXTS = (32, 512, 8192, 32768)
BLOCK_N = {128: (32, 64, 128), 256: (16, 32, 64)}
WARPS, STAGES = (4, 8), (2, 3)
MIN_CHUNKS = (128, 256, 512, 1024)
L2_BYTES = 50 << 20


class Case:
    """One buffer set: B sequences of `lengths` (the new token at position length - 1), their k/v buffers, tables,
    qkv input, norms and rope."""

    def __init__(self, geom: dict, lengths: list[int]):
        from ft.runtime.layers.rope import Rotary

        nq, nkv, hd, rd = geom["nq"], geom["nkv"], geom["hd"], geom["rd"]
        bf = dict(dtype=torch.bfloat16, device="cuda")
        self.g, B = geom, len(lengths)
        self.kv = [tuple(torch.randn(n + 8, nkv, hd, **bf) for _ in range(2)) for n in lengths]
        self.tables = torch.tensor([[k.data_ptr() for k, _ in self.kv], [v.data_ptr() for _, v in self.kv]],
                                   dtype=torch.int64, device="cuda")
        self.positions = torch.tensor(lengths, dtype=torch.int64, device="cuda") - 1
        self.qkv = torch.randn(B, (nq + 2 * nkv + (nq if geom["gated"] else 0)) * hd, **bf)
        self.q_norm = torch.rand(hd, device="cuda") + 0.5
        self.k_norm = torch.rand(hd, device="cuda") + 0.5
        self.cos, self.sin = Rotary(rd, 1e7).cos_sin(self.positions, torch.bfloat16)
        self.kv_bytes = sum(lengths) * nkv * hd * 2 * 2

    def args(self, kv=None):
        return (self.qkv, self.q_norm, self.k_norm, 1e-6, self.cos, self.sin, self.tables if kv is None else kv,
                self.positions)

    def attention(self, **kw):
        from ft.runtime.gpu.kernels.decode_attention import decode_attention

        g = self.g
        return decode_attention(*self.args(), nq=g["nq"], nkv=g["nkv"], hd=g["hd"], scale=g["hd"] ** -0.5,
                                gated=g["gated"], **kw)


def check(name: str, geom: dict) -> dict:
    from ft.runtime.gpu.kernels.decode_attention_ref import decode_attention_ref

    c = Case(geom, [1, 100, 777, 5000])
    kv_ref = [tuple(t.clone() for t in pair) for pair in c.kv]
    out = c.attention()
    ref = decode_attention_ref(*c.args(kv_ref), nq=geom["nq"], nkv=geom["nkv"], hd=geom["hd"],
                               scale=geom["hd"] ** -0.5, gated=geom["gated"])
    kv_diff = max(float((a.float() - b.float()).abs().max()) for p, r in zip(c.kv, kv_ref) for a, b in zip(p, r))
    return {"kind": "check", "geometry": name, "kv_max_abs_diff": kv_diff,
            "out_max_abs_diff": float((out.float() - ref.float()).abs().max()),
            "out_max_abs": float(ref.float().abs().max())}


def bench_shape(name: str, geom: dict, B: int, ctx: int, hbm: float, quick: bool) -> list[dict]:
    from ft.runtime.gpu.kernels.decode_attention import CONFIG, num_splits

    set_bytes = B * ctx * geom["nkv"] * geom["hd"] * 4
    cases = [Case(geom, [ctx] * B) for _ in range(max(1, min(REPS, -(-2 * L2_BYTES // set_bytes))))]
    base = {"geometry": name, "B": B, "ctx": ctx, "kv_bytes": cases[0].kv_bytes}

    def row(us, **extra):
        gbs = cases[0].kv_bytes / us / 1e3
        r = {**base, "kind": "attention", "us": round(us, 2), **extra, "kv_gbs": round(gbs, 1),
             "hbm_frac": round(gbs / hbm, 3)}
        print(json.dumps(r), flush=True)
        return r

    S = num_splits(B, geom["nkv"], torch.device("cuda"))
    tile = CONFIG["tiles"].get(geom["hd"], CONFIG["tiles"]["default"])
    rows = [row(graph_us([c.attention for c in cases]), splits=S, config="default", **tile)]
    if quick:
        return rows
    sweep = []
    for bn, nw, ns, s in itertools.product(BLOCK_N.get(geom["hd"], (32,)), WARPS, STAGES, (S // 2, S, 2 * S)):
        if s < 1:
            continue
        t = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
        try:
            us = graph_us([lambda c=c: c.attention(splits=s, tile=t) for c in cases])
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile: skip that config
            print(f"skip {t} S={s}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        sweep.append(row(us, splits=s, config="sweep", **t))
    for mc in MIN_CHUNKS:   # fewer live splits (fewer partials to merge) at the same grid
        t = {**tile, "min_chunk": mc}
        us = graph_us([lambda c=c: c.attention(splits=S, tile=t) for c in cases])
        sweep.append(row(us, splits=S, config="min_chunk", **t))
    if sweep:
        min(sweep, key=lambda r: r["us"])["best"] = True
    return rows + sweep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="default config only, no sweep")
    ap.add_argument("--geometry", choices=sorted(GEOMS), action="append", help="only these (default: both)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to measure")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    hbm = hbm_read_gbs()
    print(f"HBM read {hbm:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = [{"kind": "hbm", "hbm_read_gbs": round(hbm, 1), "device": torch.cuda.get_device_name()}]
    for name in args.geometry or list(GEOMS):
        rows.append(check(name, GEOMS[name]))
        print(json.dumps(rows[-1]), flush=True)
        for B, ctx in itertools.product(BATCHES, CONTEXTS):
            rows += bench_shape(name, GEOMS[name], B, ctx, hbm, args.quick)
            torch.cuda.empty_cache()
    best = [r for r in rows if r.get("best") or r.get("config") == "default"]
    print("\nsummary (us; kv_gbs; hbm_frac):")
    for r in best:
        tag = "best " if r.get("best") else r["kind"][:5] + " "
        print(f"  {r['geometry']:18s} B={r['B']} ctx={r['ctx']:6d} {tag} {r['us']:8.2f} us  {r.get('kv_gbs', 0):7.0f}"
              f" GB/s  {r.get('hbm_frac', 0):.2f}  S={r.get('splits')} {r.get('BLOCK_N', '')}/"
              f"{r.get('num_warps', '')}/{r.get('num_stages', '')}"
              + (f" min_chunk={r['min_chunk']}" if r.get("min_chunk") else ""))
    path = args.out / "bench_attention.json"
    path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
