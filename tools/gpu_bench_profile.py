"""Stage `profile` of tools/gpu_bench.py: torch.profiler (CPU + CUDA) over a few decode tokens of each path.

    resident_direct   all experts in VRAM, the bench's own loop (model.forward + argmax)
    hybrid<B>_direct  mode hybrid (the engine's default) at the first --budgets budget B (scaled slots), the bench's
                      own loop, with the bench's bandwidth profile
    mapped<B>_direct  mode mapped at B: misses read by the kernel from the mapped banks, no host sync
    static<B>_direct  mode static at B: the first MoE layers' experts computed on the CPU (llama.cpp's --n-cpu-moe)
    engine<B>         Engine(device, vram_budget=...) at the same scaled budget: the `ft serve --vram-budget` path
                      (its scheduler reads the profile `ft bench bw` saved on this machine, if any)
    engine_resident   Engine with the whole VRAM (every expert fits: it runs mode resident)

engine_* vs *_direct isolates what the engine adds; *_budget vs *_resident what the budget costs. The bench names
the model's pieces for the profiler by wrapping them here (nothing in the runtime is edited): each layer's
attention / deltanet / moe / mlp, the lm_head, and on the engine path the engine's forward, sample, accept,
schedule and prepare. Per path: the top-30 ops by self device time and by self CPU time (one text file for all
paths), a JSON summary (ms/token with and without the profiler, time per tag, host syncs, copies and scalar reads
per token and which tag issued them), and optionally a gzipped Chrome trace.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpy", "cudaMemcpyAsync")
READS = ("aten::_local_scalar_dense",)  # item() / int() / float() / bool() of a tensor: a sync on a device tensor
TAGS = ("attention", "deltanet", "moe", "mlp", "lm_head", "sample", "accept", "schedule", "prepare", "forward")


class _Tagged:
    """Stands in for one of a layer's ops: calls it inside a record_function range."""

    def __init__(self, op, tag: str) -> None:
        self._op, self._tag = op, tag

    def __call__(self, *a, **kw):
        with record_function(self._tag):
            return self._op(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._op, name)


@contextlib.contextmanager
def tagged(model, engine=None):
    """Name the model's pieces (and the engine's, if given) for the profiler; everything is restored on exit."""
    undo = []

    def wrap(owner, name: str, tag: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        own, original = name in vars(owner), vars(owner).get(name)

        def ranged(*a, **kw):
            with record_function(tag):
                return fn(*a, **kw)

        setattr(owner, name, ranged)
        undo.append(lambda: setattr(owner, name, original) if own else delattr(owner, name))

    for layer in model.layers:
        for attr in ("self_attn", "linear_attn", "mlp"):
            op = vars(layer).get(attr)
            if op is not None:
                tag = {"self_attn": "attention", "linear_attn": "deltanet"}.get(attr) or (
                    "moe" if "moe" in type(op).__name__.lower() else "mlp")
                setattr(layer, attr, _Tagged(op, tag))
                undo.append(lambda layer=layer, attr=attr, op=op: setattr(layer, attr, op))
    wrap(model, "logits_head", "lm_head")
    if engine is not None:
        from engine_probe import engine_pieces

        for owner, name, tag in engine_pieces(engine):
            wrap(owner, name, tag)
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _dev(evt, self_only: bool) -> float:
    """Device microseconds of a profiler event (names differ across torch versions)."""
    names = ("self_device_time_total", "self_cuda_time_total") if self_only else ("device_time_total",
                                                                                  "cuda_time_total")
    for n in names:
        v = getattr(evt, n, None)
        if isinstance(v, (int, float)):
            return float(v)
    return 0.0


def _tag_of(evt) -> str | None:
    p = evt.cpu_parent
    while p is not None:
        if p.name in TAGS:
            return p.name
        p = p.cpu_parent
    return None


def summarize(prof, tokens: int, wall_s: float) -> dict:
    """ms/token per tag (CPU range time and device time of its kernels), syncs/copies per token and by tag."""
    events = list(prof.events())
    main = {e.thread for e in events if e.name == "token"}
    per = lambda x: round(x / tokens, 3)  # noqa: E731
    by_tag, syncs, copies, reads = {}, {}, {}, {}
    for e in events:
        if e.name in TAGS:
            d = by_tag.setdefault(e.name, {"cpu_ms": 0.0, "device_ms": 0.0, "calls": 0})
            d["cpu_ms"] += e.cpu_time_total / 1e3
            d["device_ms"] += _dev(e, False) / 1e3
            d["calls"] += 1
        elif e.name.startswith(SYNCS + COPIES) or e.name in READS:
            where = _tag_of(e) or ("untagged" if e.thread in main else "other_threads")
            table = syncs if e.name.startswith(SYNCS) else copies if e.name.startswith(COPIES) else reads
            table.setdefault(e.name, {}).setdefault(where, 0)
            table[e.name][where] += 1
    token_ms = 1e3 * wall_s / tokens
    ka = prof.key_averages()
    busy = sum(_dev(a, True) for a in ka) / 1e3
    launches = sum(a.count for a in ka if a.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                            "cudaLaunchKernelExC"))
    return {
        "tokens": tokens, "ms_per_token_profiled": round(token_ms, 3),
        "device_busy_ms_per_token": per(busy), "kernel_launches_per_token": per(launches),
        "by_tag_per_token": {t: {k: per(v) for k, v in d.items()} | {"share_of_token": round(
            d["cpu_ms"] / tokens / token_ms, 3)} for t, d in by_tag.items()},
        "syncs_per_token": {n: {w: per(c) for w, c in d.items()} for n, d in syncs.items()},
        "copies_per_token": {n: {w: per(c) for w, c in d.items()} for n, d in copies.items()},
        "scalar_reads_per_token": {n: {w: per(c) for w, c in d.items()} for n, d in reads.items()},
        "sync_cpu_ms_per_token": per(sum(a.self_cpu_time_total for a in ka if a.key.startswith(SYNCS)) / 1e3),
    }


def tables(prof) -> str:
    ka = prof.key_averages()
    out = []
    for title, keys in (("self device time", ("self_cuda_time_total", "self_device_time_total")),
                        ("self CPU time", ("self_cpu_time_total",))):
        for key in keys:
            try:
                out.append(f"-- top 30 by {title}\n{ka.table(sort_by=key, row_limit=30, max_name_column_width=60)}")
                break
            except (AttributeError, KeyError, ValueError):
                continue
    return "\n".join(out)


def run_profiled(name: str, step, tokens: int, device: str, out: Path, trace: bool) -> tuple[dict, str]:
    """Time `tokens` calls of `step` unprofiled, then profile as many; -> (summary, tables text)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(tokens):
        step()
    sync()
    plain = time.perf_counter() - t
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(tokens):
            with record_function("token"):
                step()
        sync()
        wall = time.perf_counter() - t
    summary = {"ms_per_token": round(1e3 * plain / tokens, 3), **summarize(prof, tokens, wall)}
    if trace:
        raw = out / f"trace_{name}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(out / f"trace_{name}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    return summary, f"==== {name}: {tokens} decode tokens\n{tables(prof)}\n"


def direct_step(model, prompt: list[int], warm: int, tokens: int):
    """Prefill `prompt`, decode `warm` tokens; returns a step() that decodes one more token (batch 1, greedy)."""
    from ft.runtime.model import Segment

    state = model.new_state(len(prompt) + warm + 2 * tokens + 2)
    tok = [int(model.forward(torch.tensor(prompt), [Segment(state, len(prompt))])[0][-1].argmax())]

    def step():
        tok[0] = int(model.forward(torch.tensor(tok), [Segment(state, 1)])[0][-1].argmax())

    for _ in range(warm):
        step()
    return step, state


def engine_step(engine, prompt: list[int], warm: int, tokens: int):
    """Queue one greedy request and run it `warm` tokens in; returns a step() = one engine.step()."""
    from ft.runtime.engine import SamplingParams

    engine.add_request("profile", prompt, SamplingParams(max_tokens=warm + 2 * tokens + 4, temperature=0.0,
                                                         ignore_eos=True))
    produced = 0
    while produced < warm:
        produced += sum(e.token_id is not None for e in engine.step())
    return lambda: engine.step()


def stage_profile(args, bw_profile: dict, out: Path, res: dict, plan, log=print) -> None:
    """The paths on the first routing's checkpoint; summaries into `res`, tables into out/profile_tables.txt."""
    import gpu_bench_parts as e2e

    from ft.formats import FtwReader
    from ft.runtime.engine import Engine, EngineSettings
    from ft.runtime.gpu.hybrid import GpuExperts
    from ft.runtime.gpu.offload_config import OffloadConfig
    from ft.runtime.model import load_model

    cuda = args.device == "cuda"
    routing = args.routings.split(",")[0]
    reader = FtwReader(e2e.build_checkpoint(Path(args.work), args.layers, routing, log, preset=args.preset))
    cfg = reader.config
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    n, gib = args.profile_tokens, args.budgets[0]
    sc = e2e.scaled_slots(int(gib * e2e.GIB), reader, full_layers=40, kv_tokens=args.kv_tokens, reserve=e2e.GIB // 2,
                          prefill_slots=args.prefill_slots, keep_quantized=args.dense == "quantized")
    res.update(routing=routing, budget_gib=gib, scaled_slots=sc["num_slots"], prompt=len(prompt))
    per_path = 4 + 3 * n / 40 + len(prompt) / 6000  # seconds: setup, warm + unprofiled + profiled tokens, prefill
    texts = []
    keys = ("mode", "num_slots", "hit_rate", "fetched", "misses", "cpu_experts", "bytes_h2d", "prefetch_issued")

    def record(name: str, step, experts, trace: bool) -> None:
        experts.reset_stats()
        res[name], text = run_profiled(name, step, n, args.device, out, trace)
        getattr(experts, "settle", lambda: None)()
        st = experts.stats()
        res[name]["experts"] = {k: st.get(k) for k in keys}  # over 2 x tokens steps (unprofiled + profiled)
        texts.append(text)
        log(f"profile {name}: {res[name]['ms_per_token']:.2f} ms/token ({res[name]['ms_per_token_profiled']:.2f} "
            f"profiled), syncs {res[name]['syncs_per_token']}")

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])):
        torch.ones(1, device=args.device).add_(1)  # the profiler's one-time start-up (CUPTI), outside the paths
    model = load_model(reader, device=args.device, experts=lambda *a: None, keep_quantized=args.dense == "quantized")
    pin = {"pin_host_bytes": 0} if args.no_pin else {}  # the pin probe failed, or --no-pin
    moe_layers = tuple(j for j, t in enumerate(cfg.mlp_types) if t == "moe")
    static_cpu = moe_layers[: len(moe_layers) - min(len(moe_layers), sc["num_slots"] // cfg.num_experts)]
    paths = [("resident_direct", OffloadConfig(mode="resident", prefill_slots=args.prefill_slots)),
             (f"hybrid{gib:g}_direct", OffloadConfig(mode="hybrid", num_slots=sc["num_slots"],
                                                     prefill_slots=args.prefill_slots, **pin)),
             (f"mapped{gib:g}_direct", OffloadConfig(mode="mapped", num_slots=sc["num_slots"],
                                                     prefill_slots=args.prefill_slots, **pin))]
    if static_cpu:  # the --n-cpu-moe baseline at the same budget (its e2e time is the one not yet explained)
        paths.append((f"static{gib:g}_direct", OffloadConfig(mode="static", cpu_layers=static_cpu,
                                                             prefill_slots=args.prefill_slots)))
    for name, opts in paths:
        if not plan.admit(f"profile:{name}", per_path):
            continue
        ex = GpuExperts(reader, opts, device=args.device, profile=bw_profile)
        ex.allocate()
        ex.wait_pinned()  # page-locking runs on a thread; profile the steady state
        e2e.attach(model, ex)
        with tagged(model):
            # static prefills its CPU layers on the CPU: a short prompt, as in stage e2e
            step, state = direct_step(model, prompt[:128] if opts.mode == "static" else prompt, n, n)
            record(name, step, ex, args.profile_trace and name != "resident_direct")
        state.free()
        ex.close()
    del model
    gc.collect()
    kv = max(8192, len(prompt) + 4 * n + 16)
    budget, _ = e2e.engine_budget(reader, gib, kv_tokens=kv)
    engines = ((f"engine{gib:g}", (budget, OffloadConfig(mode="hybrid", **pin) if pin else None) if cuda
                else (None, OffloadConfig(mode="hybrid", num_slots=sc["num_slots"], prefill_slots=args.prefill_slots))),
               ("engine_resident", (None, None if cuda else OffloadConfig(mode="resident"))))
    for name, (vram, offload) in engines:
        if not plan.admit(f"profile:{name}", per_path + 5):
            continue
        eng = Engine(reader, EngineSettings(device=args.device, kv_reserve_tokens=kv, vram_budget=vram),
                     offload=offload)
        getattr(eng._experts, "wait_pinned", lambda: None)()
        with tagged(eng.model, eng):
            step = engine_step(eng, prompt, n, n)
            record(name, step, eng._experts, args.profile_trace and name != "engine_resident")
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
    (out / "profile_tables.txt").write_text("".join(texts))
