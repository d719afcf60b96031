"""What tools/gpu_full_models.py measures besides tok/s: GPU time of CUDA graph replays, the bytes a decode step
moves (for the HBM bound), Belady's hit rate on the engine's own routing trace, how a prefill at a budget overlaps
its copies with its kernels, and what `ft plan` predicts for the row."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import torch


@contextlib.contextmanager
def timed_replays():
    """CUDA events (before, after) around every CUDA graph replay while the block runs, in replay order (patched on
    the class: graphs captured inside the block, as at a VRAM budget once the banks are mapped, count too)."""
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay(graph)
        b.record()
        marks.append((a, b))

    torch.cuda.CUDAGraph.replay = timed
    try:
        yield marks
    finally:
        torch.cuda.CUDAGraph.replay = replay


def replay_ms(model, size: int, reps: int = 20) -> float | None:
    """GPU time of one replay of the batch-`size` decode graph (CUDA events; its rows padding rows on the scratch
    state, each with its own random token so that rows route to different experts as a real batch's do): a decode
    step adds the sampling kernels, the token copies and any gaps to this."""
    g = model.graphs._graphs.get(size) if model.graphs is not None else None
    if g is None or g.graph is None:
        return None
    g.load(torch.zeros(0, dtype=torch.int64), [])  # all rows on the scratch state: never a freed sequence's buffers
    rng = torch.Generator().manual_seed(size)
    g.ids.copy_(torch.randint(1, model.config.vocab_size, (g.ids.shape[0],), generator=rng))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.graph.replay()
    start.record()
    for _ in range(reps):
        g.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def step_bytes(model, ex, batch: int, context: int) -> dict:
    cfg = model.config
    dense = [0]

    def count(_name, t):
        if t.is_cuda:
            dense[0] += t.numel() * t.element_size()
        return t

    model.map_weights(count)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    distinct = k if batch == 1 else E * (1 - (1 - k / E) ** batch)
    experts = len(ex.moe_layers) * distinct * ex.layout.payload_bytes
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    kv = batch * n_attn * context * 2 * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    state = batch * (cfg.num_layers - n_attn) * 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * \
        cfg.linear_value_head_dim
    return {"dense": dense[0], "experts": experts, "kv": kv, "deltanet_state": state,
            "total": dense[0] + experts + kv + state}


def plan_prediction(eng) -> dict | None:
    """`ft plan`'s prediction for this engine's VRAM split (`make_plan` with the split the engine measured), from the
    routing its cache has counted so far (what `--save-routing` keeps; the uniform prior before any) and this
    machine's `ft bench bw` rates (defaults without a profile): to set beside the row's measured decode."""
    from ft.runtime.plan.build import make_plan
    from ft.runtime.plan.routing import RoutingProfile

    ex = eng._experts
    if ex is None or ex.vram_plan is None:
        return None
    counts, tokens = ex.cache.observed()
    moe = list(ex.moe_layers)
    routing = RoutingProfile("trace", "routing counted before the measured window", int(tokens[moe].max()),
                             counts[moe].astype("int64")) if counts[moe].sum() else RoutingProfile.uniform("none yet")
    plan = make_plan(eng._reader, eng.settings, routing, measured=ex.vram_plan)
    p = plan.prediction
    return {"decode_tok_s": p.decode_tok_s, "prefill_tok_s": p.prefill_tok_s, "hit_rate": p.hit_rate,
            "rates": plan.machine.rates.source, "routing_tokens": routing.tokens}


def belady_row(ex, window: int) -> dict:
    """Belady's MIN (may bypass: a miss need not enter VRAM) on the engine's own routing trace with the same slots,
    over the same window (earlier steps warm both caches), beside the hit rate the scheduler reached."""
    from belady import belady

    b = belady(ex.trace, ex.E, ex.num_slots, bypass=True, count_from=window)
    hits, misses = ex.counters["hits"], ex.counters["misses"]
    b["hit_rate"] = b["hits"] / max(1, b["accesses"])
    b["ours_hit_rate"] = hits / max(1, hits + misses)
    b["ours_of_belady"] = b["ours_hit_rate"] / max(1e-9, b["hit_rate"])
    b["steps"] = len(ex.trace) - window
    return b


def prefill_overlap(model, tokens: int) -> dict:
    """Where one prefill forward of `tokens` tokens at a budget spends its time (torch.profiler, CUDA activity): wall
    ms from the first GPU event to the last, ms the kernels keep the GPU busy, ms copies run, ms both run at once,
    and ms neither does; the copies' bytes and rate; the kernels taking most time. The pipelined prefill
    (runtime/gpu/prefill_pipeline.py) should keep the copies running under the kernels: `both_ms` near `copy_ms`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from gpu_full_checks import _top, ids, prefill

    st = model.new_state(tokens + 1)
    toks = ids(tokens, model.config.vocab_size)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(model, st, toks)
        torch.cuda.synchronize()
    st.free()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return {"tokens": tokens, **overlap(events), "top_kernels": _top(prof, 1, n=12)}


def prefill_host(model, tokens: int, top: int = 12) -> dict:
    """The host's side of one prefill forward of `tokens` tokens: ms until the host has queued it all (`queued_ms`)
    against ms until the GPU finishes (`wall_ms`); the Python functions taking most host time (cProfile tottime);
    and every point where the host waited for the GPU (torch's sync debug mode), by the innermost frame of ours. A
    host that queues slower than the GPU runs, or waits on it mid-forward, leaves the GPU idle (`prefill_overlap`'s
    `idle_ms`)."""
    import cProfile
    import traceback
    import warnings
    from collections import Counter
    from time import perf_counter

    from gpu_full_checks import ids, prefill, python_top

    st = model.new_state(tokens + 1)
    toks = ids(tokens, model.config.vocab_size)
    sites: Counter = Counter()

    def on_sync(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack() if "/runtime/" in f.filename or "/ft/" in f.filename]
        f = ours[-1] if ours else None
        sites[f"{Path(f.filename).name}:{f.lineno}" if f else f"{Path(filename).name}:{lineno}"] += 1

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_sync
        torch.cuda.set_sync_debug_mode("warn")
        t0 = perf_counter()
        prof.enable()
        try:
            prefill(model, st, toks)
        finally:
            prof.disable()
            torch.cuda.set_sync_debug_mode("default")
        queued = perf_counter() - t0
    torch.cuda.synchronize()
    wall = perf_counter() - t0
    st.free()
    return {"tokens": tokens, "queued_ms": round(queued * 1e3, 2), "wall_ms": round(wall * 1e3, 2),
            "syncs": dict(sites.most_common()), "host_tottime_us": python_top(prof, 1, top)}


def overlap(events: list[dict]) -> dict:
    """`prefill_overlap`'s figures from chrome-trace events (ts / dur in us; copies' args.bytes)."""
    from gpu_full_checks import _busy

    spans = {c: [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") == c]
             for c in ("kernel", "gpu_memcpy")}
    every = spans["kernel"] + spans["gpu_memcpy"]
    if not every:
        return {}
    wall = max(b for _, b in every) - min(a for a, _ in every)
    kernels, _ = _busy(spans["kernel"])
    copies, _ = _busy(spans["gpu_memcpy"])
    either, _ = _busy(every)
    copied = sum(e.get("args", {}).get("bytes", 0) for e in events if e.get("cat") == "gpu_memcpy")
    return {"wall_ms": round(wall / 1e3, 2), "kernel_ms": round(kernels / 1e3, 2), "copy_ms": round(copies / 1e3, 2),
            "both_ms": round((kernels + copies - either) / 1e3, 2), "idle_ms": round((wall - either) / 1e3, 2),
            "copied_gb": round(copied / 1e9, 3), "copy_gbs": round(copied / max(copies, 1e-9) / 1e3, 1)}
