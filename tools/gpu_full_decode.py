"""The timed primitives of tools/gpu_full_models.py (and tools/bench_plan.py): decode through the engine as `ft serve`
runs it, one prefill forward, decode graphs with and without programmatic dependent launch, and the engine settings
every row shares."""

from __future__ import annotations

import time

import torch

from ft.runtime.engine import Engine, EngineSettings, SamplingParams
import gpu_full_checks
from gpu_full_checks import finish
from gpu_full_checks import ids as _ids
from gpu_full_checks import prefill as _prefill
from gpu_full_measures import replay_ms, timed_replays

CONTEXT_LONG = 8192  # the long-context decode row (the engines reserve KV for it)


def set_sizes(context: int, chunk: int) -> None:
    """The long-context decode row's context (the KV every engine reserves) and the prefill chunk (the engines' and
    the prefill forwards'): smaller for a model whose dense weights leave a small budget little room (`--context`)."""
    global CONTEXT_LONG
    CONTEXT_LONG = context
    gpu_full_checks.CHUNK = chunk


def decode(eng: Engine, batch: int, context: int, steps: int, warmup: int = 3) -> dict:
    """B requests with `context` prompt tokens each, decoded greedily through the engine as `ft serve` runs them
    (steps in flight: each `step` call launches the next decode step, then lands the previous one's tokens). The step
    time is the wall time from the call that lands every request's token `warmup` to the one that lands token
    `warmup + steps`, over the steps between: throughput as a client sees it, host work included (one call's own
    time depends on where the step in flight is, so calls are not timed one by one). Beside it, from CUDA events
    around each graph replay in that window: the replay's GPU time and the period from one replay's start to the
    next's (the difference is the GPU work between replays, or the GPU waiting for the host)."""
    V = eng.config.vocab_size
    params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0, ignore_eos=True)
    names = [f"b{i}" for i in range(batch)]
    for name in names:
        eng.add_request(name, _ids(context, V), params)
    out: dict[str, list[int]] = {name: [] for name in names}
    start = end = None
    with timed_replays() as marks:
        while eng.has_unfinished() and end is None:
            for ev in eng.step():
                if ev.token_id is not None:
                    out[ev.request_id].append(ev.token_id)
            done = min(len(v) for v in out.values())
            if start is None and done >= warmup:
                start, first, mark0 = time.perf_counter(), done, len(marks)
            elif start is not None and done >= warmup + steps:
                end, last, mark1 = time.perf_counter(), done, len(marks)
        torch.cuda.synchronize()
    finish(eng, names)
    if end is None:
        raise RuntimeError(f"decode B={batch}: the requests ended before {warmup + steps} tokens")
    step = (end - start) / (last - first)
    res = {"batch": batch, "context": context, "steps": last - first, "step_ms": 1e3 * step, "tok_s": batch / step,
           "tokens": [out[name][warmup:warmup + 8] for name in names]}
    window = marks[mark0:mark1]
    if len(window) > 1:
        res["replay_gpu_ms"] = sum(a.elapsed_time(b) for a, b in window) / len(window)
        res["replay_period_ms"] = window[0][0].elapsed_time(window[-1][0]) / (len(window) - 1)
    return res


def pdl_ab(eng: Engine) -> dict:
    """Decode graphs captured with programmatic dependent launch (`gpu/kernels/pdl.py`, the default where supported)
    against the same graphs without it: GPU ms of a replay at batch 1 and 8, and decode batch 1 through the engine."""
    from ft.runtime.gpu.kernels import pdl

    out: dict = {"supported": pdl.ENABLED}
    graphs = eng.model.graphs
    if not pdl.ENABLED or graphs is None:
        return out

    def measure(on: bool) -> dict:
        pdl.ENABLED = on
        graphs._graphs.clear()  # captured again, with this launch mode, on the next warm / step
        graphs.warm()
        return {"replay_ms": {size: replay_ms(eng.model, size) for size in (1, 8)},
                "decode_b1_tok_s": decode(eng, 1, 32, 64)["tok_s"]}

    try:
        out["off"] = measure(False)
    finally:
        out["on"] = measure(True)
    return out


def engine(ftw, *, vram_budget: int | None = None, offload=None, dense_weights: str = "auto") -> Engine:
    return Engine(ftw, EngineSettings(device="cuda", kv_reserve_tokens=CONTEXT_LONG + 256,
                                      max_prefill_length=gpu_full_checks.CHUNK,
                                      max_running_requests=8, vram_budget=vram_budget, dense_weights=dense_weights),
                  offload=offload)


def prefill(model, tokens: int, repeat: int = 2) -> dict:
    V = model.config.vocab_size
    best = None
    for _ in range(repeat):
        st = model.new_state(tokens + 1)
        ids = _ids(tokens, V)
        torch.cuda.synchronize()
        t = time.perf_counter()
        _prefill(model, st, ids)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        st.free()
        best = dt if best is None else min(best, dt)
    return {"tokens": tokens, "chunk": gpu_full_checks.CHUNK, "seconds": best, "tok_s": tokens / best}
