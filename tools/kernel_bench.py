"""Records and timings shared by the MoE kernel benchmarks: synthetic NVFP4 banks with random block scales
(`_bench_records`, also bench_moe_prefill's), and `bench_decode_device`, which times decode shapes three ways:
"host+sync" is what a host-planned call costs (routing to the host, slot lookup, `plan_blocks`, `moe_nvfp4`);
"device/<combine>" the device-planned kernels of `nvfp4_decode.py` with routing and slot table on the device, per
block config; "device/pairs+graph" the same call captured in a CUDA graph and replayed (checked bit-equal to eager);
"device/mapped" the same kernel with no expert in VRAM, every record read from page-locked host memory over the bus
(the kernel pulls records across PCIe itself); "device/gather+compute" mode mapped's miss path: the misses copied by
`gather_missing` into staging rows, then the resident kernel; "device/gather" the copy alone (its GB/s: the link).
GB/s counts each routed expert's payload bytes once per call (what the kernel must read at least).
"""

from __future__ import annotations

import numpy as np
import torch

from ft.runtime.gpu.benchbw import _synthetic_records
from ft.runtime.gpu.kernels.moe_reference import moe_ref
from ft.runtime.gpu.pinning import device_pointer
from ft.runtime.gpu.record_layout import RecordLayout


def _time_ms(fn, iters: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=max(25, iters), return_mode="median"))


def _random_slots(T: int, k: int, E: int, rng) -> np.ndarray:
    return np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).reshape(-1)


def _bench_records(layout: RecordLayout, num_experts: int, seed: int, g: torch.Generator) -> torch.Tensor:
    host = _synthetic_records(layout, num_experts, seed)
    # random scales per block so a wrong scale index shows up in the check
    for name in ("gate_up_scale", "down_scale"):
        off, n = getattr(layout, "off_" + name), layout.nbytes(name)
        vals = torch.exp2(torch.rand(num_experts, n, generator=g) * 6 - 8).to(torch.float8_e4m3fn)
        host[:, off:off + n] = vals.view(torch.uint8)
    return host


DEVICE_CONFIGS = (  # block configs of the device-planned kernels tried per decode shape
    {"BLOCK_N_GU": 32, "BLOCK_N_D": 32, "BLOCK_K": 128, "num_warps": 4},
    {"BLOCK_N_GU": 16, "BLOCK_N_D": 32, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_N_GU": 64, "BLOCK_N_D": 64, "BLOCK_K": 128, "num_warps": 8},
)


def _graph_replay(fn):
    """Capture fn() (after warm-up on a side stream, as torch.cuda.graph requires) -> (graph, its output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def bench_decode_device(*, hidden: int = 2048, inter: int = 512, num_experts: int = 256, top_k: int = 8,
                        tokens: tuple[int, ...] = (1, 2, 4, 8), seed: int = 0, configs=DEVICE_CONFIGS,
                        device: str = "cuda") -> list[dict]:
    """Decode shapes (T * top_k <= 64): host-planned call with its routing sync vs the device-planned kernels.
    `device="cpu"` (Triton interpreter, tiny shapes, `_time_ms` replaced) only exercises this code in tests."""
    from ft.runtime.gpu.kernels.gather import gather_missing
    from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device
    from ft.runtime.gpu.host_plan import moe_nvfp4

    dev = torch.device(device)
    layout = RecordLayout.packed(hidden, inter)
    g = torch.Generator().manual_seed(seed + 1)
    host = _bench_records(layout, num_experts, seed + 1, g)
    pool = host.to(dev)
    perm = torch.randperm(num_experts, generator=g)  # expert -> slot, not the identity
    table = perm.to(torch.int32).to(dev)
    perm_np = perm.numpy()
    # the bank as mode mapped reads it: expert e's record at e * stride (= pool slot perm[e]), page-locked on CUDA
    bank = host[perm].contiguous()
    bank = bank.pin_memory() if dev.type == "cuda" else bank
    bank_addr = device_pointer(bank.data_ptr()) if dev.type == "cuda" else bank.data_ptr()
    unmapped = torch.full_like(table, -1)
    rng = np.random.default_rng(seed + 1)
    rows = []
    for T in tokens:
        ids_np = _random_slots(T, top_k, num_experts, rng).reshape(T, top_k)
        x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
        w = torch.rand(T, top_k, generator=g)
        xd, wd, ids = x.to(dev), w.to(dev), torch.from_numpy(ids_np).to(dev)
        ref = moe_ref(host, layout, x, torch.from_numpy(perm_np[ids_np]), w).double()
        n_exp = len(np.unique(ids_np))
        nbytes = n_exp * layout.payload_bytes
        base = {"tokens": T, "experts_touched": n_exp}

        def host_path():  # what a host-planned GpuExperts call does per layer: routing to the host, then plan
            return moe_nvfp4(pool, layout, xd, perm_np[ids.to("cpu").numpy().reshape(-1)], wd)

        def row(path, fn, ms=None, **extra):
            y = fn()
            err = float((y.cpu().double() - ref).norm() / ref.norm())
            ms = _time_ms(fn) if ms is None else ms
            return {"path": path, **base, "ms": ms, "gbs": nbytes / ms / 1e6, "rel_err": err, **extra}

        rows.append(row("host+sync", host_path))
        for combine in ("pairs", "tokens"):
            for cfg in configs:
                fn = lambda c=combine, b=cfg: moe_nvfp4_device(pool, layout, xd, ids, table, wd,  # noqa: E731
                                                               blocks=b, combine=c)
                rows.append(row(f"device/{combine}", fn, blocks=cfg))
        if bank_addr:
            rows.append(row("device/mapped", lambda: moe_nvfp4_device(pool, layout, xd, ids, unmapped, wd,
                                                                      host_base=bank_addr, host_stride=layout.stride)))
            staged = torch.cat([pool, torch.zeros(ids.numel(), layout.stride, dtype=torch.uint8, device=dev)])
            pairs = torch.arange(ids.numel(), dtype=torch.int32, device=dev).view(ids.shape)

            def gather():
                return gather_missing(staged, layout, ids, unmapped[None], 0, bank_addr, layout.stride,
                                      num_experts)[0]

            def gathered():  # mode mapped's decode call: misses gathered into staging rows, then the resident kernel
                return moe_nvfp4_device(staged, layout, xd, pairs, gather(), wd)

            rows.append(row("device/gather+compute", gathered))
            ms = _time_ms(gather)
            moved = ids.numel() * layout.payload_bytes
            rows.append({"path": "device/gather", **base, "ms": ms, "gbs": moved / ms / 1e6})
        if dev.type != "cuda":
            continue
        try:
            eager = moe_nvfp4_device(pool, layout, xd, ids, table, wd)
            graph, out = _graph_replay(lambda: moe_nvfp4_device(pool, layout, xd, ids, table, wd))
            graph.replay()
            same = bool(torch.equal(out, eager))
            rows.append(row("device/pairs+graph", lambda: (graph.replay(), out)[1], ms=_time_ms(graph.replay),
                            graph_equal_eager=same))
        except Exception as e:  # noqa: BLE001 - report, do not lose the other rows
            rows.append({"path": "device/pairs+graph", **base, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows
