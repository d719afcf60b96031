"""What an engine loads at start: on CUDA first the FTW's prebuilt kernels (`ft.runtime.gpu.prebuilt`, before any kernel
compiles), then the model with its routed experts where the settings put them: the GPU expert scheduler sized from
the VRAM budget (`ft.runtime.gpu.engine_setup`), given `experts`, or the CPU experts."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ft.formats import FtwReader
from ft.runtime.model import load_model
from ft.runtime.settings import EngineSettings

log = logging.getLogger("ft.engine")


def load_for_engine(reader: FtwReader, s: EngineSettings, *, experts: Any = None, offload: Any = None):
    """-> (model, experts (None: the model's CPU experts), prebuilt-kernels status or None)."""
    kernels = None  # on CUDA: what start-up did with the FTW's prebuilt kernels (before any kernel compiles)
    if s.cuda:
        from ft.runtime.gpu.prebuilt import use_prebuilt

        dev = torch.device(s.device)
        major, minor = torch.cuda.get_device_capability(dev.index if dev.index is not None else None)
        kernels = use_prebuilt(reader, 10 * major + minor)
    model = None
    if experts is None and (s.cuda or offload is not None):
        from ft.runtime.gpu.engine_setup import load_offloaded, unsupported_reason

        why = unsupported_reason(reader)
        if why is not None and offload is not None:
            raise ValueError(f"{reader.path}: the GPU expert scheduler cannot serve this model: {why}")
        if why is None:
            model, experts = load_offloaded(
                reader, device=s.device, vram_budget=s.vram_budget, memory_ratio=s.memory_ratio, offload=offload,
                kv_reserve_tokens=s.kv_reserve_tokens, max_running_requests=s.max_running_requests,
                dense_weights=s.dense_weights,
                cuda_graphs=s.cuda_graphs, pin_host_bytes=s.pinned_memory, cpu_lane=s.cpu_lane, plan_name=s.plan,
                max_prefill_length=s.max_prefill_length)
        else:
            log.warning("%s; routed experts run on the CPU", why)
    if model is None:
        model = load_model(reader, device=s.device, experts=experts)
    return model, experts, kernels
