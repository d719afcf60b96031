"""The speed model of `ft plan`: decode and prefill tok/s of the default scheduler (mode mapped) at a placement.

Decode, batch 1, one step (specs/plan.md, "Speed model"):

    step = hbm + layers + misses + overhead
    hbm      = (dense bytes + MoE layers x k x expert payload) / HBM read rate: every weight on the GPU read once, the
               routed experts' bytes read wherever they sit (a slot, or a staging row after the miss is copied)
    layers   = layers x LAYER_S: the fixed GPU time per layer of a batch-1 step (small kernels run latency-bound)
    misses   = sum over offloaded MoE layers of E[ min over F of max(F x t_gpu, cpu(M - F)) ], M ~ Binomial(k, 1 - h)
               with h the layer's hit rate (the routing mass of its resident experts): the GPU copies F of the M
               misses from page-locked host memory (t_gpu = record bytes / the record copy rate) while the CPU lane
               computes the rest (cpu(c) = fixed + c x per expert, 0 for c = 0), both at once; a lane-only layer (its
               bank not page-locked) has F = 0, a machine without the lane M = F
    overhead = offloaded MoE layers x MAPPED_LAYER_S: the sync-free miss path's own work per layer call (staging
               gather, the lane's hand-off and wait, the routing read-back)

The two constants are fitted, each once, to measured runs (benchmarks/plan_model.md): LAYER_S to the resident step
of the 40-layer qwen3moe-35b-geom (33-34 us a layer on an H200 and on an H100), MAPPED_LAYER_S to its skewed 8 GiB
rows on an H100; the other measured rows (12 GiB, uniform routing, qwen3.6, hosts short of page-locked memory, the
H200's) check the model (tests/runtime/test_plan_speed.py).

Prefill at a budget is bounded by streaming every expert without a slot once per chunk over the pinned link:
chunk / ((slots missing) x record bytes / pinned H2D rate). That bound is what the plan states; with every expert
resident prefill is compute-bound, which this model does not predict (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from ft.formats.plan import PlanDecodeTerms, PlanRates

LAYER_S = 33e-6
MAPPED_LAYER_S = 10e-6


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    moe_layers: int
    top_k: int
    num_experts: int
    record_bytes: int  # what one miss moves over the link
    payload_bytes: int  # what a kernel reads of one record
    dense_bytes: int  # weights on the GPU outside the expert pool

    @property
    def max_slots(self) -> int:
        return self.moe_layers * self.num_experts


@dataclass(frozen=True)
class Decode:
    tok_s: float
    terms: PlanDecodeTerms
    gpu_misses: float  # per token: misses the GPU copies
    cpu_misses: float  # per token: misses the CPU lane computes
    lines: tuple[str, ...]  # the arithmetic, one line per term


def call_cost(misses: int, rates: PlanRates, t_gpu: float, *, gpu: bool, cpu: bool) -> tuple[float, int]:
    """(seconds, misses the GPU takes) of one layer call with `misses` misses: the F minimising
    max(F t_gpu, cpu(misses - F)) (ties to the GPU), over the paths available."""
    if misses == 0:
        return 0.0, 0
    options = range(misses + 1) if gpu and cpu else ([misses] if gpu else [0])
    best = None
    for f in options:
        c = misses - f
        t = max(f * t_gpu, rates.cpu_fixed_s + c * rates.cpu_per_expert_s if c else 0.0)
        if best is None or t < best[0] - 1e-15 or (abs(t - best[0]) <= 1e-15 and f > best[1]):
            best = (t, f)
    return best


def layer_cost(hit: float, k: int, rates: PlanRates, t_gpu: float, *, gpu: bool, cpu: bool
               ) -> tuple[float, float, float]:
    """Expected (seconds, GPU misses, CPU misses) of one layer call whose k experts each hit with probability `hit`."""
    p = min(1.0, max(0.0, 1.0 - hit))
    seconds = on_gpu = on_cpu = 0.0
    for m in range(1, k + 1):
        w = comb(k, m) * p ** m * (1 - p) ** (k - m)
        t, f = call_cost(m, rates, t_gpu, gpu=gpu, cpu=cpu)
        seconds, on_gpu, on_cpu = seconds + w * t, on_gpu + w * f, on_cpu + w * (m - f)
    return seconds, on_gpu, on_cpu


def decode(geom: Geometry, rates: PlanRates, hits: list[float], *, offloaded: bool, lane: bool,
           lane_only: frozenset[int] = frozenset()) -> Decode:
    """`hits`: the hit rate of each MoE layer (index 0..moe_layers-1); `lane_only`: indexes whose bank is not
    page-locked; `offloaded`: False when every expert has a slot (then no miss path runs at all)."""
    if len(hits) != geom.moe_layers:
        raise ValueError(f"{len(hits)} hit rates for {geom.moe_layers} MoE layers")
    k = geom.top_k
    read = geom.dense_bytes + geom.moe_layers * k * geom.payload_bytes
    hbm_s = read / rates.hbm_read
    layers_s = geom.num_layers * LAYER_S
    lines = [f"HBM reads: (dense {geom.dense_bytes / 1e9:.3f} GB + {geom.moe_layers} MoE layers x {k} experts x "
             f"{geom.payload_bytes / 1e6:.3f} MB) / {rates.hbm_read / 1e9:.0f} GB/s = {hbm_s * 1e3:.3f} ms",
             f"layers: {geom.num_layers} x {LAYER_S * 1e6:.0f} us = {layers_s * 1e3:.3f} ms"]
    misses_s = overhead_s = gpu_m = cpu_m = 0.0
    if offloaded:
        t_gpu = geom.record_bytes / rates.h2d_expert_pinned
        for i, h in enumerate(hits):
            s, g, c = layer_cost(h, k, rates, t_gpu, gpu=i not in lane_only, cpu=lane or i in lane_only)
            misses_s, gpu_m, cpu_m = misses_s + s, gpu_m + g, cpu_m + c
        overhead_s = geom.moe_layers * MAPPED_LAYER_S
        mean_hit = sum(hits) / len(hits)
        lines += [f"misses: {geom.moe_layers} MoE layers, mean hit rate {mean_hit:.3f}: {gpu_m:.1f} per token copied "
                  f"by the GPU ({t_gpu * 1e6:.1f} us per {geom.record_bytes / 1e6:.3f} MB record at "
                  f"{rates.h2d_expert_pinned / 1e9:.1f} GB/s), {cpu_m:.1f} computed by the CPU lane "
                  f"({rates.cpu_fixed_s * 1e6:.0f} us + {rates.cpu_per_expert_s * 1e6:.1f} us per expert) at the "
                  f"same time" + (f" ({len(lane_only)} lane-only layers)" if lane_only else "")
                  + f"; expected per token {misses_s * 1e3:.3f} ms",
                  f"miss path overhead: {geom.moe_layers} x {MAPPED_LAYER_S * 1e6:.0f} us = {overhead_s * 1e3:.3f} ms"]
    step = hbm_s + layers_s + misses_s + overhead_s
    lines.append(f"decode step {step * 1e3:.3f} ms -> {1 / step:.1f} tok/s at batch 1, short context")
    terms = PlanDecodeTerms(hbm_s, layers_s, misses_s, overhead_s, step)
    return Decode(1 / step, terms, gpu_m, cpu_m, tuple(lines))


def prefill(geom: Geometry, rates: PlanRates, slots: int, chunk: int, *, lane_only: int = 0
            ) -> tuple[float | None, str]:
    """(tok/s bound or None, the arithmetic) of prefill chunks of `chunk` tokens with `slots` expert slots."""
    missing = geom.max_slots - slots
    if missing <= 0:
        return None, "prefill: every expert resident, compute-bound (not predicted)"
    if lane_only:
        return None, (f"prefill: {lane_only} MoE layers without page-locked banks take the host-planned path "
                      "(not predicted)")
    stream = missing * geom.record_bytes / rates.h2d_pinned
    return chunk / stream, (f"prefill bound: {missing} experts without a slot x {geom.record_bytes / 1e6:.3f} MB / "
                            f"{rates.h2d_pinned / 1e9:.1f} GB/s = {stream * 1e3:.1f} ms per {chunk}-token chunk -> "
                            f"{chunk / stream:.0f} tok/s at most")
