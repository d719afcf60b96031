"""End-to-end pieces of tools/gpu_bench.py: checkpoint, budget scaling, correctness checks, decode and prefill runs.

Budget scaling (a checkpoint with fewer layers than the real model): the full model's dense weights (embeddings,
lm_head, attention / DeltaNet, shared experts, routers; as the runtime holds them on the GPU, dequantized to bf16),
its KV reserve, the activation reserve and the two prefill buffers come off the budget first; what is left is
divided evenly over the full model's MoE layers, and the benchmark model gets that share for each of its layers.
"""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ft.formats import FtwReader
from ft.runtime.gpu.belady import belady
from ft.runtime.gpu.hybrid import GpuExperts
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.layers.moe import BoundExperts
from ft.runtime.model import Segment, load_model

GIB = 1 << 30


def build_checkpoint(work: Path, layers: int, routing: str, log) -> Path:
    """synth (Qwen3.6-35B-A3B geometry, NVFP4) -> compile -> drop the HF dirs; returns the FTW path."""
    from ft.compiler import compile_checkpoint
    from ft.compiler.synth import synth

    ftw = work / f"q36-{layers}L-{routing}.ftw"
    if ftw.is_dir() and any(ftw.iterdir()):
        log(f"reusing {ftw}")
        return ftw
    hf = work / f"q36-{layers}L-{routing}-hf"
    t = time.perf_counter()
    # The vision tower is irrelevant to MoE serving and is cut to one tiny block to save disk and build time.
    tiny_vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, num_position_embeddings=16,
                       patch_size=16)
    synth("qwen3_5_moe", "qwen3.6-35b-a3b", hf, quant="nvfp4", routing=routing, num_layers=layers, force=True,
          overrides={"vision": tiny_vision})
    t_synth = time.perf_counter() - t
    t = time.perf_counter()
    compile_checkpoint(hf, ftw)
    log(f"checkpoint {routing}: synth {t_synth:.0f} s, compile {time.perf_counter() - t:.0f} s")
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(hf.with_name(hf.name + "-twin"), ignore_errors=True)
    return ftw


def dense_gpu_bytes(reader: FtwReader) -> tuple[int, dict[int, int]]:
    """(bytes outside layers, bytes per layer) of the dense weights as the runtime holds them (bf16, fp32 norms)."""
    quant = reader.quant.get("linears") or {}
    nonlayer, per_layer = 0, {}
    for name in reader.tensor_names():
        base = name.rsplit(".", 1)[0]
        if base in quant and not name.endswith(".weight"):
            continue  # scales fold into the dequantized weight
        t = reader.tensor(name)
        numel = t.numel() * (2 if base in quant and quant[base] == "nvfp4" else 1)
        size = 4 if name.endswith(("norm.weight", ".dt_bias", ".A_log")) else 2
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            per_layer[i] = per_layer.get(i, 0) + numel * size
        else:
            nonlayer += numel * size
    return nonlayer, per_layer


def scaled_slots(budget: int, reader: FtwReader, *, full_layers: int, kv_tokens: int, reserve: int,
                 prefill_slots: int) -> dict:
    cfg = reader.config
    stride = reader.bank(f"layers.{[i for i, t in enumerate(cfg.mlp_types) if t == 'moe'][0]}.mlp.experts").stride
    nonlayer, per_layer = dense_gpu_bytes(reader)
    dense_full = nonlayer + sum(per_layer.values()) / len(per_layer) * full_layers
    full_attn_share = sum(t == "full_attention" for t in cfg.layer_types) / cfg.num_layers
    kv_full = kv_tokens * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * full_attn_share * full_layers
    fixed = dense_full + kv_full + reserve + 2 * prefill_slots * stride
    share = max(0.0, (budget - fixed) / full_layers)  # slot bytes per MoE layer
    n_moe = sum(t == "moe" for t in cfg.mlp_types)
    slots = min(int(share * n_moe // stride), n_moe * cfg.num_experts)
    return {"budget_gib": budget / GIB, "dense_full_gib": dense_full / GIB, "kv_full_gib": kv_full / GIB,
            "slot_share_per_layer_mib": share / 2**20, "num_slots": slots,
            "cached_fraction": slots / (n_moe * cfg.num_experts)}


def attach(model, experts) -> None:
    """Point every MoE layer of a loaded model at another experts implementation."""
    for i, kind in enumerate(model.config.mlp_types):
        if kind == "moe":
            model.layers[i].mlp.experts = BoundExperts(experts, i)


def greedy(model, prompt: list[int], n_new: int, after_prefill=None) -> tuple[list[int], list[float], float]:
    """(tokens, per-decode-step seconds, prefill seconds) for batch-1 greedy decoding."""
    state = model.new_state(len(prompt) + n_new + 1)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    logits = model.forward(torch.tensor(prompt), [Segment(state, len(prompt))])[0]
    tok = int(logits[-1].argmax())
    t_prefill = time.perf_counter() - t
    if after_prefill is not None:
        after_prefill()
    out, times = [tok], []
    for _ in range(n_new - 1):
        t = time.perf_counter()
        logits = model.forward(torch.tensor([tok]), [Segment(state, 1)])[0]
        tok = int(logits[-1].argmax())  # the host read syncs
        times.append(time.perf_counter() - t)
        out.append(tok)
    state.free()
    return out, times, t_prefill


def check_logits(ftw: Path, gpu_model, prompt: list[int]) -> dict:
    """Last-token logits of the GPU model (resident experts) against the CPU runtime on the same FTW."""
    cpu = load_model(ftw, device="cpu")
    st_c, st_g = cpu.new_state(len(prompt)), gpu_model.new_state(len(prompt))
    a = cpu.forward(torch.tensor(prompt), [Segment(st_c, len(prompt))])[0][-1].double()
    b = gpu_model.forward(torch.tensor(prompt), [Segment(st_g, len(prompt))])[0][-1].double().cpu()
    st_c.free()
    st_g.free()
    del cpu
    gc.collect()
    return {"rel_err": float((a - b).norm() / a.norm()), "max_abs": float((a - b).abs().max()),
            "top1_equal": bool(a.argmax() == b.argmax()),
            "top5_overlap": len(set(a.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist()))}


def run_decode(model, reader, opts: OffloadConfig, prompt: list[int], *, warmup: int, tokens: int,
               profile: dict | None) -> dict:
    """One placement: warm up, then time `tokens` greedy decode steps; counters over the timed window only."""
    cuda = model.device.type == "cuda"
    ex = GpuExperts(reader, opts, device=str(model.device), profile=profile)
    attach(model, ex)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    greedy(model, prompt, warmup)  # fills the cache, compiles kernels
    mark = [0]
    toks, times, _ = greedy(model, prompt[:8], tokens + 1, after_prefill=lambda: mark.__setitem__(0, ex.reset_stats()))
    s = ex.stats()
    n = len(times)
    res = {"mode": opts.mode, "num_slots": ex.num_slots, "tok_s": n / sum(times),
           "ms_per_token": 1e3 * sum(times) / n, "median_ms": 1e3 * float(np.median(times)),
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
           "stats": s, "tokens": toks}
    res["h2d_mb_per_token"] = s["bytes_h2d"] / n / 1e6
    res["cpu_mb_per_token"] = s["bytes_cpu"] / n / 1e6
    res["_trace"], res["_trace_start"], res["_steps"] = list(ex.trace), mark[0], n
    ex.close()
    attach(model, lambda *a: (_ for _ in ()).throw(RuntimeError("experts detached")))
    del ex
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def bound(res: dict, *, resident_ms: float, num_experts: int, payload: int, b_pcie: float, b_cpu: float) -> dict:
    """Bound per token = Belady misses x payload / (B_pcie + B_cpu) + resident time, on this run's own trace."""
    trace, start, tokens = res.pop("_trace"), res.pop("_trace_start"), res.pop("_steps")
    opt = belady(trace, num_experts, res["num_slots"], count_from=start)
    miss_bytes = opt["misses"] * payload / tokens
    t = miss_bytes / (b_pcie + b_cpu) + resident_ms / 1e3
    return {"belady_misses_per_token": opt["misses"] / tokens,
            "belady_hit_rate": opt["hits"] / max(1, opt["accesses"]), "miss_mb_per_token_belady": miss_bytes / 1e6,
            "bound_ms": t * 1e3, "bound_tok_s": 1 / t, "fraction_of_bound": res["tok_s"] * t}


def prefill_runs(model, reader, args, *, prompt_len: int, prof: dict, h2d_link: float, stride: int,
                 deadline: float) -> dict:
    """Prefill of one `prompt_len` chunk: all experts resident vs streamed through the prefill buffers."""
    cfg = reader.config
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    out = {}
    sc = scaled_slots(int(args.budgets[0] * GIB), reader, full_layers=40, kv_tokens=args.kv_tokens,
                      reserve=GIB // 2, prefill_slots=args.prefill_slots)
    for name, opts in (("resident", OffloadConfig(mode="resident", prefetch=False)),
                       (f"stream@{args.budgets[0]}GiB", OffloadConfig(mode="offload", num_slots=sc["num_slots"],
                                                                     prefill_slots=args.prefill_slots,
                                                                     prefetch=False))):
        if time.time() + 25 > deadline:
            continue
        ex = GpuExperts(reader, opts, device=args.device, profile=prof)
        attach(model, ex)
        greedy(model, prompt, 1)  # warm-up (kernel compile, cache fill by nothing: prefill never admits)
        ex.reset_stats()
        times = []
        for _ in range(2):
            _, _, t = greedy(model, prompt, 1)
            times.append(t)
        s = ex.stats()
        t = min(times)
        streamed = s["bytes_h2d"] / len(times)
        res = {"tokens": prompt_len, "seconds": t, "tok_s": prompt_len / t, "streamed_gb": streamed / 1e9,
               "experts_streamed": s["prefill_streamed"] / len(times)}
        if streamed:
            res["pcie_roofline_tok_s"] = prompt_len / (streamed / h2d_link)
            res["fraction_of_roofline"] = res["tok_s"] / res["pcie_roofline_tok_s"]
        out[name] = res
        print(f"prefill {name}: {res['tok_s']:.0f} tok/s, streamed {res['streamed_gb']:.2f} GB")
        ex.close()
        del ex
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def engine_run(ftw: Path, reader: FtwReader, *, budget_gib: float, log, tokens: int = 48) -> dict:
    """The product path: Engine(device="cuda", vram_budget=...) sizes the cache itself; greedy decode of `tokens`.
    The budget is the measured dense weights + KV + buffers + reserve + the same expert share that `budget_gib`
    gives the full model (so the 4-layer engine holds the same fraction of experts as the scaled runs)."""
    from ft.runtime.engine import Engine, SamplingParams, generate

    sc = scaled_slots(int(budget_gib * GIB), reader, full_layers=40, kv_tokens=8192, reserve=GIB // 2,
                      prefill_slots=32)
    nonlayer, per_layer = dense_gpu_bytes(reader)
    stride = reader.bank(f"layers.{reader.config.mlp_types.index('moe')}.mlp.experts").stride
    kv = 8192 * 2 * reader.config.num_kv_heads * reader.config.head_dim * 2 * 2  # generous: states are small here
    budget = nonlayer + sum(per_layer.values()) + kv + GIB // 2 + 64 * stride + sc["num_slots"] * stride + (64 << 20)
    t = time.perf_counter()
    eng = Engine(reader, device="cuda", vram_budget=budget, kv_reserve_tokens=8192)
    load_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, reader.config.vocab_size, (64,), generator=g).tolist()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    generate(eng, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    res = generate(eng, prompt, params)
    moe = eng.stats()["moe"]
    out = {"budget_gib": budget / GIB, "load_s": load_s, "scaled_slots": sc["num_slots"],
           "num_slots": moe.get("num_slots"), "mode": moe.get("mode"), "vram": moe.get("vram"),
           "decode_tok_s": res.timings.get("decode_tok_s"), "prefill_tok_s": res.timings.get("prefill_tok_s"),
           "tokens": len(res.token_ids), "moe": moe}
    log(f"engine @ {out['budget_gib']:.2f} GiB: {out['num_slots']} slots ({out['mode']}), decode "
        f"{out['decode_tok_s']:.1f} tok/s, hit {moe.get('hit_rate')}, pinned {moe.get('pinned_bytes')}")
    eng.close()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


_PIN_PROBE = """
import json, sys, time, torch
from ft.formats import FtwReader
from ft.runtime.gpu.pinning import bank_range
from ft.runtime.gpu.transfer import CudaUploader
r = FtwReader(sys.argv[1]); cfg = r.config
bank = r.bank(f"layers.{cfg.mlp_types.index('moe')}.mlp.experts")
pool = torch.empty(64, bank.stride, dtype=torch.uint8, device="cuda")
out = {}
for pin in (False, True):
    up = CudaUploader(pool)
    t = time.perf_counter(); ok = up.register(*bank_range(bank)) if pin else False
    out[f"register_s_{pin}"] = time.perf_counter() - t; out[f"registered_{pin}"] = ok
    for rep in range(3):
        torch.cuda.synchronize(); t = time.perf_counter()
        for i in range(64): up.upload(i, bank.record((i * 7 + rep) % bank.num_experts))
        up.fence().synchronize(); dt = time.perf_counter() - t
    out[f"gbs_pinned_{pin}"] = 64 * bank.stride / dt / 1e9; out[f"direct_{pin}"] = up.direct_copies
    assert all(torch.equal(pool[i].cpu(), bank.record((i * 7 + 2) % bank.num_experts)) for i in range(64))
    up.close()
out["ok"] = bool(out["registered_True"])
print(json.dumps(out))
"""


def pin_probe(work: Path, layers: int, routing: str, timeout: float = 25.0) -> dict:
    """Register one expert bank of the bench checkpoint and upload 64 records staged vs direct, in a child process
    with a timeout (page-locking file pages is VM-dependent); {"ok": bool, GB/s of each path, ...}."""
    import json
    import subprocess
    import sys

    ftw = work / f"q36-{layers}L-{routing}.ftw"
    try:
        res = subprocess.run([sys.executable, "-c", _PIN_PROBE, str(ftw)], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout} s"}
    if res.returncode != 0:
        return {"ok": False, "error": res.stderr[-1500:]}
    return json.loads(res.stdout.strip().splitlines()[-1])
