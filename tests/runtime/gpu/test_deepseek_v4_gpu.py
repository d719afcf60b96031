"""deepseek_v4 and the GPU path: the expert scheduler refuses the family by name (no decode kernel or CUDA graph for
compressed attention or hyper-connections yet); on CUDA the engine then runs the model's layers as PyTorch ops on the
device with the experts on the CPU, and its greedy tokens equal the CPU engine's."""

from __future__ import annotations

import pytest
import torch

from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.gpu import engine_setup

PROMPT = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21, 13, 6, 1, 30]  # past the window, top-k and HCA window
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_the_cpu_engine(ftw_for, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    ftw = ftw_for("deepseek_v4")
    kw = dict(kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    want = generate(Engine(ftw, EngineSettings(device="cpu", **kw)), PROMPT, PARAMS).token_ids
    eng = Engine(ftw, EngineSettings(device="cuda", **kw))
    assert eng._experts is None  # the CPU experts of load_model
    assert generate(eng, PROMPT, PARAMS).token_ids == want
    eng.close()
