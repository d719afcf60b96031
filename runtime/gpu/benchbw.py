"""`ft bench bw`: the bandwidths the expert store splits misses by, measured on this machine.

Measured (GB/s = 1e9 bytes/s, medians of repeated timed runs):
  h2d_pinned / d2h_pinned  large copies between pinned host memory and VRAM (the link's ceiling)
  h2d_pageable             the same from ordinary (pageable) memory, which the driver must stage
  h2d_expert_pinned        expert-record-sized copies from a pinned pool larger than the last-level cache
  h2d_expert_staged        the real fetch path: pageable record -> pinned staging ring -> async copy
  host_read                threaded read of host memory (torch sum), the ceiling both paths share
  cpu_expert               the CPU NVFP4 expert kernel, decode batch 1, top-k experts per call (payload bytes)
  concurrent               staged fetches and CPU experts at the same time: each path's GB/s while both run
The profile (b_pcie, b_cpu = the concurrent numbers) is written as JSON under the user cache dir, one file per GPU,
and read back by the scheduler as its starting split.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ft.formats.home import cache_home
from .cpu.kernel import CpuMoe, lane_threads
from .record_layout import RecordLayout

PROFILE_VERSION = 1


def profile_path(gpu_uuid: str) -> Path:
    return cache_home() / "bench" / f"{gpu_uuid}.json"


def gpu_identity(index: int = 0) -> dict:
    p = torch.cuda.get_device_properties(index)
    uuid = str(getattr(p, "uuid", "")) or f"{p.name}-{index}".replace(" ", "_")
    return {"index": index, "name": p.name, "uuid": uuid, "total_memory": p.total_memory,
            "multi_processor_count": p.multi_processor_count, "capability": f"{p.major}.{p.minor}"}


def load_profile(index: int = 0) -> dict | None:
    """The saved profile for this GPU, or None (missing, other version, or another GPU model)."""
    if not torch.cuda.is_available():
        return None
    ident = gpu_identity(index)
    path = profile_path(ident["uuid"])
    try:
        prof = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if prof.get("version") != PROFILE_VERSION or prof.get("gpu", {}).get("name") != ident["name"]:
        return None
    return prof


def _rate(nbytes: int, fn, *, iters: int, cuda: bool) -> float:
    """Median GB/s of `fn` (moving nbytes per call) over `iters` timed runs after one warm-up."""
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / float(np.median(times)) / 1e9


def _synthetic_records(layout: RecordLayout, count: int, seed: int = 0) -> torch.Tensor:
    """[count, stride] valid NVFP4 records (random codes; modest scales so the CPU kernel sees real numbers)."""
    g = torch.Generator().manual_seed(seed)
    recs = torch.randint(0, 256, (count, layout.stride), dtype=torch.uint8, generator=g)
    for name in ("gate_up_scale", "down_scale"):
        off, n = getattr(layout, "off_" + name), layout.nbytes(name)
        recs[:, off:off + n] = torch.full((1,), 0.05).to(torch.float8_e4m3fn).view(torch.uint8)
    for name in ("gate_up_scale_2", "down_scale_2"):
        off, n = getattr(layout, "off_" + name), layout.nbytes(name)
        recs[:, off:off + n] = torch.full((n // 4,), 0.01).view(torch.uint8)
    return recs


def _registered_mmap_rate(records: torch.Tensor, slots: torch.Tensor) -> float | str:
    """Records copied straight from a cudaHostRegister'ed read-only file mapping (what pinning the FTW mmap would
    give, with no staging copy). Returns GB/s, or the CUDA error when the mapping cannot be registered."""
    import mmap
    import tempfile

    n, stride = records.shape
    with tempfile.TemporaryFile() as f:
        f.write(records.numpy().tobytes())
        f.flush()
        mm = mmap.mmap(f.fileno(), n * stride, access=mmap.ACCESS_COPY)  # as the FTW reader maps data files
        view = torch.frombuffer(mm, dtype=torch.uint8).view(n, stride)
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(view.data_ptr(), n * stride, 8)  # 8 = cudaHostRegisterReadOnly
        if int(rc) != 0:
            torch.cuda.synchronize()
            return f"cudaHostRegister failed: {rc}"
        try:
            def copy():
                for i in range(n):
                    slots[i].copy_(view[i], non_blocking=True)  # noqa: F821 (bound until the `del view` below)

            return _rate(n * stride, copy, iters=5, cuda=True)
        finally:
            cudart.cudaHostUnregister(view.data_ptr())
            del view
            try:
                mm.close()
            except BufferError:  # a tensor still exports the buffer; the mapping goes with it
                pass


def run_bench(*, hidden: int = 2048, inter: int = 512, top_k: int = 8, pool_gib: float = 2.0,
              cpu_threads: int | None = None, copy_threads: int = 4, seconds: float = 2.0,
              registered_mmap: bool = False, progress=None) -> dict:
    """Measure everything (see the module docstring); needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("ft bench bw needs a CUDA GPU; none is visible to torch on this machine")
    from .transfer import CudaUploader

    say = progress or (lambda msg: None)
    dev = torch.device("cuda", 0)
    res: dict = {}
    big = 1 << 30
    say("pinned / pageable host <-> device copies")
    pinned = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(big // 4, dtype=torch.uint8)
    pageable.fill_(1)
    vram = torch.empty(big, dtype=torch.uint8, device=dev)
    # F821 false positive: the lambdas run inside _rate while the buffers are bound (they are `del`eted later)
    res["h2d_pinned"] = _rate(big, lambda: vram.copy_(pinned, non_blocking=True), iters=5, cuda=True)  # noqa: F821
    res["d2h_pinned"] = _rate(big, lambda: pinned.copy_(vram, non_blocking=True), iters=5, cuda=True)  # noqa: F821
    res["h2d_pageable"] = _rate(big // 4, lambda: vram[: big // 4].copy_(pageable), iters=3, cuda=True)  # noqa: F821
    del pageable

    layout = RecordLayout.packed(hidden, inter)
    count = max(16, int(pool_gib * big) // layout.stride)
    say(f"expert records: {count} x {layout.stride} B ({count * layout.stride / big:.1f} GiB pool)")
    host_pool = _synthetic_records(layout, count)  # pageable, like mmapped file pages
    n_copy = min(count, 256)
    pin_view = pinned[: (big // layout.stride) * layout.stride].view(-1, layout.stride)
    slots = torch.empty(n_copy, layout.stride, dtype=torch.uint8, device=dev)

    def pinned_records():
        for i in range(n_copy):
            slots[i].copy_(pin_view[(i * 7) % pin_view.shape[0]], non_blocking=True)

    res["h2d_expert_pinned"] = _rate(n_copy * layout.stride, pinned_records, iters=5, cuda=True)
    up = CudaUploader(slots, copy_threads=copy_threads)

    def staged_records(offset=0):
        for i in range(n_copy):
            up.upload(i, host_pool[(offset + i * 13) % count])
        up.fence()  # uploads are issued by the staging thread

    res["h2d_expert_staged"] = _rate(n_copy * layout.stride, staged_records, iters=5, cuda=True)
    if registered_mmap:  # opt-in: pins file pages; not yet seen working on every VM
        res["h2d_expert_registered_mmap"] = _registered_mmap_rate(host_pool[:n_copy], slots)
    del vram, pinned

    say("host memory read")
    threads = cpu_threads or lane_threads()  # as many as the CPU lane runs, the CPU path of steady-state decode
    flat = host_pool.view(-1)[: (host_pool.numel() // 4) * 4].view(torch.float32)
    res["host_read"] = _rate(flat.numel() * 4, lambda: flat.sum(), iters=5, cuda=False)

    say(f"CPU NVFP4 expert kernel ({threads} threads)")
    moe = CpuMoe(layout, threads=threads)
    x = torch.randn(1, hidden)
    groups = [np.array([j]) for j in range(top_k)]
    pair_tok = np.zeros(top_k, np.int64)
    pair_w = np.full(top_k, 1.0 / top_k, np.float32)
    rng = np.random.default_rng(0)

    def cpu_step():
        pick = rng.choice(count, top_k, replace=False)
        moe([host_pool[int(e)] for e in pick], groups, pair_tok, pair_w, x)

    res["cpu_expert"] = _rate(top_k * layout.payload_bytes, cpu_step, iters=max(20, int(seconds * 50)), cuda=False)
    res["cpu_fixed_s"], res["cpu_per_expert_s"] = _cpu_call_line(moe, host_pool, count, x, rng)
    res["cpu_backend"] = moe.backend

    say("PCIe fetches and CPU experts at the same time")
    stop = threading.Event()
    cpu_done = [0]

    def cpu_loop():
        while not stop.is_set():
            cpu_step()
            cpu_done[0] += 1

    th = threading.Thread(target=cpu_loop)
    t0 = time.perf_counter()
    th.start()
    fetched, k = 0, 0
    while time.perf_counter() - t0 < seconds:
        staged_records(k)
        k += 1
        fetched += n_copy
    torch.cuda.synchronize()
    stop.set()
    th.join()
    up.close()
    dt = time.perf_counter() - t0
    res["concurrent_pcie"] = fetched * layout.stride / dt / 1e9
    res["concurrent_cpu"] = cpu_done[0] * top_k * layout.payload_bytes / dt / 1e9

    b_p, b_c = res["concurrent_pcie"], res["concurrent_cpu"]
    return {
        "version": PROFILE_VERSION,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "gpu": gpu_identity(0),
        "cpu": {"model": platform.processor() or platform.machine(), "threads_used": threads,
                "copy_threads": copy_threads, "logical_cpus": os.cpu_count()},
        "expert": {"hidden": hidden, "inter": inter, "top_k": top_k, "record_bytes": layout.stride,
                   "payload_bytes": layout.payload_bytes},
        "gbs": res,
        "b_pcie": b_p * 1e9,
        "b_cpu": b_c * 1e9,
        "fetch_share": b_p / (b_p + b_c) if b_p + b_c > 0 else 0.0,
        "cpu_fixed_s": res["cpu_fixed_s"],
    }


def _cpu_call_line(moe, host_pool, count: int, x, rng) -> tuple[float, float]:
    """(fixed, per-expert) seconds of one batch-1 CPU kernel call, least squares over calls with 1..8 experts
    (medians of back-to-back calls, like decode: the worker team stays warm between them)."""
    ns, ts = [], []
    for n in (1, 2, 4, 8):
        groups, tok, w = [np.array([j]) for j in range(n)], np.zeros(n, np.int64), np.full(n, 1.0 / n, np.float32)
        times = []
        for _ in range(30):
            recs = [host_pool[int(e)] for e in rng.choice(count, n, replace=False)]
            t = time.perf_counter()
            moe(recs, groups, tok, w, x)
            times.append(time.perf_counter() - t)
        ns.append(n)
        ts.append(float(np.median(times)))
    per, fixed = np.polyfit(ns, ts, 1)
    return max(0.0, float(fixed)), max(1e-9, float(per))


def save_profile(prof: dict, path: Path | None = None) -> Path:
    path = path or profile_path(prof["gpu"]["uuid"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(prof, indent=2) + "\n")
    os.replace(tmp, path)
    return path
