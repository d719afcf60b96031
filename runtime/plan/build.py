"""`ft plan`: a placement plan for this machine (formats/plan.py), made without loading the weights, and written into
the FTW (`ft.formats.slots`: data files untouched, the index replaced atomically).

The VRAM split is the engine's (`sizing.split_budget`) on the dense bytes computed from the FTW's records (or measured,
when calibration loaded the model: `measured`), what the device holds now and the default scheduler's buffers. The
resident set is the top of the routing profile's order (`routing.preload_order`) cut at the slots; the page-locked
banks are those the pinner would register in layer order within the allowance (`--pinned-memory`, else half of
MemAvailable now); the others are lane-only. The prediction is `speed.py`'s, at this budget and along a curve of
budgets from the fixed parts alone to every expert resident (KV held at the plan's).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ft.formats import FtwReader
from ft.formats.plan import (PLAN_FORMAT, PLAN_VERSION, SUFFIX, Plan, PlanMachine, PlanModel, PlanPrediction,
                             PlanRouting, PlanVram, model_key, parse_plan)
from ft.formats.slots import put_entry
from ft.runtime.settings import EngineSettings

from . import speed
from .machine import lane_available, rates, this_machine
from .routing import RoutingProfile, held_out, hit_rates, preload_order, shares

CURVE_POINTS = 24


def default_name(gpu: str, budget: int) -> str:
    """e.g. nvidia-h200-8gib, cpu-0.5gib."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return f"{slug}-{round(budget / 2**30, 2):g}gib"


def make_plan(reader: FtwReader, settings: EngineSettings, routing: RoutingProfile, *, name: str | None = None,
              measured=None) -> Plan:
    """The plan for this machine at `settings`' VRAM budget (ValueError when the GPU scheduler cannot serve the
    model or the budget cannot hold the fixed parts). `measured`: a VramPlan of an engine that loaded the model
    here (its budget, what the device held outside it and the dense bytes it measured replace the estimates)."""
    from ft.runtime.gpu.benchbw import load_profile
    from ft.runtime.gpu.engine_setup import unsupported_reason
    from ft.runtime.gpu.offload_config import OffloadConfig
    from ft.runtime.gpu.pinning import mem_available
    from ft.runtime.gpu.record_layout import RecordLayout
    from ft.runtime.gpu.sizing import (LATE_OUTSIDE, OFFLOADED_PREFILL_CHUNK, PREFILL_CHUNK, dense_weight_bytes,
                                       device_in_use, resolve_budget, resolve_dense, resolve_reserve, split_budget,
                                       state_bytes)

    why = unsupported_reason(reader)
    if why is not None:
        raise ValueError(f"{reader.path}: the GPU expert scheduler cannot serve this model: {why}")
    cfg = reader.config
    moe = [i for i, t in enumerate(cfg.mlp_types) if t == "moe"]
    bank = reader.bank(f"layers.{moe[0]}.mlp.experts")
    layout = RecordLayout.for_model(bank, cfg)
    E, stride = cfg.num_experts, bank.stride
    dev = torch.device(settings.device)
    cuda = dev.type == "cuda"
    machine = this_machine(dev)
    opts = OffloadConfig()  # the default scheduler's buffers and reserve
    if measured is not None:
        budget, outside, dense = measured.budget, measured.outside, measured.dense
        keep = measured.dense_quantized
    else:
        if not cuda and settings.vram_budget is None:
            raise ValueError("--vram-budget is needed: torch sees no GPU here to size a budget from")
        budget = resolve_budget(dev, settings.vram_budget, settings.memory_ratio)
        keep = resolve_dense(reader, settings.dense_weights, budget, settings.max_running_requests) == "quantized"
        outside = 0
        if cuda:  # as the engine measures it at start (sizing.py)
            held = device_in_use(dev) if settings.vram_budget is not None else torch.cuda.memory_reserved(dev)
            outside = held + LATE_OUTSIDE
        nonlayer, per_layer = dense_weight_bytes(reader, keep_quantized=keep)
        dense = nonlayer + sum(per_layer.values())
    per_token, per_seq = state_bytes(cfg, reader.tensor("embed_tokens.weight").dtype)

    vram = split_budget(budget, dense=dense, per_token=per_token, per_seq=per_seq,
                        max_running_requests=settings.max_running_requests, kv_tokens=settings.kv_reserve_tokens,
                        max_context=cfg.max_position_embeddings, stride=stride, prefill_slots=opts.prefill_slots,
                        reserve=resolve_reserve(opts.reserve_bytes, reader, settings.max_prefill_length,
                                                dense_quantized=keep),
                        max_slots=len(moe) * E, dense_quantized=keep, outside=outside)
    geom = speed.Geometry(cfg.num_layers, len(moe), cfg.num_experts_per_tok, E, stride, layout.payload_bytes, dense)
    r = rates(dev, layout.payload_bytes, load_profile(dev.index or 0) if cuda else None)
    lane = settings.cpu_lane and lane_available()
    allowance = settings.pinned_memory if settings.pinned_memory is not None else mem_available() // 2
    pinned = []
    for i in range(len(moe)):  # in layer order while the allowance lasts, as the pinner registers them
        if (len(pinned) + 1) * E * stride <= allowance:
            pinned.append(i)
    share = shares(routing.counts, len(moe), E)
    order = preload_order(share)
    expected = held_out(routing.counts, E, len(moe))  # the hit-rate estimate's (share, order), once

    def predict(slots: int):
        offloaded = slots < geom.max_slots
        hits = hit_rates(*expected, slots) if offloaded else [1.0] * len(moe)
        lane_only = frozenset(range(len(moe))) - frozenset(pinned) if offloaded else frozenset()
        chunk = settings.max_prefill_length or (OFFLOADED_PREFILL_CHUNK if offloaded else PREFILL_CHUNK)
        d = speed.decode(geom, r, hits, offloaded=offloaded, lane=lane, lane_only=lane_only)
        pf, pf_line = speed.prefill(geom, r, slots, chunk, lane_only=len(lane_only))
        return d, pf, pf_line, hits, lane_only, chunk

    d, pf, pf_line, hits, lane_only, chunk = predict(vram.num_slots)
    fixed = vram.outside + vram.dense + vram.kv + vram.prefill_buffers + vram.reserve  # the parts before any slot
    top = fixed + geom.max_slots * stride
    budgets = sorted({fixed + (top - fixed) * i // (CURVE_POINTS - 1) for i in range(CURVE_POINTS)} | {budget})
    curve = []
    for b in budgets:
        cd, cpf, *_ = predict(min(geom.max_slots, (b - fixed) // stride))
        curve.append((b, cd.tok_s, cpf))
    offloaded = vram.num_slots < geom.max_slots
    mean_hit = sum(hits) / len(hits)
    lines = (f"hit rate {mean_hit:.3f}: the routing mass of {vram.num_slots} resident experts "
             f"({routing.source} routing, held-out estimate)", *d.lines, pf_line)
    plan = Plan(
        format=PLAN_FORMAT, version=PLAN_VERSION, name=name or default_name(machine.gpu, budget),
        model=PlanModel(model_key(reader.records), cfg.family, tuple(moe), E, cfg.num_experts_per_tok, stride),
        machine=PlanMachine(machine.gpu, machine.gpu_memory, machine.host_memory, allowance, lane, r),
        vram=PlanVram(vram.budget, vram.outside, vram.dense, vram.kv_tokens, vram.kv, vram.prefill_buffers,
                      vram.reserve, vram.num_slots, vram.max_slots, settings.max_running_requests, keep),
        routing=PlanRouting(routing.source, routing.detail, routing.tokens,
                            None if routing.counts is None else tuple(tuple(int(v) for v in row)
                                                                      for row in routing.counts)),
        resident=tuple((moe[int(i)], int(e)) for i, e in order[:vram.num_slots]),
        pinned_banks=tuple(moe[i] for i in pinned) if offloaded else (),
        lane_only=tuple(moe[i] for i in sorted(lane_only)),
        prefill_chunk=chunk,
        prediction=PlanPrediction(d.tok_s, pf, mean_hit, tuple(hits), d.gpu_misses, d.cpu_misses, d.terms,
                                  lines, tuple(curve)))
    return parse_plan(plan.to_json(), f"plan {plan.name}", key=plan.model.key)  # never write what a reader refuses


def write_plan(ftw: str | Path, plan: Plan) -> Path:
    """Add (or replace) plans/<name>.json in the FTW; returns its path."""
    return put_entry(ftw, "plans", plan.name + SUFFIX, plan.to_json())
