"""The quantized releases end to end on the CPU: DeepSeek-V4's (block-FP8 with E8M0 scales, FP4 experts served from an
MXFP4 bank without biases) and GLM-5-FP8 (block-FP8, experts in a BF16 bank), synthetic tiny checkpoints -> FTW ->
our runtime, against transformers' forward at fp32. transformers loads these releases itself on a CPU (its FP8
quantizer dequantizes them; it needs accelerate): that load is checked to equal the exact BF16 twin parameter for
parameter, so the twin, loadable everywhere, is the reference of the logit and greedy comparisons."""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.model import load_model

from fidelity_lib import TOL, assert_greedy_matches, prompt, reference, reference_logits, run_all

RELEASES = [("deepseek_v4", "fp4"), ("glm_moe_dsa", "fp8")]


@pytest.mark.parametrize("arch, quant", RELEASES)
def test_release_matches_transformers_on_the_twin(arch, quant, ftw_for, twin_for):
    path = ftw_for(arch, quant)
    assert FtwReader(path).quant["experts"] == ("mxfp4" if quant == "fp4" else "fp32")  # tiny preset: fp32
    model, ref = load_model(path), reference(twin_for(arch, quant=quant))
    ids = prompt(model, 40)
    ours, theirs = run_all(model, ids), reference_logits(ref, ids)
    diff = (ours - theirs).abs().max().item()
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"\n{arch} {quant}: max |dlogit| over {len(ids)} positions = {diff:.2e}, top-1 agreement {top1:.3f}")
    assert diff < TOL and top1 == 1.0 and float(theirs.std()) > 0.1
    assert_greedy_matches(model, ref, prompt(model, 16, seed=1), 48, f"{arch} {quant}")


@pytest.mark.parametrize("arch, quant", RELEASES)
def test_transformers_own_load_of_the_release_is_the_twin(arch, quant, hf_for, twin_for):
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer needs it
    if torch.cuda.is_available():
        pytest.skip("on a GPU transformers keeps the FP8 weights quantized instead of dequantizing them")
    theirs, twin = reference(hf_for(arch, quant)).state_dict(), reference(twin_for(arch, quant=quant)).state_dict()
    assert set(theirs) == set(twin)
    for name, t in twin.items():
        assert torch.equal(theirs[name], t), name


def test_cpu_experts_read_an_mxfp4_bank_without_biases(ftw_for):
    """The bank of FP4 experts: four components, refused when the config says the experts carry biases; its GPU record
    layout has no bias offsets (the GPU engine refuses deepseek_v4 itself)."""
    import dataclasses

    from ft.runtime.experts import check_bank
    from ft.runtime.gpu.record_layout import RecordLayout

    r = FtwReader(ftw_for("deepseek_v4", "fp4"))
    bank = r.bank(r.bank_names()[0])
    check_bank(bank, r.config)
    with pytest.raises(ValueError, match="components .* expected"):
        check_bank(bank, dataclasses.replace(r.config, expert_bias=True))
    lay = RecordLayout.from_bank(bank, r.config.hidden_size, r.config.moe_intermediate_size)
    assert lay.components == ("gate_up", "gate_up_scale", "down", "down_scale")
    assert (lay.off_gate_up_bias, lay.off_down_bias) == (-1, -1) and not lay.kernel_args("down")["BIAS"]
    assert lay == RecordLayout.packed(64, 32, "mxfp4", bias=False)
