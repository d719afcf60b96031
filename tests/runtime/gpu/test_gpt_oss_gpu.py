"""gpt_oss on the GPU expert scheduler: MXFP4 experts (biases, clamped SwiGLU) in the slot cache, resident or at a
budget of a few slots (misses fetched, or computed by the native CPU kernel, MXFP4 as for NVFP4: host-planned, or by
the CPU lane inside mode mapped's calls), through the scheduler's paths on the CPU emulation: the PyTorch reference,
or the Triton kernels under the interpreter (device-planned decode, tensor-core decode, device-planned prefill, mode
mapped's gather). On CUDA, the engine against the CPU engine with CUDA graphs (fused sink / sliding-window decode
attention)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import Engine, EngineSettings, generate
from ft.runtime.experts import CpuExperts
from ft.runtime.gpu import engine_setup
from ft.runtime.gpu.cpu.kernel import load_library
from ft.runtime.gpu.device_path import uses_device_plan, uses_device_prefill
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.sizing import LATE_OUTSIDE
from ft.runtime.gpu.store import GpuExperts
from ft.runtime.model import load_model

from .engine_checks import PARAMS, PROMPT, prompt_logits, resident_then_budget
from .gpu_fixtures import rel_err

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA


def _calls(reader, tokens, seed):
    """(layer, x bf16 [T, H], distinct top-k ids, weights) per entry of `tokens`, layers cycling."""
    cfg = reader.config
    g = torch.Generator().manual_seed(seed)
    for i, T in enumerate(tokens):
        x = (torch.randn(T, cfg.hidden_size, generator=g) * 2).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(T)])
        yield i % cfg.num_layers, x, ids, torch.rand(T, cfg.num_experts_per_tok, generator=g)


def test_layout_carries_the_models_format_and_activation(ftw_for):
    reader = FtwReader(ftw_for("gpt_oss", "mxfp4"))
    ex = GpuExperts(reader, OffloadConfig(num_slots=2), device="cpu")
    cfg = reader.config
    assert (ex.layout.scheme, ex.layout.act) == ("mxfp4", "clamped_swiglu")
    assert (ex.layout.alpha, ex.layout.limit) == (cfg.swiglu_alpha, cfg.swiglu_limit)
    # the native C kernel reads MXFP4 records (the PyTorch reference only where no C compiler is found)
    assert (ex.cpu.backend in ("c", "c-avx512")) == (load_library() is not None)
    ex.close()


def test_scheduler_with_few_slots_matches_cpu_experts(ftw_for):
    reader = FtwReader(ftw_for("gpt_oss", "mxfp4"))
    ex = GpuExperts(reader, OffloadConfig(num_slots=3, b_pcie=1e9, b_cpu=1e9, prefill_tokens=4),
                    device="cpu")
    got = prompt_logits(load_model(reader, device="cpu", experts=ex), PROMPT)
    want = prompt_logits(load_model(ftw_for("gpt_oss", "mxfp4")), PROMPT)
    assert rel_err(got, want) < 1e-2 and torch.equal(got.argmax(-1), want.argmax(-1))
    c = ex.counters
    assert c["misses"] > 0 and c["cpu_experts"] == 0 and c["fetched"] + c["prefill_streamed"] > 0  # all fetched
    ex.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_resident_kernels_through_the_scheduler(ftw_for):
    """Resident, device-planned: 1-2 tokens take the per-pair GEMV kernels, 3 the tensor-core ones, 40 the device-
    planned prefill tiles; each call against the CPU experts."""
    reader = FtwReader(ftw_for("gpt_oss", "mxfp4"))
    cfg = reader.config
    ex = GpuExperts(reader, OffloadConfig(mode="resident", prefill_tokens=16), device="cpu",
                    device_plan=True, interpret=True)
    ex.allocate()
    cpu = CpuExperts(reader, cfg, dtype=torch.float32)
    for layer, x, ids, w in _calls(reader, (1, 2, 3, 40), seed=3):
        T = x.shape[0]
        assert uses_device_plan(ex, layer, T) == (T * cfg.num_experts_per_tok <= 64)
        assert uses_device_prefill(ex, layer, T) == (T == 40)
        assert rel_err(ex(layer, x, ids, w).float(), cpu(layer, x.float(), ids, w)) < 1e-2
    assert ex.device_plan and ex.counters["prefill_calls"] == 1 and ex._device_prefill_ok
    ex.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
@pytest.mark.skipif(load_library() is None, reason="the CPU lane needs the C expert kernel")
@pytest.mark.parametrize("b_pcie", [None, 1e6])
def test_mapped_mode_splits_misses_between_the_bank_and_the_cpu_lane(ftw_for, b_pcie):
    """Mode mapped reads misses from the bank in place and hands the CPU lane its share of them, MXFP4 as NVFP4; a
    link costed at 1 MB/s sends every staged miss to the lane. Either way every pair is covered."""
    reader = FtwReader(ftw_for("gpt_oss", "mxfp4"))
    opts = OffloadConfig(num_slots=3, admit_max=1, cpu_threads=2, b_pcie=b_pcie, trace_limit=100)
    ex = GpuExperts(reader, opts, device="cpu", device_plan=True, interpret=True)
    cpu = CpuExperts(reader, reader.config, dtype=torch.float32)
    try:
        for layer, x, ids, w in _calls(reader, (1, 2, 1, 3, 1, 1), seed=5):
            assert rel_err(ex(layer, x, ids, w).float(), cpu(layer, x.float(), ids, w)) < 1e-2
        ex.settle()
        s = ex.stats()
        assert ex.mapped.lane is not None and s["cpu_lane"]["refused"] == 0
        assert s["misses"] > 0 and s["bytes_mapped"] == (s["misses"] - s["cpu_experts"]) * ex.layout.payload_bytes
        assert s["cpu_lane"]["experts"] == s["cpu_experts"] and (s["cpu_experts"] > 0 or b_pcie is None)
        assert s["hits"] + s["misses"] == sum(len(np.unique(u)) for _, u in ex.trace)
    finally:
        ex.close()


def test_engine_resident_and_at_a_budget(ftw_for):
    ftw = ftw_for("gpt_oss", "mxfp4")
    slots, moe = resident_then_budget(ftw, PROMPT, PARAMS)
    config = FtwReader(ftw).config
    assert slots == config.num_layers * config.num_experts
    # most misses are fetched into the free slots, the others computed by the native CPU kernel
    assert moe["fetched"] > 4 * moe["cpu_experts"] and (moe["cpu_backend"] != "torch" or load_library() is None)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_engine_resident_and_mapped(ftw_for, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    ftw = ftw_for("gpt_oss", "mxfp4")
    kw = dict(device="cuda", kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    want = generate(Engine(ftw, EngineSettings(device="cpu", kv_reserve_tokens=256, max_prefill_length=8,
                                               max_running_requests=2)), PROMPT, PARAMS).token_ids
    eng = Engine(ftw, EngineSettings(memory_ratio=0.5, **kw))  # everything fits: resident, CUDA graphs
    plan, stride = eng._experts.vram_plan, eng._experts.layout.stride
    assert eng._experts.opts.mode == "resident" and eng.model.graphs is not None
    assert generate(eng, PROMPT, PARAMS).token_ids[:4] == want[:4] and eng.stats()["moe"]["misses"] == 0
    eng.close()
    budget = LATE_OUTSIDE + plan.dense + plan.kv + plan.prefill_buffers + plan.reserve + 5 * stride + 4096
    eng = Engine(ftw, EngineSettings(vram_budget=budget, **kw))  # the default mode (mapped), lane off
    assert eng._experts.num_slots < eng.config.num_layers * eng.config.num_experts
    assert generate(eng, PROMPT, PARAMS).token_ids[:4] == want[:4]
    eng.close()
