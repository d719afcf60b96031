"""Stage `e2e` of tools/gpu_bench.py: per routing, decode at every placement against the Belady bound, the engine
path, prefill at every length against the PCIe roofline (pieces in gpu_bench_parts.py).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np
import torch

from belady import belady
from gpu_bench_parts import (GIB, attach, build_checkpoint, check_logits, chunked_prefill, engine_budget, ftw_path,
                             greedy, scaled_slots)

from ft.formats import FtwReader
from ft.runtime.gpu.graphs import DecodeGraphs
from ft.runtime.gpu.hybrid import GpuExperts
from ft.runtime.gpu.offload_config import OffloadConfig


def run_decode(model, reader, opts: OffloadConfig, prompt: list[int], *, warmup: int, tokens: int,
               profile: dict | None, device_plan: bool | None = None, graphs: bool = True) -> dict:
    """One placement: warm up, then prefill `prompt` and time `tokens` greedy decode steps after it (the issue's
    "512 tokens after a 2k prompt"); counters over the decode window only. device_plan=False: a resident model
    decodes through the host-planned kernel, the one offloaded placements use. graphs: one-token steps replay CUDA
    graphs where the placement allows (`DecodeGraphs`; each decode's state is captured once, inside the window)."""
    cuda = model.device.type == "cuda"
    ex = GpuExperts(reader, opts, device=str(model.device), profile=profile, device_plan=device_plan)
    attach(model, ex)
    model.graphs = DecodeGraphs(model, ex) if graphs else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    greedy(model, prompt, warmup)  # fills the cache, compiles kernels
    ex.wait_pinned()  # steady state: every bank page-locked before the timed window (pinning runs on a thread)
    mark = [0]
    # F821 false positive: the lambda runs inside greedy(), while `ex` is bound; ruff flags it for the `del ex` below
    toks, times, _ = greedy(model, prompt, tokens + 1,
                            after_prefill=lambda: mark.__setitem__(0, ex.reset_stats()))  # noqa: F821
    ex.settle()  # mode mapped counts routing when it comes back
    s = ex.stats()
    n = len(times)
    res = {"mode": opts.mode, "num_slots": ex.num_slots, "prompt_tokens": len(prompt), "tok_s": n / sum(times),
           "ms_per_token": 1e3 * sum(times) / n, "median_ms": 1e3 * float(np.median(times)),
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
           "stats": s, "tokens": toks, "graphs": dict(model.graphs.counters) if graphs else None}
    res["h2d_mb_per_token"] = s["bytes_h2d"] / n / 1e6
    res["cpu_mb_per_token"] = s["bytes_cpu"] / n / 1e6
    res["mapped_mb_per_token"] = s.get("bytes_mapped", 0) / n / 1e6  # read by GPU kernels from host memory
    res["_trace"], res["_trace_start"], res["_steps"] = list(ex.trace), mark[0], n
    ex.close()
    model.graphs = None
    attach(model, lambda *a: (_ for _ in ()).throw(RuntimeError("experts detached")))
    del ex
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def bound(res: dict, *, resident_ms: float, host_planned_ms: float | None, num_experts: int, payload: int,
          b_pcie: float, b_cpu: float, eager_ms: float | None = None) -> dict:
    """Bound per token = Belady misses x payload / (B_pcie + B_cpu) + resident time, on this run's own trace.
    resident_ms: the fastest resident decode (CUDA graphs); eager_ms: resident decode without graphs.

    `gap_ms` splits measured - bound into what stands in the way: `eager` (a placement whose steps ran without CUDA
    graphs pays the eager resident run's extra host time), `host_path` (the host-planned path's own cost with every
    expert resident: the resident_host_planned run minus eager resident), `traffic` (bytes moved beyond Belady's,
    over both links at full rate) and `rest` (transfer waits not hidden behind compute, CPU-side stalls)."""
    trace, start, tokens = res.pop("_trace"), res.pop("_trace_start"), res.pop("_steps")
    opt = belady(trace, num_experts, res["num_slots"], count_from=start)
    miss_bytes = opt["misses"] * payload / tokens
    t = miss_bytes / (b_pcie + b_cpu) + resident_ms / 1e3
    out = {"belady_misses_per_token": opt["misses"] / tokens,
           "belady_hit_rate": opt["hits"] / max(1, opt["accesses"]), "miss_mb_per_token_belady": miss_bytes / 1e6,
           "bound_ms": t * 1e3, "bound_tok_s": 1 / t, "fraction_of_bound": res["tok_s"] * t}
    if host_planned_ms is not None:
        moved = sum(res["stats"].get(k, 0) for k in ("bytes_h2d", "bytes_cpu", "bytes_mapped")) / tokens
        # mode mapped never takes the host-planned path in decode: nothing of its cost applies
        eager = eager_ms if eager_ms is not None else resident_ms
        replayed = bool(res.get("graphs") and res["graphs"]["replays"])
        gap = {"eager": 0.0 if replayed else eager - resident_ms,
               "host_path": 0.0 if res["mode"] == "mapped" else host_planned_ms - eager,
               "traffic": 1e3 * max(0.0, moved - miss_bytes) / (b_pcie + b_cpu)}
        gap["rest"] = res["ms_per_token"] - out["bound_ms"] - sum(gap.values())
        out["gap_ms"] = gap
    return out


def prefill_runs(model, reader, args, *, prof: dict, h2d_link: float, deadline: float, log=print) -> dict:
    """Prefill at each of args.prefill_lengths, chunked by args.prefill_chunk: all experts resident vs streamed
    through the prefill buffers at each of args.prefill_budgets. Roofline: streamed bytes / the pinned H2D rate."""
    cfg = reader.config
    g = torch.Generator().manual_seed(2)
    out = {}
    placements = [("resident", OffloadConfig(mode="resident", prefetch=False))]
    for gib in args.prefill_budgets:
        sc = scaled_slots(int(gib * GIB), reader, full_layers=40, kv_tokens=args.kv_tokens, reserve=GIB // 2,
                          prefill_slots=args.prefill_slots, keep_quantized=args.dense == "quantized")
        placements.append((f"stream@{gib:g}GiB", OffloadConfig(mode="offload", num_slots=sc["num_slots"],
                                                               prefill_slots=args.prefill_slots, prefetch=False)))
    for name, opts in placements:
        ex = GpuExperts(reader, opts, device=args.device, profile=prof)
        attach(model, ex)
        warm = torch.randint(0, cfg.vocab_size, (min(args.prefill_chunk, 2048),), generator=g).tolist()
        chunked_prefill(model, warm, args.prefill_chunk)  # warm-up (kernel compile); prefill never admits
        for length in args.prefill_lengths:
            # resident 12k tok/s, streamed 6k (H200, 4 layers), x3 runs + margin
            if time.time() + 3 * length / (12000 if name == "resident" else 6000) + 5 > deadline:
                out.setdefault("skipped", []).append(f"{name} {length}: not enough time left")
                continue
            prompt = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
            ex.reset_stats()
            times = [chunked_prefill(model, prompt, args.prefill_chunk) for _ in range(2)]
            s = ex.stats()
            t = min(times)
            streamed = s["bytes_h2d"] / len(times)
            res = {"tokens": length, "chunk": args.prefill_chunk, "seconds": t, "tok_s": length / t,
                   "streamed_gb": streamed / 1e9, "experts_streamed": s["prefill_streamed"] / len(times)}
            if streamed:
                res["pcie_roofline_tok_s"] = length / (streamed / h2d_link)
                res["fraction_of_roofline"] = res["tok_s"] / res["pcie_roofline_tok_s"]
            out[f"{name}/{length}"] = res
            log(f"prefill {name} {length}: {res['tok_s']:.0f} tok/s, streamed {res['streamed_gb']:.2f} GB")
        ex.close()
        del ex
        _empty_cache()
    return out


def engine_run(ftw: Path, reader: FtwReader, *, budget_gib: float, log, tokens: int = 48, pin: bool = True) -> dict:
    """The product path: Engine(device="cuda", vram_budget=...) sizes the cache itself; greedy decode of `tokens`,
    each decode step split into forward / sample / accept / schedule / other (tools/engine_probe.py), plus the
    tensor reads to the host outside model.forward per step. The budget is the measured dense weights + KV + buffers
    + reserve + the same expert share that `budget_gib` gives the full model (`engine_budget`)."""
    import statistics

    from engine_probe import PHASES, engine_round

    from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate

    budget, sc = engine_budget(reader, budget_gib)
    t = time.perf_counter()
    offload = None if pin else OffloadConfig(mode="hybrid", pin_host_bytes=0)  # pin=False: no page-locked banks
    eng = Engine(reader, EngineSettings(device="cuda", vram_budget=budget, kv_reserve_tokens=8192), offload=offload)
    load_s = time.perf_counter() - t  # the engine serves while its banks are page-locked on a thread
    getattr(eng._experts, "wait_pinned", lambda: None)()  # time the steady state
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, reader.config.vocab_size, (64,), generator=g).tolist()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    generate(eng, prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # warm-up
    res = generate(eng, prompt, params)
    steps = engine_round(eng, [prompt], params)
    counted = engine_round(eng, [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), count=True)
    moe = eng.stats()["moe"]
    out = {"budget_gib": budget / GIB, "load_s": load_s, "scaled_slots": sc["num_slots"],
           "num_slots": moe.get("num_slots"), "mode": moe.get("mode"), "vram": moe.get("vram"),
           "decode_tok_s": res.timings.get("decode_tok_s"), "prefill_tok_s": res.timings.get("prefill_tok_s"),
           "tokens": len(res.token_ids), "moe": moe,
           "step_ms_median": {k: statistics.median(s[k] for s in steps) for k in ("step", *PHASES, "other")},
           "host_reads_per_step": statistics.median(s["reads"] for s in counted),
           "cuda_graphs": eng.stats().get("cuda_graphs")}
    log(f"engine @ {out['budget_gib']:.2f} GiB: {out['num_slots']} slots ({out['mode']}), decode "
        f"{out['decode_tok_s']:.1f} tok/s, hit {moe.get('hit_rate')}, step ms {out['step_ms_median']}")
    eng.close()
    del eng
    _empty_cache()
    return out


def stage_e2e(args, prof: dict, out: dict, flush, plan, log=print) -> dict:
    """Per routing (admitted by the time plan): build/load, decode at every placement, engine, prefill."""
    from gpu_bench_plan import routing_estimate

    from ft.runtime.gpu.record_layout import RecordLayout
    from ft.runtime.model import load_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    # B_pcie of the bound: the link's rate for expert records from page-locked memory, the physical limit (the
    # profile's b_pcie is the staged path's concurrent rate, which only an unpinned run is held to)
    b_p, b_c = max(prof["b_pcie"], (prof["gbs"].get("h2d_expert_pinned") or 0) * 1e9), prof["b_cpu"]
    h2d_link = prof["gbs"]["h2d_pinned"] * 1e9
    deadline = plan.deadline
    out.update({"layers": args.layers, "full_layers": 40, "b_pcie_gbs": b_p / 1e9, "b_cpu_gbs": b_c / 1e9,
                "routings": {}})
    routings = args.routings.split(",")
    for i, routing in enumerate(routings):
        built = ftw_path(work, args.layers, routing, args.preset).is_dir()
        if not plan.admit(f"e2e:{routing}", routing_estimate(args, built, first=i == 0)):
            log(f"skipping {routing}: {plan.skipped[f'e2e:{routing}']}")
            continue
        ftw = build_checkpoint(work, args.layers, routing, log, preset=args.preset)
        reader = FtwReader(ftw)
        cfg = reader.config
        E, moe_layers = cfg.num_experts, sum(t == "moe" for t in cfg.mlp_types)
        model = load_model(reader, device=args.device, experts=lambda *a: None,
                           keep_quantized=args.dense == "quantized")
        r: dict = {"ftw": ftw.name, "dense": args.dense,
                   "dense_allocated_gib": torch.cuda.memory_allocated() / GIB if args.device == "cuda" else None}
        out["routings"][routing] = r
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist()
        common = dict(prefill_slots=args.prefill_slots, prefetch=not args.no_prefetch)
        if args.no_pin:
            common["pin_host_bytes"] = 0
        # F821 false positive: run() is only called while `model` is bound (the loop body ends with `del model`)
        run = lambda opts, p=prompt, **kw: run_decode(model, reader, opts, p, warmup=args.warmup,  # noqa: E731, F821
                                                      tokens=args.tokens, profile=prof, **kw)
        # Steady state: every record's checksum verified once (the reader checks lazily on first touch, which would
        # otherwise land inside the timed window), and one throw-away run absorbs one-time costs (JIT, allocator).
        t_verify = time.perf_counter()
        for j, kind in enumerate(cfg.mlp_types):
            if kind == "moe":
                bank = reader.bank(f"layers.{j}.mlp.experts")
                for e in range(bank.num_experts):
                    bank.record(e)
        r["verify_records_s"] = time.perf_counter() - t_verify
        run(OffloadConfig(mode="resident", **common))
        resident = run(OffloadConfig(mode="resident", **common))
        resident_eager = run(OffloadConfig(mode="resident", **common), graphs=False)
        # resident experts through the host-planned path (a sync per layer, the tile kernel): its time minus the
        # eager resident time is the host-planned path's own cost; its tokens show how far the two kernels agree
        resident_host = run(OffloadConfig(mode="resident", **common), device_plan=False)
        for res in (resident, resident_eager, resident_host):
            for k in ("_trace", "_trace_start", "_steps"):
                res.pop(k, None)
        layout = RecordLayout.for_model(reader.bank(f"layers.{cfg.mlp_types.index('moe')}.mlp.experts"), cfg)
        if i == 0 and not args.no_logits:
            ex = GpuExperts(reader, OffloadConfig(mode="resident", prefetch=False), device=args.device)
            attach(model, ex)
            r["logits_vs_cpu"] = check_logits(ftw, model, prompt[:16])
            log(f"logits vs CPU: {r['logits_vs_cpu']}")
            ex.close()
            del ex
            _empty_cache()
        r["resident"], r["resident_eager"], r["resident_host_planned"] = resident, resident_eager, resident_host
        log(f"{routing} resident: {resident['tok_s']:.1f} tok/s (graphs {resident['graphs']}; eager "
            f"{resident_eager['tok_s']:.1f}, host-planned {resident_host['tok_s']:.1f})")
        runs = r["decode"] = {}
        flush()
        for gib in args.budgets:
            sc = scaled_slots(int(gib * GIB), reader, full_layers=40, kv_tokens=args.kv_tokens, reserve=GIB // 2,
                              prefill_slots=args.prefill_slots, keep_quantized=args.dense == "quantized")
            per_run = 3 + (args.warmup + args.tokens) / 40  # seconds at ~40 tok/s (H200, 4 layers, 8 GiB)
            for mode in args.modes.split(","):
                key = f"{mode}@{gib:g}GiB"
                if time.time() + per_run > deadline:
                    r.setdefault("skipped", []).append(f"{key}: not enough time left")
                    continue
                # mode[-staged|-eager][+aN][+mX]: A/B without page-locked banks / without CUDA graphs;
                # admit_max N, admit_margin X
                name, *knobs = mode.split("+")
                pin = {"pin_host_bytes": 0} if name.endswith("-staged") else {}
                knob = {"a": ("admit_max", int), "m": ("admit_margin", float)}
                extra = {knob[kn[0]][0]: knob[kn[0]][1](kn[1:]) for kn in knobs}
                res = run(OffloadConfig(mode=name.removesuffix("-eager").removesuffix("-staged"),
                                        num_slots=sc["num_slots"], **pin, **extra, **common),
                          graphs=not name.endswith("-eager"))
                res["budget"] = sc
                res["bound"] = bound(res, resident_ms=resident["ms_per_token"],
                                     host_planned_ms=resident_host["ms_per_token"], num_experts=E,
                                     payload=layout.payload_bytes, b_pcie=b_p, b_cpu=b_c,
                                     eager_ms=resident_eager["ms_per_token"])
                runs[key] = res
                flush()
                log(f"{routing} {key}: {res['tok_s']:.1f} tok/s, hit {res['stats']['hit_rate']:.2f}, "
                    f"bound {res['bound'].get('bound_tok_s', 0):.1f} tok/s")
            n_gpu = min(moe_layers, sc["num_slots"] // E)
            if n_gpu < moe_layers and time.time() + per_run < deadline:
                cpu_layers = tuple(j for j, t in enumerate(cfg.mlp_types) if t == "moe")[: moe_layers - n_gpu]
                # At most 128 prompt tokens: static prefills its CPU layers on the CPU (2k tokens there could take
                # minutes); decode speed barely depends on the context at this length.
                res = run(OffloadConfig(mode="static", cpu_layers=cpu_layers, **common), prompt[:128])
                res.pop("_trace"), res.pop("_trace_start"), res.pop("_steps")
                res["budget"] = sc
                runs[f"static@{gib:g}GiB"] = res
                flush()
                log(f"{routing} static@{gib:g}GiB ({len(cpu_layers)} CPU layers): {res['tok_s']:.1f} tok/s")
        ref_tokens = resident["tokens"]  # offloaded decode runs the same device-planned kernel
        # static decodes after a shorter prompt: no reference
        for res in (resident, resident_eager, resident_host, *runs.values()):
            same = res["prompt_tokens"] == resident["prompt_tokens"]
            res["greedy_equal_to_resident"] = sum(a == b for a, b in zip(res["tokens"], ref_tokens)) if same else None
            res["greedy_prefix_equal"] = next((i for i, (a, b) in enumerate(zip(res["tokens"], ref_tokens)) if a != b),
                                              min(len(res["tokens"]), len(ref_tokens))) if same else None
            res["greedy_len"] = len(res.pop("tokens"))  # ref_tokens keeps the resident list
        if i == 0 and args.device == "cuda" and time.time() + 20 < deadline:
            r["engine"] = engine_run(ftw, reader, budget_gib=args.budgets[0], log=log, pin=not args.no_pin)
            flush()
        r["prefill"] = prefill_runs(model, reader, args, prof=prof, h2d_link=h2d_link, deadline=deadline, log=log)
        flush()
        del model
        _empty_cache()
    return out


def _empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
