"""Check and time the NVFP4 MoE kernel on the GPU: decode (batch 1, top-k) and prefill (many tokens, all experts).

GB/s counts each routed expert's payload bytes once per call (what the kernel must read at least); the check
compares against the PyTorch reference on fresh random records and inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from .benchbw import _synthetic_records
from .moe_reference import moe_ref
from .record_layout import RecordLayout


def _time_ms(fn, iters: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=max(25, iters), return_mode="median"))


def _random_slots(T: int, k: int, E: int, rng) -> np.ndarray:
    return np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).reshape(-1)


def bench_kernel(*, hidden: int = 2048, inter: int = 512, num_experts: int = 256, top_k: int = 8,
                 tokens: tuple[int, ...] = (1, 4, 512, 2048), seed: int = 0) -> list[dict]:
    from .nvfp4_triton import moe_nvfp4

    dev = torch.device("cuda")
    layout = RecordLayout.packed(hidden, inter)
    g = torch.Generator().manual_seed(seed)
    host = _synthetic_records(layout, num_experts, seed)
    # random scales per block so a wrong scale index shows up in the check
    for name in ("gate_up_scale", "down_scale"):
        off, n = getattr(layout, "off_" + name), layout.nbytes(name)
        vals = torch.exp2(torch.rand(num_experts, n, generator=g) * 6 - 8).to(torch.float8_e4m3fn)
        host[:, off:off + n] = vals.view(torch.uint8)
    pool = host.to(dev)
    rng = np.random.default_rng(seed)
    rows = []
    for T in tokens:
        x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
        slots = _random_slots(T, top_k, num_experts, rng)
        w = torch.rand(T, top_k, generator=g)
        xd, wd = x.to(dev), w.to(dev)
        y = moe_nvfp4(pool, layout, xd, slots, wd)
        check_T = min(T, 16)  # the reference is slow; check the first rows
        ref = moe_ref(host, layout, x[:check_T], torch.from_numpy(slots[: check_T * top_k]).view(check_T, top_k),
                      w[:check_T])
        err = float((y[:check_T].cpu().double() - ref.double()).norm() / ref.double().norm())
        ms = _time_ms(lambda: moe_nvfp4(pool, layout, xd, slots, wd))
        n_exp = len(np.unique(slots))
        nbytes = n_exp * layout.payload_bytes
        flops = 2 * T * top_k * (3 * hidden * inter)
        rows.append({"tokens": T, "experts_touched": n_exp, "ms": ms, "gbs": nbytes / ms / 1e6,
                     "tflops": flops / ms / 1e9, "rel_err": err})
    return rows
