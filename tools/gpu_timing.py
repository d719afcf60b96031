"""Timing helpers shared by the GPU benchmark scripts: the HBM read rate they compare against, kernel time from
CUDA-graph replays (so launch overhead is the replay's, as in a decode step, not Python's), and the host CPU they ran
beside."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def host_cpu() -> dict:
    """The host as the CPU lane sees it: CPU model, the CPUs this process may run on, how many distinct physical cores
    they are (fewer: SMT siblings, which share a core's load ports) and NUMA nodes. The lane runs all CPUs but two."""
    cpus = sorted(os.sched_getaffinity(0))
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "") if Path("/proc/cpuinfo").exists() else ""
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(cpu)))
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    return {"model": model, "cpus": len(cpus), "physical_cores": len(cores), "numa_nodes": nodes}


def hbm_read_gbs(nbytes: int = 4 << 30) -> float:
    """GB/s of a bf16 sum over `nbytes` (one read of each byte), the median of 5 replays after a warm one."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    us = graph_us([lambda: x.sum(dtype=torch.float32)], reps=1)
    return nbytes / us / 1e3


def capture(fn, warmups: int = 2):
    """fn() run `warmups` times on a side stream (compiles, first-call checks; torch.cuda.graph needs the warm-up
    off the capturing stream), then captured and replayed once -> (graph, fn's output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    return graph, out


def graph_us(fns, reps: int = 20, samples: int = 15) -> float:
    """Median us per call of `reps` calls (fns[i % len(fns)]() for call i) captured in one CUDA graph."""
    graph, _ = capture(lambda: [fns[i % len(fns)]() for i in range(reps)])
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return sorted(times)[len(times) // 2]
