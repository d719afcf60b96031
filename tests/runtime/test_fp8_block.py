"""Block-FP8 releases end to end on the CPU: synthetic 128x128 block-FP8 checkpoints (qwen3_moe, glm4_moe) -> FTW
(dense linears dequantized, experts in a plain bank or NVFP4 with --quantize) -> our runtime, against transformers'
forward at fp32 on the exact BF16 twin (transformers' own FP8 loader floors ragged scale grids, so the twin is the
reference). The tiny presets fit in one tile per linear; the ragged variants span several tiles with partial edges
on both dims."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ft.compiler import compile_checkpoint
from ft.compiler.synth import synth
from ft.formats import FtwReader
from ft.runtime.model import load_model

from fidelity_lib import TOL, assert_greedy_matches, greedy, prompt, reference, run_all

ARCHS = ("qwen3_moe", "glm4_moe")
# several tiles per linear, ragged edges: hidden 200 = 128 + 72, moe_intermediate 136 = 128 + 8, dense 264
RAGGED = {"hidden_size": 200, "moe_intermediate_size": 136, "intermediate_size": 264}


def _check(model, ref, tag: str, gen: int) -> None:
    ids = prompt(model)
    ours = run_all(model, ids)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    print(f"\n{tag}: max |dlogit| over {len(ids)} positions = {diff:.2e}")
    assert diff < TOL and float(theirs.std()) > 0.1
    ids = prompt(model, 16, seed=1)
    assert_greedy_matches(model, ref, ids, gen, tag)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_matches_transformers_on_the_twin(arch, ftw_for, twin_for):
    path = ftw_for(arch, "fp8")
    assert FtwReader(path).quant["experts"] == "fp32"  # the tiny preset is fp32: dequantized to the config's dtype
    _check(load_model(path), reference(twin_for(arch, quant="fp8")), f"{arch} fp8", 32)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-ragged")

    def build(arch: str) -> tuple[Path, Path]:
        src = synth(arch, "tiny", root / arch, quant="fp8", overrides=RAGGED)
        return compile_checkpoint(src, root / f"{arch}.ftw", progress=False), src.with_name(src.name + "-twin")

    return build


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_tiles_match_transformers_on_the_twin(arch, ragged):
    path, twin = ragged(arch)
    r = FtwReader(path)
    assert r.bank(r.bank_names()[0]).expert(0, "gate_up").shape == (2 * 136, 200)
    _check(load_model(path), reference(twin), f"{arch} fp8 ragged", 16)


def test_quantize_nvfp4_from_fp8_serves_on_the_gpu_scheduler(ftw_for, hf_for, tmp_path):
    """--quantize nvfp4 turns an FP8 release's experts into the bank the GPU expert kernels read; its logits stay
    close to the FP8 model's (NVFP4 is 4-bit: a loose bound, the exact bank is checked in tests/compiler)."""
    from ft.runtime.gpu.engine_setup import unsupported_reason

    out = compile_checkpoint(hf_for("qwen3_moe", "fp8"), tmp_path / "nv.ftw", progress=False, quantize="nvfp4")
    r = FtwReader(out)
    assert r.quant["experts"] == "nvfp4" and unsupported_reason(r) is None
    assert unsupported_reason(FtwReader(ftw_for("qwen3_moe", "fp8"))) is not None  # a plain bank has no GPU kernel
    fp8, nv = load_model(ftw_for("qwen3_moe", "fp8")), load_model(out)
    ids = prompt(fp8)
    a, b = run_all(fp8, ids), run_all(nv, ids)
    assert (a - b).abs().max() < 0.1 * a.abs().max() and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_matches_cpu(arch, ftw_for):
    """Dequantized dense weights on the GPU, experts from the CPU bank."""
    cpu, gpu = load_model(ftw_for(arch, "fp8")), load_model(ftw_for(arch, "fp8"), device="cuda")
    ids = prompt(cpu, 24, seed=2)
    assert (run_all(gpu, ids.cuda(), [13, 1, 10]).cpu() - run_all(cpu, ids)).abs().max() < TOL
    assert greedy(gpu, ids.cuda(), 16) == greedy(cpu, ids, 16)
