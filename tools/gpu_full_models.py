"""The per-model part of tools/gpu_full.py: serve one full-size FTW resident and at VRAM budgets; time decode, prefill.

Decode steps are timed through the engine, as `ft serve` runs them: B greedy requests, each step call launching the
next decode step before it lands the previous one's tokens. Tokens are random ids (seeded); routing of the synthetic
checkpoint is as synthesized.
Bytes per decode step, for the HBM bound: every weight on the GPU outside the expert pool (read once per step), the
routed experts' records (B=1: exactly top-k distinct experts per layer; B>1: the expected distinct count under uniform
routing, E * (1 - (1 - k/E)^B)), the KV rows attended to and the DeltaNet states (read and written).
"""

from __future__ import annotations

import gc
import re
import time
import traceback
from pathlib import Path

import torch

from ft.runtime.gpu import store
from ft.runtime.gpu.offload_config import OffloadConfig
from gpu_full_checks import agreement, engine_profile, lane_agreement, profile
import gpu_full_decode
from gpu_full_decode import decode, engine, pdl_ab, prefill
from gpu_full_measures import belady_row, plan_prediction, prefill_host, prefill_overlap, replay_ms, step_bytes

WARM_TOKENS = 256  # decoded before the steady-state window of a budget row
TRACE = 200_000  # routing steps the budget engines keep for the Belady row


def bench_budget(ftw, gib: float, *, log, llama: dict | None, steps: int = 64, variant: dict | None = None,
                 traces: Path | None = None, preset: str = "model") -> dict:
    """The default scheduler (`ft serve --vram-budget`) at `gib` GiB: decode batch 1 at a 32-token context once the
    banks are page-locked (and again after WARM_TOKENS of routing, then at a CONTEXT_LONG context), prefill of 4096
    tokens twice (the first in a process includes compiling the prefill kernels: `prefill_first`), and the process's
    peak device memory against the budget: the allocator's peak plus what the device held outside the allocator while
    the engine ran (what nvidia-smi shows; meaningful for the first engine of a process only: later ones may find
    memory the earlier ones left).
    `variant`: OffloadConfig fields that differ from the default scheduler's (e.g. {"cpu_lane": False}: the GPU
    copies every miss; "dense" is `--dense-weights`, e.g. {"dense": "dequantized"}). `traces`: where the engine's
    routing trace goes (`preset` names the file)."""
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    fields = {"trace_limit": TRACE, **(variant or {})}
    dense = fields.pop("dense", "auto")
    eng = engine(ftw, vram_budget=int(gib * (1 << 30)), offload=OffloadConfig(**fields), dense_weights=dense)
    lane = eng._experts.opts.cpu_lane
    model, ex = eng.model, eng._experts
    res: dict = {"budget_gib": gib, "mode": ex.opts.mode, "variant": variant or {}, "cpu_lane": lane,
                 "load_s": time.perf_counter() - t,
                 "plan": ex.vram_plan.as_dict() if ex.vram_plan is not None else None}
    res["pin"] = {k: v for k, v in ex.wait_pinned(timeout=120).items() if isinstance(v, (int, float, str))}
    res["pinned_after_s"] = time.perf_counter() - t
    try:
        r = decode(eng, 1, 32, steps, warmup=16)
        res["decode"] = r  # with its first tokens: lane on and off must agree
        predicted = plan_prediction(eng)  # from the routing seen so far, before the measured window
        # steady state: the cache has seen WARM_TOKENS of routing (a server's cache outlives its requests); the
        # counters cover this window only
        ex.settle()
        window = ex.reset_stats()  # trace position where the counted window starts
        lane_obj = ex.mapped.lane if ex.mapped is not None else None
        before = lane_obj.counters() if lane_obj is not None else None
        res["decode_warm"] = decode(eng, 1, 32, steps, warmup=WARM_TOKENS)
        ex.settle()
        if lane_obj is not None:  # the lane's own counts over the same window as the read-back counters
            res["lane_window"] = {k: v - before[k] for k, v in lane_obj.counters().items()}
        res["belady"] = belady_row(ex, window)
        # the row's files: letters, digits, '.', '_' and '-' only (the device hands back no other names)
        tag = re.sub(r"[^\w.-]", "", f"{preset}-{gib:g}gib" + "".join(f"-{k}-{v}" for k, v in (variant or {}).items()))
        if traces is not None:  # the routing (warm-up and window) for offline admission studies (tools/belady.py)
            from belady import save_trace

            name = f"routing-{tag}"
            save_trace(traces / f"{name}.jsonl", ex.trace)
            res["trace"] = {"file": f"{name}.jsonl", "window_from": window, "num_slots": ex.num_slots,
                            "num_experts": ex.E, "moe_layers": list(ex.moe_layers)}
        stats = ex.stats()
        res["moe"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        res["lane"] = stats.get("cpu_lane")
        tokens = max(1, res["moe"]["tokens"] // max(1, len(ex.moe_layers)))  # prompt + decoded tokens, per layer
        res["bytes_per_token"] = {k: res["moe"][c] / tokens for k, c in
                                  (("gpu_mapped", "bytes_mapped"), ("cpu", "bytes_cpu"), ("uploads", "bytes_h2d"))}
        res["engine_profile"] = engine_profile(eng, 1, steps=16, trace=traces and traces / f"trace_{tag}.json.gz")
        # attention over the KV the plan sized
        res["decode_8k"] = decode(eng, 1, gpu_full_decode.CONTEXT_LONG, steps, warmup=16)
        engine_stats = eng.stats()
        res["cuda_graphs"] = engine_stats.get("cuda_graphs")
        placement = engine_stats.get("plan")  # the placement it started from (the FTW's or planned at start)
        if placement and placement.get("predicted_decode_tok_s"):
            res["placement"] = {**placement, "warm_over_predicted":
                                res["decode_warm"]["tok_s"] / placement["predicted_decode_tok_s"]}
        if predicted is not None:  # `ft plan`'s model for this split, whatever the engine started from
            res["plan_prediction"] = {**predicted, "warm_over_predicted":
                                      res["decode_warm"]["tok_s"] / predicted["decode_tok_s"]}
        if lane and stats.get("cpu_lane") and not variant:
            res["lane_agreement"] = lane_agreement(model, ex.mapped.lane)
        res["prefill_first"] = prefill(model, 4096, repeat=1)  # the process's first: Triton compiles its kernels
        res["prefill"] = prefill(model, 4096, repeat=1)
        res["prefill_overlap"] = prefill_overlap(model, 4096)
        res["prefill_host"] = prefill_host(model, 4096)
        res["prefill_short"] = {n: prefill(model, n, repeat=3) for n in (16, 48)}  # a short prompt or new turn
        slices, store.MAPPED_SLICES = store.MAPPED_SLICES, 0  # beside it, the host-planned path they took before
        try:
            res["prefill_short_host"] = {n: prefill(model, n, repeat=3) for n in (16, 48)}
        finally:
            store.MAPPED_SLICES = slices
        if llama and f"decode_{gib:g}gib" in llama:
            for row in ("decode", "decode_warm"):
                res[row]["vs_llama_cpp"] = res[row]["tok_s"] / llama[f"decode_{gib:g}gib"]
        # while the engine lives: the device's use (context + allocator + what bypasses it) beside the allocator's
        free, total = torch.cuda.mem_get_info()
        res["device_used_gib"] = (total - free) / (1 << 30)
        res["outside_allocator_gib"] = res["device_used_gib"] - torch.cuda.memory_reserved() / (1 << 30)
    finally:
        eng.close()
        del model, ex, eng
        gc.collect()  # reference cycles would keep the closed engine's tensors alive past empty_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        res["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
        res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / (1 << 30)
        res["context_gib"] = (total - free) / (1 << 30)  # what stays: the CUDA context and its module images
        # the allocator's peak plus what the device held outside it while the engine ran (the CUDA context, module
        # images, library workspaces): nvidia-smi's peak, if this engine is the process's first
        res["peak_device_gib"] = res["peak_reserved_gib"] + res.get("outside_allocator_gib", res["context_gib"])
    bpt = {k: round(v / 1e6, 1) for k, v in res.get("bytes_per_token", {}).items()}
    log(f"budget {gib:g} GiB ({res['mode']}, {variant or 'default'}): decode {res['decode']['tok_s']:.1f} "
        f"tok/s (after {WARM_TOKENS} tokens: {res['decode_warm']['tok_s']:.1f}; at {gpu_full_decode.CONTEXT_LONG}: "
        f"{res['decode_8k']['tok_s']:.1f}), MB/token {bpt}, prefill 4096 "
        f"{res['prefill']['tok_s']:.0f} tok/s (first "
        f"{res['prefill_first']['tok_s']:.0f}; copies {res.get('prefill_overlap', {}).get('copy_ms')} ms, under "
        f"kernels {res.get('prefill_overlap', {}).get('both_ms')} ms), prefill 16 / 48 "
        f"{' / '.join('%.1f' % (1e3 * r['seconds']) for r in res.get('prefill_short', {}).values())} ms (host-planned "
        f"{' / '.join('%.1f' % (1e3 * r['seconds']) for r in res.get('prefill_short_host', {}).values())}), "
        f"peak {res['peak_device_gib']:.2f} GiB incl. "
        f"context; lane "
        f"{res.get('lane')}")
    return res


def bench_model(ftw, preset: str, *, hbm_gbs: float, log, llama: dict | None, deadline: float,
                budgets: tuple[float, ...] = (), resident: bool = True, traces: Path | None = None,
                variants: tuple[dict, ...] = ()) -> dict:
    """The resident rows (unless `resident` is off), then each VRAM budget in its own engine (`bench_budget`).
    `traces`: where the engine profiles' chrome traces go. `variants`: OffloadConfig overrides each budget also runs
    with, after the default scheduler."""
    res = bench_resident(ftw, preset, hbm_gbs=hbm_gbs, log=log, llama=llama, deadline=deadline,
                         traces=traces) if resident else {}
    res["budgets"] = []
    for gib, variant in [(g, v) for v in ({}, *variants) for g in budgets]:  # every default row first
        if time.perf_counter() > deadline - 90:
            break
        try:
            res["budgets"].append(bench_budget(ftw, gib, log=log, llama=llama, variant=variant, traces=traces,
                                               preset=preset))
        except Exception:  # noqa: BLE001
            res["budgets"].append({"budget_gib": gib, "error": traceback.format_exc()[-2000:]})
            log(f"budget {gib} GiB failed:\n{res['budgets'][-1]['error']}")
        # the failed row's traceback held its engine's tensors until here: give the allocator's blocks back, or the
        # next engine's plan counts them as memory in use outside it
        gc.collect()
        torch.cuda.empty_cache()
    return res


def bench_resident(ftw, preset: str, *, hbm_gbs: float, log, llama: dict | None, deadline: float,
                   traces: Path | None = None) -> dict:
    t = time.perf_counter()
    eng = engine(ftw, offload=OffloadConfig(mode="resident"))
    model, ex = eng.model, eng._experts
    res: dict = {"load_s": time.perf_counter() - t, "graphs": dict(model.graphs.counters),
                 "vram_gib": torch.cuda.memory_allocated() / (1 << 30)}
    log(f"{preset}: loaded in {res['load_s']:.1f} s (graphs {res['graphs']})")
    rows = []
    for batch, context, steps in ((1, 32, 128), (1, gpu_full_decode.CONTEXT_LONG, 64), (4, 32, 64), (8, 32, 64)):
        if time.perf_counter() > deadline - 40:
            break
        try:
            r = decode(eng, batch, context, steps)
        except Exception:  # noqa: BLE001 - keep the other rows
            rows.append({"batch": batch, "context": context, "error": traceback.format_exc()[-2000:]})
            log(f"{preset}: decode B={batch} ctx={context} failed:\n{rows[-1]['error']}")
            continue
        b = step_bytes(model, ex, batch, context)
        r["bytes_per_step"] = b
        r["bound_ms"] = 1e3 * b["total"] / (hbm_gbs * 1e9)
        r["of_bound"] = r["bound_ms"] / r["step_ms"]
        if llama and batch == 1 and context <= 512:
            r["vs_llama_cpp"] = r["tok_s"] / llama["decode_b1"]
        tokens = r.pop("tokens")
        r["first_tokens"] = tokens[:4]
        rows.append(r)
        log(f"{preset}: decode B={batch} ctx={context}: {r['tok_s']:.1f} tok/s ({r['step_ms']:.2f} ms/step, "
            f"bound {r['bound_ms']:.2f} ms, {r['of_bound']:.2f} of it"
            + (f", {r['vs_llama_cpp']:.2f}x llama.cpp" if "vs_llama_cpp" in r else "")
            + (f"; replay {r['replay_gpu_ms']:.2f} ms GPU every {r['replay_period_ms']:.2f} ms"
               if "replay_gpu_ms" in r else "") + ")")
    res["decode"] = rows
    res["graphs_after_decode"] = dict(model.graphs.counters)
    res["graph_replay_ms"] = {size: replay_ms(model, size) for size in (1, 4, 8)}
    log(f"{preset}: graph replay alone (GPU time), ms: {res['graph_replay_ms']}")
    try:
        res["pdl"] = pdl_ab(eng)
    except Exception:  # noqa: BLE001
        res["pdl"] = {"error": traceback.format_exc()[-2000:]}
    log(f"{preset}: PDL on / off: {res['pdl']}")
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
        res["engine_profile"] = []
        for batch in (1, 8):
            try:
                r = engine_profile(eng, batch, trace=traces and traces / f"trace_{preset}_b{batch}.json.gz")
                log(f"{preset}: engine step B={batch}: {r['wall_us_per_step']:.0f} us wall, GPU busy "
                    f"{r['gpu_busy_us_per_step']:.0f} us, idle gaps {r['gpu_gaps_us_per_step']:.0f} us; host: " +
                    ", ".join(f"{k['fn'][-40:]} {k['us']:.0f}" for k in r["python_tottime_us_per_step"][:8]))
            except Exception:  # noqa: BLE001
                r = {"batch": batch, "error": traceback.format_exc()[-2000:]}
            res["engine_profile"].append(r)
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
    eng.close()
    del model, ex, eng
    gc.collect()
    torch.cuda.empty_cache()
    return res
