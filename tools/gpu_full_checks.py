"""The checks of tools/gpu_full.py on a loaded full-size model: agreement of the GPU paths, and where a decode step's
time goes (CUDA time per kernel; per engine step, the GPU's busy and idle time and the host's time per function).

Shared with gpu_full_models.py: the seeded random token ids and the chunked prefill.
"""

from __future__ import annotations

import cProfile
import gzip
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ft.runtime.layers import moe
from ft.runtime.model import Segment
from ft.runtime.sampling import SamplingParams

CHUNK = 4096
GEN = torch.Generator().manual_seed(0)


def ids(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=GEN).tolist()


def prefill(model, state, tokens: list[int]) -> torch.Tensor:
    """Prefill `tokens` in CHUNK-token forwards -> the last chunk's logits."""
    logits = None
    for i in range(0, len(tokens), CHUNK):
        part = tokens[i:i + CHUNK]
        logits = model.forward(torch.tensor(part), [Segment(state, len(part))])[0]
    return logits


class _Routing:
    """Wraps every MoE layer's experts call (`BoundExperts.__call__`): records each call's (ids, weights), or
    replaces them with a recorded run's, call by call (so two paths can be compared with identical routing)."""

    def __init__(self, replay: list | None = None) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.replay = replay

    def __enter__(self):
        self._orig = moe.BoundExperts.__call__
        orig, me = self._orig, self

        def call(bound, x, topk_ids, topk_weights):
            if me.replay is not None:
                topk_ids, topk_weights = me.replay[len(me.calls)]
            me.calls.append((topk_ids.clone(), topk_weights.clone()))
            return orig(bound, x, topk_ids, topk_weights)

        moe.BoundExperts.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        moe.BoundExperts.__call__ = self._orig


def teacher_forced(model, prompt: list[int], steps: int, graphs, feed: list[int] | None
                   ) -> tuple[list[int], torch.Tensor]:
    """Logits (fp32 [steps + 1, V], on the host) of the prompt's last position and `steps` decode steps fed `feed`
    (None: the run's own greedy tokens, returned), with `graphs` as the model's decode graphs (None: eager)."""
    saved, model.graphs = model.graphs, graphs
    st = model.new_state(len(prompt) + steps + 2)
    try:
        rows = [prefill(model, st, prompt)[-1].float()]
        toks = [int(rows[0].argmax())] if feed is None else list(feed)
        for i in range(steps):
            rows.append(model.forward(torch.tensor([toks[i]]), [Segment(st, 1)])[0][-1].float())
            if feed is None:
                toks.append(int(rows[-1].argmax()))
    finally:
        st.free()
        model.graphs = saved
    return toks, torch.stack(rows).cpu()


def agreement(model, steps: int = 32) -> dict:
    """Teacher-forced logits of the paths on the same tokens (a 64-token prompt, then `steps` decode steps fed the
    graphed path's greedy tokens): graphed vs eager (same kernels), the fused kernels vs the PyTorch reference ops,
    and the fused kernels vs the reference with the reference's routing forced on them (every MoE call gets the
    reference's expert ids and weights), which separates routing flips from numerical error. Per pair: max |dlogit|
    over the prefill's last position and every decode step, and the share of positions whose argmax agrees; plus the
    share of (token, layer) routing choices where the fused path picked a different expert set."""
    V = model.config.vocab_size
    prompt = ids(64, V)

    def run(fused: bool, graphs, feed: list[int] | None) -> tuple[list[int], torch.Tensor]:
        model.set_fused(fused)
        return teacher_forced(model, prompt, steps, graphs, feed)

    feed, graphed = run(True, model.graphs, None)
    with _Routing() as fused_routes:
        _, eager = run(True, None, feed)
    with _Routing() as ref_routes:
        _, ref = run(False, None, feed)
    with _Routing(replay=ref_routes.calls):
        _, forced = run(True, None, feed)
    model.set_fused(True)

    def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
        return {"max_dlogit": float((a - b).abs().max()), "prefill_max_dlogit": float((a[0] - b[0]).abs().max()),
                "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}

    differ = total = 0
    for (fi, _), (ri, _) in zip(fused_routes.calls, ref_routes.calls):
        differ += int((fi.sort(-1).values != ri.sort(-1).values).any(-1).sum())
        total += fi.shape[0]
    return {"positions": steps + 1, "logit_scale": float(ref.abs().max()),
            "graphed_vs_eager": compare(graphed, eager), "fused_vs_reference": compare(eager, ref),
            "fused_vs_reference_same_routing": compare(forced, ref),
            "routing_sets_differ": differ / max(total, 1)}


def lane_agreement(model, lane, steps: int = 32) -> dict:
    """Teacher-forced logits of one engine's decode with the CPU lane taking its share of the misses and with the
    lane off (the GPU copies every miss), on the same tokens: a 64-token prompt, then `steps` steps fed the lane
    run's greedy tokens. Graphed as served; then eagerly with the lane run's routing forced on the other, which
    separates routing flips (a near-tie between two experts decided the other way) from the numerical distance of
    the CPU kernel (the same function summed in another order, an activation maybe rounded to the other bf16
    neighbour)."""
    V = model.config.vocab_size
    prompt = ids(64, V)

    def run(on: bool, feed: list[int] | None, graphs) -> tuple[list[int], torch.Tensor]:
        lane.set_enabled(on)
        return teacher_forced(model, prompt, steps, graphs, feed)

    def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
        d = (a - b).abs()
        return {"max_dlogit": float(d.max()), "decode_max_dlogit": float(d[1:].max()),
                "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}

    try:
        feed, on = run(True, None, model.graphs)
        _, off = run(False, feed, model.graphs)
        with _Routing() as routes:
            _, on_eager = run(True, feed, None)
        with _Routing(replay=routes.calls):
            _, off_forced = run(False, feed, None)
    finally:
        lane.set_enabled(True)
    return {"positions": steps + 1, "logit_scale": float(off.abs().max()), "graphed": compare(on, off),
            "same_routing": compare(on_eager, off_forced)}


def profile(model, *, context: int = 512, steps: int = 8, prefill_tokens: int = 4096) -> dict:
    """CUDA time per kernel (torch.profiler): eager batch-1 decode steps (the graph replays the same kernels) and one
    prefill chunk -> the top kernels, in us per step / per chunk, so the gap to the bound can be split by cause."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    V = model.config.vocab_size
    saved, model.graphs = model.graphs, None
    out = {}
    try:
        st = model.new_state(context + steps + 2)
        tok = int(prefill(model, st, ids(context, V))[-1].argmax())
        model.forward(torch.tensor([tok]), [Segment(st, 1)])  # warm
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                tok = int(model.forward(torch.tensor([tok]), [Segment(st, 1)])[0][-1].argmax())
            torch.cuda.synchronize()
        st.free()
        out["decode_us_per_step"] = _top(prof, steps)
        st = model.new_state(prefill_tokens + 1)
        toks = ids(prefill_tokens, V)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            prefill(model, st, toks)
            torch.cuda.synchronize()
        st.free()
        out[f"prefill_{prefill_tokens}_us"] = _top(prof, 1)
    finally:
        model.graphs = saved
    return out


def _top(prof, per: int, n: int = 25) -> dict:
    rows = sorted(((e.key, e.device_time_total / per, e.count / per) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"total_us": total, "kernels": [{"name": k[:90], "us": round(us, 1), "calls": round(c, 1)}
                                           for k, us, c in rows[:n]]}


def python_top(prof_py: cProfile.Profile, per: int, n: int = 25) -> list[dict]:
    """The `n` Python functions with the most own time (cProfile tottime) per `per` (steps, or 1), in us."""
    rows = sorted(((f"{fn[0].rsplit('/', 1)[-1]}:{fn[1]}({fn[2]})", v[2] / per * 1e6, v[0] / per)
                   for fn, v in pstats.Stats(prof_py).stats.items()), key=lambda r: -r[1])
    return [{"fn": k[:80], "us": round(us, 1), "calls": round(c, 1)} for k, us, c in rows[:n]]


def engine_profile(eng, batch: int, *, steps: int = 24, trace: Path | None = None) -> dict:
    """Where a decode step's time goes with `batch` greedy requests through the engine, as `ft serve` runs them
    (steps in flight): wall ms per step; the GPU's busy ms per step (the union of kernel and copy intervals of a
    torch.profiler trace; a replayed graph's kernels appear one by one) and its idle gaps; host Python time per step
    by function (cProfile tottime: the blocking calls are the waits on the GPU, the rest is host work that must fit
    inside the GPU's time). `trace`: where the chrome trace is kept (gzipped)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    V = eng.config.vocab_size
    params = SamplingParams(max_tokens=4 * steps + batch + 16, temperature=0, ignore_eos=True)
    names = [f"profile{i}" for i in range(batch)]
    for name in names:
        eng.add_request(name, ids(32, V), params)
    for _ in range(batch + 4):  # prefills, then steps in flight
        eng.step()

    def run() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        return (time.perf_counter() - t) / steps

    wall = run()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        traced = run()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
    events = json.loads(raw)["traceEvents"]
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace, "wb") as f:
            f.write(raw)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy, gaps = _busy([(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu])
    prof_py = cProfile.Profile()
    prof_py.runcall(run)
    finish(eng, names)
    return {"batch": batch, "wall_us_per_step": round(wall * 1e6, 1), "traced_us_per_step": round(traced * 1e6, 1),
            "gpu_busy_us_per_step": round(busy / steps, 1), "gpu_gaps_over_5us_per_step": len(gaps) / steps,
            "gpu_gaps_us_per_step": round(sum(gaps) / steps, 1), "largest_gaps_us": sorted(gaps)[-8:],
            "kernels_marginal": _marginals(gpu, steps),
            "python_tottime_us_per_step": python_top(prof_py, steps)}


def finish(eng, names: list[str]) -> None:
    """Abort the benchmark's requests `names` and step the engine until nothing is left in it."""
    for name in names:
        eng.abort(name)
    while eng.has_unfinished():
        eng.step()


def _marginals(gpu: list[dict], steps: int) -> list[dict]:
    """What each kernel (by name and grid) adds to a step: its end minus the latest end of the GPU work before it.
    With PDL a kernel is launched, and its traced interval starts, while its predecessor still runs, so traced
    durations overlap and overstate; the marginal times add up to the step. Per kernel: calls per step, the median
    marginal us per call and the total per step."""
    per: dict[str, list[float]] = {}
    last = None
    for e in sorted(gpu, key=lambda e: e["ts"] + e.get("dur", 0)):
        end = e["ts"] + e.get("dur", 0)
        if last is not None:
            key = f"{e['name'][:48]} {e.get('args', {}).get('grid', '')}".strip()
            per.setdefault(key, []).append(end - last)
        last = end if last is None else max(last, end)
    rows = [{"kernel": k, "calls": round(len(v) / steps, 2), "median_us": round(statistics.median(v), 2),
             "us_per_step": round(sum(v) / steps, 1)} for k, v in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:16]


def _busy(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Union length of [start, end) intervals (us) and the gaps > 5 us between them, first start to last end."""
    busy, gaps, end = 0.0, [], None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None and a - end > 5:
                gaps.append(round(a - end, 1))
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, gaps
