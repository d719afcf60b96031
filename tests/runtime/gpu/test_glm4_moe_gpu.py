"""glm4_moe on the GPU expert scheduler: NVFP4 experts in the slot cache (resident, or a budget of a few slots with
the rest fetched / computed on the CPU). CPU emulation here (the sigmoid router on its PyTorch path); on CUDA the same
checks against the CPU engine, with CUDA graphs and the fused sigmoid router (`router_topk` with a `SigmoidRoute`)."""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import Engine, EngineSettings, generate
from ft.runtime.gpu import engine_setup
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.sizing import LATE_OUTSIDE
from ft.runtime.gpu.store import GpuExperts
from ft.runtime.model import load_model

from .engine_checks import PARAMS, PROMPT, prompt_logits, resident_then_budget
from .gpu_fixtures import rel_err



def test_scheduler_with_few_slots_matches_cpu_experts(ftw_for):
    ftw = ftw_for("glm4_moe", "nvfp4")
    reader = FtwReader(ftw)
    ex = GpuExperts(reader, OffloadConfig(num_slots=3, b_pcie=1e9, b_cpu=1e9, prefill_tokens=4),
                    device="cpu")
    assert ex.moe_layers == [1, 2]  # layer 0 is dense
    got = prompt_logits(load_model(reader, device="cpu", experts=ex), PROMPT)
    want = prompt_logits(load_model(ftw), PROMPT)
    # CPU experts round the dequantized weights to the model dtype, the scheduler's kernels do not (test_gpu_model)
    assert rel_err(got, want) < 1e-2 and ex.counters["misses"] > 0
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_engine_resident_and_at_a_budget(ftw_for):
    slots, _ = resident_then_budget(ftw_for("glm4_moe", "nvfp4"), PROMPT, PARAMS)
    assert slots == 2 * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_resident_and_mapped(ftw_for, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    ftw = ftw_for("glm4_moe", "nvfp4")
    kw = dict(device="cuda", kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    want = generate(Engine(ftw, EngineSettings(device="cpu", kv_reserve_tokens=256, max_prefill_length=8,
                                               max_running_requests=2)), PROMPT, PARAMS).token_ids
    eng = Engine(ftw, EngineSettings(memory_ratio=0.5, **kw))  # everything fits: resident
    plan, stride = eng._experts.vram_plan, eng._experts.layout.stride
    assert eng._experts.opts.mode == "resident"
    assert generate(eng, PROMPT, PARAMS).token_ids[:4] == want[:4] and eng.stats()["moe"]["misses"] == 0
    eng.close()
    budget = LATE_OUTSIDE + plan.dense + plan.kv + plan.prefill_buffers + plan.reserve + 5 * stride + 4096
    eng = Engine(ftw, EngineSettings(vram_budget=budget, **kw))
    assert eng._experts.num_slots < 16 and eng._experts.opts.mode == "mapped"
    assert generate(eng, PROMPT, PARAMS).token_ids[:4] == want[:4]
    eng.close()
