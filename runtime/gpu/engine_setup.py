"""Build the model with the GPU expert scheduler for the engine, sized from one VRAM budget (see `sizing`).

    model, experts = load_offloaded(reader, device="cuda", vram_budget=None, memory_ratio=0.9, offload=None,
                                    kv_reserve_tokens=None, max_running_requests=4)

Order: resolve the budget and measure what the device holds outside the caching allocator (before anything is
loaded), pick the placement plan (the FTW's for this machine, `ft plan`; else one made now, not written), load the
dense weights onto the device (quantized linears dequantized, or as stored with `OffloadConfig(dense="quantized")`),
measure what they took, then give the expert slots what the KV reserve, prefill buffers and activation reserve leave
(the KV budget itself, unless given, the placement plan's or from the budget: `default_kv_tokens`;
`experts.vram_plan.kv_tokens` says what it is), preload the plan's experts into the slots, and cap the allocator so
that the device's use stays within the budget (`sizing`); CUDA graphs are captured after that. When every expert
fits, the scheduler runs fully resident. `device="cpu"` with an explicit `offload` runs the same scheduler on the CPU
emulation path (the "VRAM" is then host memory; used by tests).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ft.formats import FtwReader

from .offload_config import OffloadConfig
from .record_layout import SCHEMES
from .sizing import (LATE_OUTSIDE, cap_allocator, device_in_use, expandable_segments, resolve_budget, resolve_dense,
                     resolve_reserve, split_budget, state_bytes)
from .store import GpuExperts

log = logging.getLogger("ft.gpu")


def unsupported_reason(reader: FtwReader) -> str | None:
    """None if the GPU expert store can serve this FTW, else why not (its kernels read NVFP4 and MXFP4 banks)."""
    scheme = (reader.quant or {}).get("experts")
    if scheme not in SCHEMES:
        return f"expert scheme {scheme!r} has no GPU kernel (supported: {', '.join(SCHEMES)})"
    return None


# layer types whose decode step is graph-safe (device kernels reading positions and KV / state tables from the
# graph's inputs); the others' PyTorch ops take lengths on the host, which a captured graph would freeze
GRAPHED_LAYERS = frozenset({"full_attention", "sliding_attention", "linear_attention"})


def eager_reason(config) -> str | None:
    """None if decode steps of this model can be CUDA graphs, else why not."""
    other = sorted(set(config.layer_types) - GRAPHED_LAYERS)
    if other:
        return (f"family {config.family}: its {', '.join(other)} layers run as PyTorch ops, which take sequence "
                "lengths on the host")
    return None


def _weight_bytes(model) -> int:
    """The dense weights' bytes as a GPU would hold them (CPU emulation of a budget): an untied embedding table stays
    in host memory there (`sizing.dense_weight_bytes`)."""
    total = [0]
    host = "" if model.config.tie_word_embeddings else "embed_tokens.weight"

    def count(name: str, t: torch.Tensor) -> torch.Tensor:
        total[0] += 0 if name == host else t.numel() * t.element_size()
        return t

    model.map_weights(count)
    return total[0]


def load_offloaded(reader: FtwReader, *, device: str, vram_budget: int | None, memory_ratio: float,
                   offload: OffloadConfig | None, kv_reserve_tokens: int | None, max_running_requests: int,
                   dense_weights: str | None = None, cuda_graphs: bool = True,
                   pin_host_bytes: int | None = None, cpu_lane: bool = True, plan_name: str | None = None,
                   max_prefill_length: int | None = None):
    """-> (model, GpuExperts with its slot pool allocated; `experts.vram_plan` says how the budget was spent). On
    CUDA with `cuda_graphs`, the model replays sync-free decode steps of up to `max_running_requests` sequences from
    CUDA graphs (`graphs.py`), captured here. `pin_host_bytes`: the host memory the default scheduler's banks may
    page-lock (None: half of MemAvailable) and `cpu_lane` whether the CPU computes a share of the misses (both
    ignored when `offload` is given, which says them itself). `plan_name`: the
    FTW's placement plan to use (`ft plan`), None to pick the one made for this machine (or plan at start, not
    written), "none" for neither; it sizes KV (unless `kv_reserve_tokens` is given) and preloads its experts.
    `experts.placement` says what was used. `max_prefill_length`: the engine's prefill chunk if given (it sizes the
    activation reserve; else the plan's chunk or the default at a budget)."""
    from ft.runtime.gpu.benchbw import load_profile
    from ft.runtime.model import load_model

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    explicit = vram_budget if vram_budget is not None else (offload.vram_budget if offload else None)
    budget = None
    if cuda or explicit is not None:
        budget = resolve_budget(dev, explicit, memory_ratio)
    opts = offload or OffloadConfig(vram_budget=budget, pin_host_bytes=pin_host_bytes, cpu_lane=cpu_lane)
    if opts.vram_budget is None and budget is not None:
        opts = dataclasses.replace(opts, vram_budget=budget)
    if dense_weights is not None:
        opts = dataclasses.replace(opts, dense=resolve_dense(reader, dense_weights, budget, max_running_requests))
        if dense_weights == "auto" and opts.dense == "quantized":  # why: `resolve_dense`
            log.info("dense weights kept quantized (--dense-weights auto, decode batches of up to %d sequences, "
                     "budget %s)", max_running_requests, budget)
    placement = None  # the FTW's plan for this machine, or one made now (`ft.runtime.plan.select`); before loading
    if budget is not None and plan_name != "none":
        from ft.runtime.plan.select import choose_placement

        placement = choose_placement(reader, plan_name, dev, budget)
    outside = held = 0
    if cuda:  # an explicit budget covers the context (and, on a shared GPU, other processes); a ratio of free does not
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(dev)
        outside = (device_in_use(dev) if explicit is not None else held) + LATE_OUTSIDE
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    experts = GpuExperts(reader, opts, device=str(dev), profile=load_profile(dev.index or 0) if cuda else None)
    keep = opts.dense == "quantized"
    model = load_model(reader, device=str(dev), experts=experts, keep_quantized=keep)
    dense = torch.cuda.memory_allocated(dev) - before if cuda else _weight_bytes(model)
    per_token, per_seq = state_bytes(model.config, model.dtype)
    max_slots = len(experts.moe_layers) * experts.E
    kv_tokens = kv_reserve_tokens if kv_reserve_tokens is not None else getattr(placement, "kv_tokens", None)
    plan = None
    if budget is not None:  # what the fixed parts leave is shared between KV (unless given) and expert slots
        plan = split_budget(budget, dense=dense, per_token=per_token, per_seq=per_seq,
                            max_running_requests=max_running_requests, kv_tokens=kv_tokens,
                            max_context=model.config.max_position_embeddings, stride=experts.layout.stride,
                            prefill_slots=opts.prefill_slots, max_slots=max_slots,
                            reserve=resolve_reserve(opts.reserve_bytes, reader, max_prefill_length or getattr(
                                placement, "prefill_chunk", None), dense_quantized=keep),
                            dense_quantized=keep, outside=outside)
    num_slots = opts.num_slots if opts.num_slots is not None else (plan.num_slots if plan else None)
    if opts.mode == "resident":
        if plan is not None and plan.num_slots < max_slots:
            raise ValueError(f"resident placement needs {max_slots} expert slots but the VRAM budget leaves room for "
                             f"{plan.num_slots}; raise the budget or use mode mapped")
    elif offload is None and num_slots is not None and num_slots >= max_slots:
        experts.opts = dataclasses.replace(opts, mode="resident")  # everything fits: no miss handling at all
    if cuda and plan is not None:
        expandable_segments()  # before the pool and every transient: see there
        cap_allocator(dev, held + budget - outside)  # lifted again by experts.close()
        experts.capped = dev
    preload = priors = None
    if placement is not None and experts.opts.mode != "resident" and num_slots:
        preload, priors = placement.preload(experts.moe_layers, experts.E, num_slots, num_layers=experts.L)
    experts.allocate(num_slots=num_slots, priors=priors, preload=preload)  # the plan's experts resident before capture
    experts.vram_plan, experts.placement = plan, placement
    eager = eager_reason(model.config) if cuda and cuda_graphs else None
    if eager is not None:
        log.info("decode runs eagerly, without CUDA graphs: %s", eager)
    elif cuda and cuda_graphs:
        from .graphs import DecodeGraphs, bucket_sizes

        model.graphs = DecodeGraphs(model, experts, batch_sizes=bucket_sizes(max_running_requests))
        model.graphs.warm()  # every batch size captured now, where the experts allow replays already
    if placement is not None:
        log.info("%s", placement.note)
    if plan is not None:
        gib = 1 << 30
        log.info("VRAM budget %.2f GiB: in use at start + kernel modules %.2f, dense %.2f (%s), KV %.2f (%d tokens%s), "
                 "prefill buffers %.2f, reserve %.2f, expert slots %d of %d (%.0f %%, %.2f GiB), mode %s", budget / gib,
                 outside / gib, dense / gib, "quantized" if keep else "dequantized", plan.kv / gib, plan.kv_tokens,
                 "; --kv-reserve-tokens trades context for expert slots" if kv_tokens is None else "",
                 plan.prefill_buffers / gib, plan.reserve / gib, plan.num_slots, max_slots,
                 100 * plan.cached_fraction, plan.slot_bytes / gib, experts.opts.mode)
    return model, experts
