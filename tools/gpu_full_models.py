"""The per-model part of tools/gpu_full.py: load one full-size FTW resident and time decode and prefill.

Decode steps are timed as the engine runs them: a forward of B one-token segments, greedy argmax, the ids back on the
host (one sync per step). Tokens are random ids (seeded); routing of the synthetic checkpoint is as synthesized.
Bytes per decode step, for the HBM bound: every weight on the GPU outside the expert pool (read once per step), the
routed experts' records (B=1: exactly top-k distinct experts per layer; B>1: the expected distinct count under uniform
routing, E * (1 - (1 - k/E)^B)), the KV rows attended to and the DeltaNet states (read and written).
"""

from __future__ import annotations

import time
import traceback

import torch

from ft.formats import FtwReader
from ft.runtime.gpu.engine_setup import load_offloaded
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.model import Segment

CHUNK = 4096
GEN = torch.Generator().manual_seed(0)


def _ids(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=GEN).tolist()


def _prefill(model, state, ids: list[int]) -> torch.Tensor:
    logits = None
    for i in range(0, len(ids), CHUNK):
        part = ids[i:i + CHUNK]
        logits = model.forward(torch.tensor(part), [Segment(state, len(part))])[0]
    return logits


def decode(model, batch: int, context: int, steps: int, warmup: int = 3) -> dict:
    """B sequences with `context` prompt tokens each, then `steps` timed batched greedy steps."""
    V = model.config.vocab_size
    states = [model.new_state(context + warmup + steps + 2) for _ in range(batch)]
    toks = [int(_prefill(model, st, _ids(context, V))[-1].argmax()) for st in states]
    out, times = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = model.forward(torch.tensor(toks), [Segment(st, 1) for st in states])
        toks = torch.cat([lg[-1:] for lg in logits]).argmax(-1).tolist()
        if i >= warmup:
            times.append(time.perf_counter() - t)
            out.append(toks)
    for st in states:
        st.free()
    step = sorted(times)[len(times) // 2]
    return {"batch": batch, "context": context, "steps": steps, "median_step_ms": 1e3 * step,
            "mean_step_ms": 1e3 * sum(times) / len(times), "tok_s": batch / step, "tokens": out}


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
    return {"tokens": tokens, "chunk": CHUNK, "seconds": best, "tok_s": tokens / best}


def replay_ms(model, size: int, reps: int = 20) -> float | None:
    """GPU time of one replay of the batch-`size` decode graph (CUDA events; its rows all padding, so the host's
    share of a step -- embedding, tables, sampling, the read-back -- is what a decode step adds to this)."""
    g = model.graphs._graphs.get(size) if model.graphs is not None else None
    if g is None or g.graph is None:
        return None
    g.load(g.h[:0], [])  # every row on the scratch state: never the buffers of a freed sequence
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


def agreement(model, steps: int = 32) -> dict:
    """Teacher-forced logits of three paths on the same tokens (a 64-token prompt, then `steps` decode steps fed the
    graphed path's greedy tokens): graphed vs eager (same kernels), and the fused kernels vs the PyTorch reference
    ops. Per pair: max |dlogit| over the prefill's last position and every decode step, and the share of positions
    whose argmax agrees. (Free-running greedy runs would compare different inputs after the first flip.)"""
    V = model.config.vocab_size
    prompt = _ids(64, V)

    def run(fused: bool, graphs, feed: list[int] | None) -> tuple[list[int], torch.Tensor]:
        model.set_fused(fused)
        saved, model.graphs = model.graphs, graphs
        st = model.new_state(len(prompt) + steps + 2)
        rows = [_prefill(model, st, prompt)[-1].float()]
        toks = [int(rows[0].argmax())] if feed is None else list(feed)
        for i in range(steps):
            lg = model.forward(torch.tensor([toks[i]]), [Segment(st, 1)])[0][-1].float()
            rows.append(lg)
            if feed is None:
                toks.append(int(lg.argmax()))
        st.free()
        model.graphs = saved
        return toks, torch.stack(rows).cpu()

    feed, graphed = run(True, model.graphs, None)
    _, eager = run(True, None, feed)
    _, ref = run(False, None, feed)
    model.set_fused(True)

    def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
        return {"max_dlogit": float((a - b).abs().max()), "prefill_max_dlogit": float((a[0] - b[0]).abs().max()),
                "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}

    return {"positions": steps + 1, "logit_scale": float(ref.abs().max()),
            "graphed_vs_eager": compare(graphed, eager), "fused_vs_reference": compare(eager, ref)}


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
        tok = int(_prefill(model, st, _ids(context, V))[-1].argmax())
        model.forward(torch.tensor([tok]), [Segment(st, 1)])  # warm
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                tok = int(model.forward(torch.tensor([tok]), [Segment(st, 1)])[0][-1].argmax())
            torch.cuda.synchronize()
        st.free()
        out["decode_us_per_step"] = _top(prof, steps)
        st = model.new_state(prefill_tokens + 1)
        ids = _ids(prefill_tokens, V)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            _prefill(model, st, ids)
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


def bench_model(ftw, preset: str, *, hbm_gbs: float, log, llama: dict | None, deadline: float) -> dict:
    reader = FtwReader(ftw)
    t = time.perf_counter()
    model, ex = load_offloaded(reader, device="cuda", vram_budget=None, memory_ratio=0.9,
                               offload=OffloadConfig(mode="resident", prefetch=False), kv_reserve_tokens=8192,
                               max_running_requests=8, cuda_graphs=True)
    res: dict = {"load_s": time.perf_counter() - t, "graphs": dict(model.graphs.counters),
                 "vram_gib": torch.cuda.memory_allocated() / (1 << 30)}
    log(f"{preset}: loaded in {res['load_s']:.1f} s (graphs {res['graphs']})")
    rows = []
    for batch, context, steps in ((1, 32, 128), (1, 8192, 64), (4, 32, 64), (8, 32, 64)):
        if time.perf_counter() > deadline - 40:
            break
        try:
            r = decode(model, batch, context, steps)
        except Exception:  # noqa: BLE001 - keep the other rows
            rows.append({"batch": batch, "context": context, "error": traceback.format_exc()[-2000:]})
            log(f"{preset}: decode B={batch} ctx={context} failed:\n{rows[-1]['error']}")
            continue
        b = step_bytes(model, ex, batch, context)
        r["bytes_per_step"] = b
        r["bound_ms"] = 1e3 * b["total"] / (hbm_gbs * 1e9)
        r["of_bound"] = r["bound_ms"] / r["median_step_ms"]
        if llama and batch == 1 and context <= 512:
            r["vs_llama_cpp"] = r["tok_s"] / llama["decode_b1"]
        tokens = r.pop("tokens")
        r["first_tokens"] = tokens[:4]
        rows.append(r)
        log(f"{preset}: decode B={batch} ctx={context}: {r['tok_s']:.1f} tok/s ({r['median_step_ms']:.2f} ms/step, "
            f"bound {r['bound_ms']:.2f} ms, {r['of_bound']:.2f} of it"
            + (f", {r['vs_llama_cpp']:.2f}x llama.cpp" if "vs_llama_cpp" in r else "") + ")")
    res["decode"] = rows
    res["graphs_after_decode"] = dict(model.graphs.counters)
    res["graph_replay_ms"] = {size: replay_ms(model, size) for size in (1, 4, 8)}
    log(f"{preset}: graph replay alone (GPU time), ms: {res['graph_replay_ms']}")
    pre = []
    for tokens in (512, 4096, 16384):
        if time.perf_counter() > deadline - 40:
            break
        try:
            r = prefill(model, tokens)
        except Exception:  # noqa: BLE001
            pre.append({"tokens": tokens, "error": traceback.format_exc()[-2000:]})
            log(f"{preset}: prefill {tokens} failed:\n{pre[-1]['error']}")
            continue
        if llama and f"prefill_{tokens}" in llama:
            r["vs_llama_cpp"] = r["tok_s"] / llama[f"prefill_{tokens}"]
        pre.append(r)
        log(f"{preset}: prefill {tokens}: {r['tok_s']:.0f} tok/s" +
            (f" ({r['vs_llama_cpp']:.2f}x llama.cpp)" if "vs_llama_cpp" in r else ""))
    res["prefill"] = pre
    if time.perf_counter() < deadline - 45:
        try:
            res["profile"] = profile(model)
            top = res["profile"]["decode_us_per_step"]
            log(f"{preset}: decode kernels {top['total_us']:.0f} us/step: " + ", ".join(
                f"{k['name'][:40]} {k['us']:.0f}" for k in top["kernels"][:8]))
        except Exception:  # noqa: BLE001
            res["profile"] = {"error": traceback.format_exc()[-2000:]}
    if time.perf_counter() < deadline - 60:
        try:
            res["agreement"] = agreement(model)
        except Exception:  # noqa: BLE001
            res["agreement"] = {"error": traceback.format_exc()[-2000:]}
        log(f"{preset}: agreement {res['agreement']}")
    ex.close()
    del model, ex
    torch.cuda.empty_cache()
    return res
