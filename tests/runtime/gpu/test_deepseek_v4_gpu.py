"""deepseek_v4 and the GPU path: the expert scheduler refuses the family by name (no decode kernel or CUDA graph for
compressed attention or hyper-connections yet); on CUDA the engine then runs the model's layers as PyTorch ops on the
device with the experts on the CPU, and its greedy tokens equal the CPU engine's."""

from __future__ import annotations

import pytest
import torch

from ft.runtime.engine import SamplingParams
from ft.runtime.gpu import engine_setup

from .engine_checks import cuda_engine_matches_cpu

PROMPT = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21, 13, 6, 1, 30]  # past the window, top-k and HCA window
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_the_cpu_engine(ftw_for, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    cuda_engine_matches_cpu(ftw_for("deepseek_v4"), PROMPT, PARAMS)
