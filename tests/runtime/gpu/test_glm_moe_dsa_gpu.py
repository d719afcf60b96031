"""glm_moe_dsa and the GPU path: the expert scheduler refuses MLA by name (no decode kernel or CUDA graph for it yet);
on CUDA the engine then runs the model's layers as PyTorch ops on the device with the experts on the CPU, and its
greedy tokens equal the CPU engine's."""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import SamplingParams
from ft.runtime.gpu import engine_setup

from .engine_checks import cuda_engine_matches_cpu

PROMPT = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21]  # longer than the tiny preset's index_topk (8)
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_the_gpu_scheduler_refuses_mla_by_name(ftw_for):
    why = engine_setup.unsupported_reason(FtwReader(ftw_for("glm_moe_dsa")))
    assert why is not None and "glm_moe_dsa" in why and "latent attention" in why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_the_cpu_engine(ftw_for, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    cuda_engine_matches_cpu(ftw_for("glm_moe_dsa"), PROMPT, PARAMS)


def test_kernels_build_refuses_mla(ftw_for):
    from ft.compiler.kernels.build import build_kernel_set

    with pytest.raises(ValueError, match="glm_moe_dsa has no GPU kernels yet"):
        build_kernel_set(FtwReader(ftw_for("glm_moe_dsa")), 90)
