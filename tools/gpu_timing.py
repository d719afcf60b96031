"""Timing helpers shared by the GPU benchmark scripts: the HBM read rate they compare against, and kernel time
from CUDA-graph replays (so launch overhead is the replay's, as in a decode step, not Python's)."""

from __future__ import annotations

import torch


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
