"""deepseek_v4 (compressed sliding attention, hyper-connections, hash-routed layers) and the GPU path: its layers run
as PyTorch ops on the device, so decode steps are not CUDA graphs; its routed experts, quantized, are served by the GPU
expert store (CPU emulation here, CUDA where present) with the CPU engine's greedy tokens; BF16 experts stay on the
CPU."""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import SamplingParams
from ft.runtime.gpu import engine_setup

from .engine_checks import cuda_engine_matches_cpu, quantized_ftw, store_matches_cpu

ARCH = "deepseek_v4"
PROMPT = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21, 13, 6, 1, 30]  # past the window, top-k and HCA window
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def nvfp4_ftw(hf_for, tmp_path_factory):
    return quantized_ftw(hf_for(ARCH), tmp_path_factory.mktemp(ARCH))


def test_the_store_serves_it_and_decode_is_eager(nvfp4_ftw):
    reader = FtwReader(nvfp4_ftw)
    assert engine_setup.unsupported_reason(reader) is None
    why = engine_setup.eager_reason(reader.config)
    assert why is not None and ARCH in why and "compressed_attention" in why


def test_store_matches_the_cpu_engine(nvfp4_ftw):
    moe = store_matches_cpu(nvfp4_ftw, PROMPT, PARAMS, device="cpu")
    assert moe["misses"] > 0 and moe["fetched"] + moe["cpu_experts"] == moe["misses"]


def test_the_release_fp4_experts_go_to_the_store_as_they_are(ftw_for):
    """The release's FP4 experts are an MXFP4 bank without biases: the store's kernels read it, clamped_silu and all."""
    ftw = ftw_for(ARCH, "fp4")
    reader = FtwReader(ftw)
    assert reader.quant["experts"] == "mxfp4" and engine_setup.unsupported_reason(reader) is None
    moe = store_matches_cpu(ftw, PROMPT, PARAMS, device="cpu")
    assert moe["misses"] > 0 and moe["fetched"] + moe["cpu_experts"] == moe["misses"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_matches_the_cpu_engine(nvfp4_ftw, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    assert store_matches_cpu(nvfp4_ftw, PROMPT, PARAMS, device="cuda")["misses"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_with_bf16_experts_matches_the_cpu_engine(ftw_for, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    cuda_engine_matches_cpu(ftw_for(ARCH), PROMPT, PARAMS)


def test_kernels_build_refuses_it(ftw_for):
    from ft.compiler.kernels.build import build_kernel_set

    with pytest.raises(ValueError, match=f"{ARCH} has no prebuilt GPU kernels yet .its compressed_attention layers"):
        build_kernel_set(FtwReader(ftw_for(ARCH)), 90)
