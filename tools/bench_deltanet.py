"""Benchmark the fused Gated DeltaNet kernels at Qwen3.6-35B-A3B's geometry (Hk 16, Hv 32, dk = dv = 128, conv kernel 4,
bf16 activations, fp32 recurrent state).

    python tools/bench_deltanet.py --out DIR        # prints the rows, writes DIR/bench_deltanet.json (a list of rows)

Rows (`kind`):
  decode/kernel   `gdn_decode` for B sequences, one token each (B = 1, 4, 8), per DECODE_CONFIG variant, called
                  eagerly and replayed from a CUDA graph: us per layer call; GB/s of state traffic, B·(2·Hv·dk·dv·4 +
                  2·C·(K-1)·2) bytes (each sequence's recurrent and conv state read once and written once, 4.2 MB per
                  sequence), and that as a fraction of the HBM read bandwidth measured here (`hbm_GBps`, a torch sum
                  over 2 GiB). Triton's do_bench flushes L2 before every call, so the states come from HBM as in a
                  real decode step.
  decode/torch    the layer's torch ops from the projections' outputs to the normed core (the reference), eager.
  prefill/triton  `gdn_chunk_prefill` over T = 4096 tokens of one sequence, per PREFILL_CONFIG variant: tok/s.
  prefill/torch   `chunk_gated_delta_rule` (the reference) on the same inputs.
Every kernel row carries `max_err`: the largest |difference| from the torch reference on the same inputs, relative
to the reference's largest |value| (decode: output and states after one step; prefill: output and final state).
Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import capture, hbm_read_gbs  # noqa: E402
import torch.nn.functional as F

HK, HV, DK, DV, K = 16, 32, 128, 128, 4
C, VD = 2 * HK * DK + HV * DV, HV * DV
EPS = 1e-6
DECODE_VARIANTS = [{}, {"rec_warps": 4}, {"rec_warps": 16}]
PREFILL_VARIANTS = [{}, {"BV": 64, "state_warps": 8}, {"BT": 32, "BV": 64}, {"precision": "ieee"}]


def _ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _decode_case(n: int, g: torch.Generator):
    """Inputs as the layer makes them (mixed, z, b, a split from two projections), weights, and n sequences' states
    allocated one by one as SequenceState does."""
    dev, bf = "cuda", torch.bfloat16
    proj = torch.randn(n, C + VD, generator=g).to(dev, bf)
    ba = torch.randn(n, 2 * HV, generator=g).to(dev, bf)
    mixed, z = proj.split([C, VD], dim=-1)
    b, a = ba.split([HV, HV], dim=-1)
    w = SimpleNamespace(conv=(torch.randn(C, K, generator=g) * 0.5).to(dev, bf),
                        A_log=torch.empty(HV).uniform_(1, 16, generator=g).log().to(dev),
                        dt_bias=torch.randn(HV, generator=g).to(dev),
                        norm=(1 + 0.1 * torch.randn(DV, generator=g)).to(dev))
    convs = [torch.randn(C, K - 1, generator=g).to(dev, bf) for _ in range(n)]
    recs = [(torch.randn(HV, DK, DV, generator=g) * 0.1).to(dev) for _ in range(n)]
    return mixed, z, b, a, w, convs, recs


def _torch_decode(mixed, z, b, a, w, convs, recs):
    """The layer's torch path (runtime/layers/deltanet.py) from the projections' outputs: core [B, Hv·dv]."""
    from ft.runtime.layers.deltanet import Conv1d, l2_normalize, recurrent_gated_delta_rule
    from ft.runtime.layers.norm import RMSNormGated

    conv1d, norm = Conv1d(), RMSNormGated(EPS)
    conv1d.weight, norm.weight = w.conv, w.norm
    beta = torch.sigmoid(b).float()
    gate = -w.A_log.exp() * F.softplus(a.float() + w.dt_bias)
    core = torch.empty(mixed.shape[0], HV, DV, dtype=mixed.dtype, device=mixed.device)
    for i in range(mixed.shape[0]):
        q, k, v = conv1d(mixed[i:i + 1], convs[i]).float().split([HK * DK, HK * DK, VD], dim=-1)
        q = (l2_normalize(q.reshape(1, HK, DK)) * DK ** -0.5).repeat_interleave(HV // HK, dim=1)
        k = l2_normalize(k.reshape(1, HK, DK)).repeat_interleave(HV // HK, dim=1)
        o, s = recurrent_gated_delta_rule(q, k, v.reshape(1, HV, DV), gate[i:i + 1], beta[i:i + 1], recs[i])
        recs[i].copy_(s)
        core[i] = o[0].to(mixed.dtype)
    return norm(core, z.reshape(-1, HV, DV)).reshape(-1, VD)


def bench_decode(hbm: float, sizes=(1, 4, 8)) -> list[dict]:
    from ft.runtime.gpu.kernels.deltanet_decode import DECODE_CONFIG, gdn_decode

    rows = []
    for n in sizes:
        mixed, z, b, a, w, convs, recs = _decode_case(n, torch.Generator().manual_seed(n))
        nbytes = n * (2 * HV * DK * DV * 4 + 2 * C * (K - 1) * 2)
        ref_c, ref_r = [c.clone() for c in convs], [r.clone() for r in recs]
        want = _torch_decode(mixed, z, b, a, w, ref_c, ref_r)          # one step from the starting states
        tc, tr = [c.clone() for c in convs], [r.clone() for r in recs]
        rows.append({"kind": "decode/torch", "B": n, "mode": "eager",
                     "us": _ms(lambda: _torch_decode(mixed, z, b, a, w, tc, tr)) * 1e3})
        for variant in DECODE_VARIANTS:
            cfg = {**DECODE_CONFIG, **variant}
            cv, rc = [c.clone() for c in convs], [r.clone() for r in recs]
            tab = torch.tensor([[c.data_ptr() for c in cv], [r.data_ptr() for r in rc]], dtype=torch.int64,
                               device="cuda")

            def call():
                return gdn_decode(mixed, z, b, a, w.conv, w.A_log, w.dt_bias, w.norm, EPS, tab, hk=HK, hv=HV, dk=DK,
                                  dv=DV, config=cfg)

            try:
                got = call()
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not the end
                rows.append({"kind": "decode/kernel", "B": n, "config": cfg, "error": repr(e)[:300]})
                continue
            err = max([_rel(got, want)] + [_rel(x, y) for x, y in zip(rc + cv, ref_r + ref_c)])
            graph, _ = capture(call, warmups=3)
            for mode, fn in (("eager", call), ("graph", graph.replay)):
                us = _ms(fn) * 1e3
                rows.append({"kind": "decode/kernel", "B": n, "mode": mode, "config": cfg, "us": us,
                             "state_bytes": nbytes, "GBps": nbytes / us / 1e3, "frac_hbm": nbytes / us / 1e3 / hbm,
                             "max_err": err})
    return rows


def bench_prefill(t: int = 4096) -> list[dict]:
    from ft.runtime.gpu.kernels.deltanet_prefill import PREFILL_CONFIG, gdn_chunk_prefill
    from ft.runtime.layers.deltanet import chunk_gated_delta_rule, l2_normalize

    g = torch.Generator().manual_seed(0)
    q = (l2_normalize(torch.randn(t, HK, DK, generator=g)) * DK ** -0.5).cuda()
    k = l2_normalize(torch.randn(t, HK, DK, generator=g)).cuda()
    v = torch.randn(t, HV, DV, generator=g).cuda()
    decay = (-torch.exp(torch.empty(t, HV).uniform_(-4.6, 2.1, generator=g))).cuda()
    beta = torch.sigmoid(torch.randn(t, HV, generator=g)).cuda()
    s0 = (torch.randn(HV, DK, DV, generator=g) * 0.1).cuda()
    qr, kr = q.repeat_interleave(HV // HK, 1), k.repeat_interleave(HV // HK, 1)
    want_o, want_s = chunk_gated_delta_rule(qr, kr, v, decay, beta, s0)
    ms = _ms(lambda: chunk_gated_delta_rule(qr, kr, v, decay, beta, s0))
    rows = [{"kind": "prefill/torch", "T": t, "ms": ms, "tok_per_s": t / ms * 1e3}]
    for variant in PREFILL_VARIANTS:
        cfg = {**PREFILL_CONFIG, **variant}
        s = s0.clone()
        try:
            o = gdn_chunk_prefill(q, k, v, decay, beta, s, config=cfg)
        except Exception as e:  # noqa: BLE001
            rows.append({"kind": "prefill/triton", "T": t, "config": cfg, "error": repr(e)[:300]})
            continue
        err = max(_rel(o, want_o), _rel(s, want_s))
        ms = _ms(lambda: gdn_chunk_prefill(q, k, v, decay, beta, s, config=cfg))
        rows.append({"kind": "prefill/triton", "T": t, "config": cfg, "ms": ms, "tok_per_s": t / ms * 1e3,
                     "max_err": err})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for bench_deltanet.json")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_deltanet: no CUDA device here; nothing measured")
        return 0
    hbm = hbm_read_gbs()
    meta = {"gpu": torch.cuda.get_device_name(), "hbm_GBps": hbm}
    print(json.dumps(meta))
    rows = []
    for part in (lambda: bench_decode(hbm),) + (() if args.no_prefill else (bench_prefill,)):
        for row in part():
            row.update(meta)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_deltanet.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
