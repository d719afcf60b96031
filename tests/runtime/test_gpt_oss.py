"""gpt_oss end to end on the CPU: transformers-written tiny checkpoints (plain and MXFP4) -> FTW -> our runtime, against
transformers' forward on the same weights at fp32.

The tiny preset has 4 layers (sliding, full, sliding, full) with an 8-token window, YaRN, sinks, biases everywhere and
the clamped SwiGLU; prompts are longer than the window. The MXFP4 reference is transformers' model whose experts are
set to transformers' own dequantization of the checkpoint's blocks and scales (`convert_moe_packed_tensors`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from ft.formats import FtwReader
from ft.runtime.model import load_model
from ft.runtime.models import model_class

from fidelity_lib import SELF_TOL, TOL, assert_greedy_matches, greedy, prompt, reference, run_all

GEN = 48
def _hf_tensors(hf_dir, suffix: str) -> dict[str, torch.Tensor]:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in index.items():
        if name.endswith(suffix):
            with safe_open(str(hf_dir / file), "pt") as f:
                out[name] = f.get_tensor(name)
    return out


def mxfp4_reference(hf_dir, twin_dir) -> torch.nn.Module:
    """transformers on the twin, its experts replaced by transformers' dequantization of the MXFP4 checkpoint."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = reference(twin_dir)
    blocks, scales = _hf_tensors(hf_dir, "_blocks"), _hf_tensors(hf_dir, "_scales")
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, b in blocks.items():
            base = name.removesuffix("_blocks")
            theirs = convert_moe_packed_tensors(b, scales[base + "_scales"], dtype=torch.float32)  # [E, in, out]
            assert torch.equal(params[base], theirs), f"{base}: the twin is not transformers' dequantization"
            params[base].copy_(theirs)
    return ref


@pytest.fixture(scope="module", params=["none", "mxfp4"])
def pair(request, ftw_for, hf_for, twin_for):
    quant = request.param
    model = load_model(ftw_for("gpt_oss", quant))
    ref = reference(hf_for("gpt_oss")) if quant == "none" else \
        mxfp4_reference(hf_for("gpt_oss", "mxfp4"), twin_for("gpt_oss", quant="mxfp4"))
    return quant, model, ref


def test_layout_and_config(ftw_for):
    r = FtwReader(ftw_for("gpt_oss", "mxfp4"))
    cfg = r.config
    assert r.quant["experts"] == "mxfp4" and r.quant["linears"] == {}
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == 8
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position_embeddings) == ("yarn", 32.0, 256)
    assert cfg.expert_act == "clamped_swiglu" and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    bank = r.bank("layers.0.mlp.experts")
    assert {n: (c.dtype, tuple(c.shape)) for n, c in bank.components.items()} == {
        "gate_up": ("U8", (128, 32)), "gate_up_scale": ("U8", (128, 2)), "gate_up_bias": ("F32", (128,)),
        "down": ("U8", (64, 32)), "down_scale": ("U8", (64, 2)), "down_bias": ("F32", (64,))}
    assert r.tensor("layers.1.self_attn.sinks").shape == (4,) and r.tensor("layers.1.mlp.gate.bias").shape == (8,)
    assert FtwReader(ftw_for("gpt_oss", "none")).quant["experts"] == "fp32"


def test_mxfp4_bank_is_the_checkpoint_bytes_deinterleaved(ftw_for, hf_for):
    """The bank holds the release's bytes: gate rows = even rows, up rows = odd rows of gate_up, never requantized."""
    hf = hf_for("gpt_oss", "mxfp4")
    bank = FtwReader(ftw_for("gpt_oss", "mxfp4")).bank("layers.2.mlp.experts")
    blocks = _hf_tensors(hf, "layers.2.mlp.experts.gate_up_proj_blocks")
    [b] = blocks.values()
    [s] = _hf_tensors(hf, "layers.2.mlp.experts.gate_up_proj_scales").values()
    [bias] = _hf_tensors(hf, "layers.2.mlp.experts.gate_up_proj_bias").values()
    for e in (0, 5):
        perm = torch.cat([torch.arange(0, 128, 2), torch.arange(1, 128, 2)])
        assert torch.equal(bank.expert(e, "gate_up"), b[e].flatten(-2)[perm])
        assert torch.equal(bank.expert(e, "gate_up_scale"), s[e][perm])
        assert torch.equal(bank.expert(e, "gate_up_bias"), bias[e][perm].float())


def test_prompt_logits_match_transformers(pair):
    quant, model, ref = pair
    ids = prompt(model)                                     # 32 tokens: 4 windows of 8
    ours = run_all(model, ids)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    print(f"\ngpt_oss {quant}: max |dlogit| over {len(ids)} positions = {diff:.2e}")
    assert diff < TOL


def test_48_greedy_tokens_match_transformers(pair):
    quant, model, ref = pair
    ids = prompt(model, 24, seed=1)
    ours = assert_greedy_matches(model, ref, ids, GEN, f"gpt_oss {quant}")
    assert len(set(ours)) > 3  # not a degenerate repetition


@pytest.mark.parametrize("chunks", [[1] * 20, [7, 9, 4], [19, 1]])
def test_chunked_prefill_across_the_window_matches_one_shot(pair, chunks):
    _, model, _ = pair
    ids = prompt(model, 20, seed=3)
    assert (run_all(model, ids, chunks) - run_all(model, ids)).abs().max() < SELF_TOL


def test_bf16_checkpoint_compiles_and_tracks_fp32(ftw_for):
    """A BF16 gpt_oss (plain experts) computes in BF16 and stays close to the fp32 model of the same weights."""
    m16 = load_model(ftw_for("gpt_oss", "none", synth_dtype="bf16"))
    m32 = load_model(ftw_for("gpt_oss", "none", dtype="fp32", synth_dtype="bf16"))
    assert m16.dtype == torch.bfloat16 and FtwReader(ftw_for("gpt_oss", "none", synth_dtype="bf16")).quant[
        "experts"] == "bf16"
    ids = prompt(m16)
    a, b = run_all(m16, ids), run_all(m32, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_family_rules(ftw_for):
    cfg = FtwReader(ftw_for("gpt_oss", "none")).config
    with pytest.raises(ValueError, match="expert_act is 'silu', gpt_oss requires 'clamped_swiglu'"):
        model_class("gpt_oss")(dataclasses.replace(cfg, expert_act="silu"))
    with pytest.raises(ValueError, match="attn_sinks is True, qwen3_moe requires False"):
        model_class("qwen3_moe")(dataclasses.replace(cfg, family="qwen3_moe", attn_qk_norm=True))
    qwen = FtwReader(ftw_for("qwen3_moe", "none")).config
    with pytest.raises(ValueError, match=r"rope_type is 'yarn'; qwen3_moe allows \['default'\]"):
        model_class("qwen3_moe")(dataclasses.replace(qwen, rope_type="yarn", rope_original_max_position_embeddings=8))


def test_gpu_scheduler_takes_mxfp4_and_refuses_plain_experts_with_a_reason(ftw_for):
    from ft.runtime.engine import Engine
    from ft.runtime.gpu.engine_setup import unsupported_reason
    from ft.runtime.gpu.offload_config import OffloadConfig

    assert unsupported_reason(FtwReader(ftw_for("gpt_oss", "mxfp4"))) is None
    reader = FtwReader(ftw_for("gpt_oss", "none"))
    scheme = reader.quant["experts"]
    assert unsupported_reason(reader) == f"expert scheme {scheme!r} has no GPU kernel (supported: nvfp4, mxfp4)"
    with pytest.raises(ValueError, match=f"GPU expert scheduler cannot serve this model: expert scheme '{scheme}'"):
        Engine(reader, offload=OffloadConfig(vram_budget=1 << 30))


def test_summary_counts_mxfp4_parameters(ftw_for):
    from ft.formats.summary import summarize

    s = summarize(FtwReader(ftw_for("gpt_oss", "mxfp4")))
    E, I, H, L = 8, 64, 64, 4
    assert s["parameters"]["experts"] == L * E * (2 * I * H + 2 * I + H * I + H)  # codes (2 per byte) and biases
    assert (s["layers"]["sliding_attention"], s["layers"]["full_attention"]) == (2, 2)
    plain = summarize(FtwReader(ftw_for("gpt_oss", "none")))
    assert plain["parameters"]["total"] == s["parameters"]["total"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["none", "mxfp4"])
def test_cuda_matches_cpu(quant, ftw_for):
    """Dense weights on the GPU (decode attention in the fused kernel, prefill's on the eager path), experts from the
    CPU bank."""
    cpu, gpu = load_model(ftw_for("gpt_oss", quant)), load_model(ftw_for("gpt_oss", quant), device="cuda")
    ids = prompt(cpu, 24, seed=2)
    ours_gpu = run_all(gpu, ids.cuda(), [13, 1, 10])
    assert (ours_gpu.cpu() - run_all(cpu, ids)).abs().max() < TOL
    assert greedy(gpu, ids.cuda(), 16) == greedy(cpu, ids, 16)
