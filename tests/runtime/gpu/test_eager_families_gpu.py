"""glm_moe_dsa (MLA with the DSA indexer) and deepseek_v4 (compressed sliding attention, hyper-connections, hash-routed
layers) on the GPU path: their layers run as PyTorch ops on the device, so decode steps are not CUDA graphs; their
quantized routed experts (NVFP4 from `--quantize nvfp4`; DeepSeek-V4's release FP4 experts, an MXFP4 bank without
biases, with its clamped_silu) are served by the GPU expert store (CPU emulation here, CUDA where present) with the CPU
engine's greedy tokens; BF16 experts stay on the CPU."""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import SamplingParams
from ft.runtime.gpu import engine_setup

from .engine_checks import cuda_engine_matches_cpu, quantized_ftw, store_matches_cpu

# family -> (its PyTorch-op layer type, a prompt past the tiny preset's index_topk / window / HCA window)
FAMILIES = {"glm_moe_dsa": ("mla_attention", [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21]),
            "deepseek_v4": ("compressed_attention", [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21, 13, 6, 1, 30])}
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.parametrize("arch", list(FAMILIES))


@pytest.fixture(scope="module")
def nvfp4_ftws(hf_for, tmp_path_factory):
    made: dict = {}

    def get(arch):
        if arch not in made:
            made[arch] = quantized_ftw(hf_for(arch), tmp_path_factory.mktemp(arch))
        return made[arch]
    return get


def test_the_store_serves_it_and_decode_is_eager(nvfp4_ftws, arch):
    reader = FtwReader(nvfp4_ftws(arch))
    assert engine_setup.unsupported_reason(reader) is None
    why = engine_setup.eager_reason(reader.config)
    assert why is not None and arch in why and FAMILIES[arch][0] in why


def test_store_matches_the_cpu_engine(nvfp4_ftws, ftw_for, arch):
    ftws = [nvfp4_ftws(arch)]
    if arch == "deepseek_v4":  # the release's FP4 experts, as they are
        ftws.append(ftw_for(arch, "fp4"))
        assert FtwReader(ftws[-1]).quant["experts"] == "mxfp4"
    for ftw in ftws:
        moe = store_matches_cpu(ftw, FAMILIES[arch][1], PARAMS, device="cpu")
        assert moe["misses"] > 0 and moe["fetched"] + moe["cpu_experts"] == moe["misses"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_matches_the_cpu_engine(nvfp4_ftws, monkeypatch, arch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    assert store_matches_cpu(nvfp4_ftws(arch), FAMILIES[arch][1], PARAMS, device="cuda")["misses"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_with_bf16_experts_matches_the_cpu_engine(ftw_for, monkeypatch, arch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    cuda_engine_matches_cpu(ftw_for(arch), FAMILIES[arch][1], PARAMS)


def test_kernels_build_refuses_it(ftw_for, arch):
    from ft.compiler.kernels.build import build_kernel_set

    with pytest.raises(ValueError, match=f"{arch} has no prebuilt GPU kernels yet .its {FAMILIES[arch][0]} layers"):
        build_kernel_set(FtwReader(ftw_for(arch)), 90)
