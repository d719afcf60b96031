"""Pieces of tools/gpu_bench.py: checkpoint, budget scaling, the bench's own decode/prefill loops, checks, probes.

Budget scaling (a checkpoint with fewer layers than the real model): the full model's dense weights (lm_head,
attention / DeltaNet, shared experts, routers, and the embedding table only where it is tied to the LM head; as the
runtime holds them on the GPU: `--dense quantized` as stored, `dequantized` in bf16; `sizing.dense_weight_bytes`),
its KV reserve, the activation reserve and the two prefill buffers come off the budget first; what is left is
divided evenly over the full model's MoE layers, and the benchmark model gets that share for each of its layers.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ft.formats import FtwReader
from ft.runtime.gpu.sizing import dense_weight_bytes
from ft.runtime.layers.moe import BoundExperts
from ft.runtime.model import Segment, load_model

GIB = 1 << 30


def ftw_path(work: Path, layers: int, routing: str, preset: str = "qwen3.6-35b-a3b") -> Path:
    tag = "q36" if preset == "qwen3.6-35b-a3b" else preset
    return work / f"{tag}-{layers}L-{routing}.ftw"


def build_checkpoint(work: Path, layers: int, routing: str, log, preset: str = "qwen3.6-35b-a3b") -> Path:
    """synth (qwen3_5_moe `preset`, by default the Qwen3.6-35B-A3B geometry; NVFP4) -> compile -> drop the HF dirs;
    returns the FTW path. A small preset (demo) makes a CPU dry run of the whole bench possible."""
    from ft.compiler import compile_checkpoint
    from ft.compiler.synth import synth

    ftw = ftw_path(work, layers, routing, preset)
    if ftw.is_dir() and any(ftw.iterdir()):
        log(f"reusing {ftw}")
        return ftw
    hf = ftw.with_name(ftw.name.removesuffix(".ftw") + "-hf")
    t = time.perf_counter()
    # The vision tower is irrelevant to MoE serving and is cut to one tiny block to save disk and build time.
    tiny_vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, num_position_embeddings=16,
                       patch_size=16)
    synth("qwen3_5_moe", preset, hf, quant="nvfp4", routing=routing, num_layers=layers, force=True,
          overrides={"vision": tiny_vision}, twin=False)
    t_synth = time.perf_counter() - t
    t = time.perf_counter()
    compile_checkpoint(hf, ftw)
    log(f"checkpoint {routing}: synth {t_synth:.0f} s, compile {time.perf_counter() - t:.0f} s")
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(hf.with_name(hf.name + "-twin"), ignore_errors=True)
    return ftw


def scaled_slots(budget: int, reader: FtwReader, *, full_layers: int, kv_tokens: int, reserve: int,
                 prefill_slots: int, keep_quantized: bool) -> dict:
    cfg = reader.config
    stride = reader.bank(f"layers.{[i for i, t in enumerate(cfg.mlp_types) if t == 'moe'][0]}.mlp.experts").stride
    nonlayer, per_layer = dense_weight_bytes(reader, keep_quantized=keep_quantized)
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


def engine_budget(reader: FtwReader, budget_gib: float, *, kv_tokens: int = 8192) -> tuple[int, dict]:
    """(bytes, scaled slots) for Engine(vram_budget=...): the dense weights + KV + buffers + reserve + the expert
    share that `budget_gib` gives the full 40-layer model (so the engine holds the same fraction of experts as the
    scaled direct runs). Dense weights count dequantized, as the engine (`ft serve`) places them by default."""
    sc = scaled_slots(int(budget_gib * GIB), reader, full_layers=40, kv_tokens=kv_tokens, reserve=GIB // 2,
                      prefill_slots=32, keep_quantized=False)
    nonlayer, per_layer = dense_weight_bytes(reader, keep_quantized=False)
    stride = reader.bank(f"layers.{reader.config.mlp_types.index('moe')}.mlp.experts").stride
    kv = kv_tokens * 2 * reader.config.num_kv_heads * reader.config.head_dim * 2 * 2  # generous: states are small
    budget = nonlayer + sum(per_layer.values()) + kv + GIB // 2 + 64 * stride + sc["num_slots"] * stride + (64 << 20)
    return budget, sc


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


def chunked_prefill(model, prompt: list[int], chunk: int) -> float:
    """Seconds to prefill `prompt` in chunks of `chunk` tokens (as the engine's max_prefill_length does)."""
    state = model.new_state(len(prompt) + 1)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        model.forward(torch.tensor(part), [Segment(state, len(part))])
    sync()
    t = time.perf_counter() - t
    state.free()
    return t


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


_PIN_PROBE = """
import faulthandler, json, sys, time, torch
faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)  # a hang reports every thread's stack on stderr
from ft.formats import FtwReader
from ft.runtime.gpu.sizing import dense_weight_bytes
from ft.runtime.gpu.pinning import bank_range, prefault, shared_view
from ft.runtime.gpu.transfer import CudaUploader
r = FtwReader(sys.argv[1]); cfg = r.config
bank = r.bank(f"layers.{cfg.mlp_types.index('moe')}.mlp.experts")
pool = torch.empty(64, bank.stride, dtype=torch.uint8, device="cuda")
out = {}
for pin in (True, False):  # direct first: the engine's path; the staged one is the fallback
    up = CudaUploader(pool)
    view = shared_view(bank) if pin else None; t = time.perf_counter()
    out[f"prefault_{pin}"] = prefault(view.data_ptr(), view.numel()) if pin else None
    out[f"prefault_s_{pin}"] = time.perf_counter() - t
    t = time.perf_counter(); ok = up.register(*bank_range(bank), view) if pin else False
    out[f"register_s_{pin}"] = time.perf_counter() - t; out[f"registered_{pin}"] = ok
    for rep in range(3):
        torch.cuda.synchronize(); t = time.perf_counter()
        for i in range(64): up.upload(i, bank.record((i * 7 + rep) % bank.num_experts))
        up.fence().synchronize(); dt = time.perf_counter() - t
    out[f"gbs_pinned_{pin}"] = 64 * bank.stride / dt / 1e9; out[f"direct_{pin}"] = up.direct_copies
    assert all(torch.equal(pool[i].cpu(), bank.record((i * 7 + 2) % bank.num_experts)) for i in range(64))
    up.close()
    print(json.dumps(out), flush=True)  # partial result: which path finished before a hang
out["ok"] = bool(out["registered_True"])
print(json.dumps(out))
"""


def text_of(x) -> str:
    """A subprocess's captured output as text (bytes, str or None)."""
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def pin_probe(ftw: Path, timeout: float = 25.0) -> dict:
    """Register one expert bank of the FTW and upload 64 records staged vs direct, in a child process with a
    timeout (page-locking file pages is VM-dependent); {"ok": bool, GB/s of each path, ...}."""
    try:
        res = subprocess.run([sys.executable, "-c", _PIN_PROBE, str(ftw), str(timeout - 3)], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "error": f"timed out after {timeout} s", "stderr": text_of(e.stderr)[-6000:],
                "partial": _last_json(text_of(e.stdout))}
    if res.returncode != 0:  # faulthandler's exit: the stacks of the hang; partial: the paths that finished
        return {"ok": False, "error": res.stderr[-6000:], "partial": _last_json(res.stdout)}
    return _last_json(res.stdout)


def _last_json(stdout: str) -> dict:
    """The probe's last JSON line (it prints one after each path), {} if none."""
    lines = stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}
