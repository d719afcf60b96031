"""Calibration: N tokens of built-in text run through the model by the engine on this machine's device, counting the
experts each MoE layer routes to.

The engine is the one `ft serve` would start with these settings (on the GPU at the plan's budget; on the CPU with
its CPU experts), eager (no CUDA graphs), with no placement plan and no prefix cache. Every MoE layer's experts call
is wrapped (`BoundExperts.fn`) to add its top-k ids to a device-side count table [layers, E] (no host sync), then
the passages of `calibration_text` are prefilled, each as its own sequence, cycling until N tokens were run.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ft.formats import FtwReader
from ft.runtime.settings import EngineSettings

from .calibration_text import PASSAGES
from .routing import RoutingProfile

MAX_SEQUENCE = 1024  # tokens of one calibration sequence (a longer passage is cut)


class RoutingCounter:
    """The experts interface, counting the routed ids per layer before handing the call on."""

    def __init__(self, inner, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.inner, self.E = inner, num_experts
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        self.counts[layer] += torch.bincount(topk_ids.reshape(-1), minlength=self.E).to(self.counts.device)
        return self.inner(layer, x, topk_ids, topk_weights)


def sequences(encode: Callable[[str], list[int]], tokens: int) -> list[list[int]]:
    """Token ids of the passages, cycled and cut so that they add up to exactly `tokens`."""
    if tokens < 1:
        raise ValueError(f"calibration needs at least one token, got {tokens}")
    whole = [encode(p) for p in PASSAGES]
    encoded = [ids[i:i + MAX_SEQUENCE] for ids in whole for i in range(0, len(ids), MAX_SEQUENCE)]
    if not encoded:
        raise ValueError("the tokenizer turned the calibration text into no tokens")
    out, n = [], 0
    while n < tokens:
        ids = encoded[len(out) % len(encoded)][:tokens - n]
        out.append(ids)
        n += len(ids)
    return out


def calibrate(reader: FtwReader, tokens: int, settings: EngineSettings,
              progress: Callable[[int], None] | None = None) -> tuple[RoutingProfile, object]:
    """-> (the routing counted over `tokens` tokens, the calibration engine's VRAM plan or None)."""
    from ft.runtime.engine import Engine
    from ft.runtime.layers.moe import BoundExperts
    from ft.runtime.model import Segment

    s = dataclasses.replace(settings, cuda_graphs=False, plan="none", prefix_cache_entries=0, prefix_cache_dir=None,
                            save_routing=None, max_running_requests=1)
    engine = Engine(reader, s)
    try:
        cfg, model = engine.config, engine.model
        bound = [op.experts for _, op in model.named_ops() if isinstance(getattr(op, "experts", None), BoundExperts)]
        counter = RoutingCounter(bound[0].fn, cfg.num_layers, cfg.num_experts, model.device)
        for b in bound:
            b.fn = counter
        chunk = engine.max_prefill_length
        for ids in sequences(lambda text: engine.tokenizer.encode(text, add_special_tokens=False), tokens):
            state = model.new_state(len(ids) + 1)
            for i in range(0, len(ids), chunk):
                part = ids[i:i + chunk]
                model.forward(torch.tensor(part), [Segment(state, len(part))])
                if progress is not None:
                    progress(len(part))
            state.free()
        moe = [i for i, t in enumerate(cfg.mlp_types) if t == "moe"]
        counts = counter.counts[moe].cpu().numpy()
        where = f"{tokens} tokens of built-in text on {model.device}"
        plan = getattr(engine._experts, "vram_plan", None)
    finally:
        engine.close()
    return RoutingProfile("calibration", where, tokens, counts), plan
