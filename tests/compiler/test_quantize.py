"""`ft checkpoint --quantize nvfp4`: the quantizer against a brute-force reference of ModelOpt's recipe, the compiled
bank against the source weights bit for bit, the model's logits against the unquantized compile, determinism and
the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ft.compiler import CheckpointError, compile_checkpoint
from ft.compiler.quant.nvfp4 import e2m1_codes, quantize_rows
from ft.compiler.synth import synth
from ft.formats import FtwReader
from ft.formats.quant import nvfp4 as fmt
from ft.formats.reader import STAMP_NAME

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="module")
def bf16_src(work: Path) -> Path:
    return synth("qwen3_moe", "tiny", work / "q3-bf16", dtype="bf16")


@pytest.fixture(scope="module")
def quantized(work: Path, bf16_src: Path) -> Path:
    return compile_checkpoint(bf16_src, work / "q3-nvfp4.ftw", progress=False, quantize="nvfp4")


def reference_block_scales(w: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The recipe written out: e4m3(block amax / (6 * s2)), saturating at 448; zero blocks 1.0 (ModelOpt)."""
    amax = w.float().unflatten(1, (-1, 16)).abs().amax(-1)
    bs = (amax / (6.0 * s2)).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    return torch.where(bs == 0, torch.ones_like(bs), bs)


def test_e2m1_ties_round_half_to_even() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0, 0.2499, 0.2501])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 0.0, 0.5])
    assert torch.equal(fmt.E2M1_LUT[e2m1_codes(x).long()], want)


def test_quantizer_matches_the_recipe() -> None:
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(24, 64, generator=g) * torch.rand(24, 1, generator=g) * 0.05).bfloat16()
    up = (torch.randn(24, 64, generator=g) * 0.02).bfloat16()
    gate[5, 16:32] = 0  # an all-zero block
    gate[7, 0] = 0.9  # one outlier sets the shared global
    qg, qu = quantize_rows(gate.float(), up.float())
    s2 = torch.maximum(gate.float().abs().amax(), up.float().abs().amax()) / (6 * 448)
    for w, q in ((gate, qg), (up, qu)):
        assert torch.equal(q["weight_scale_2"], s2.expand(w.shape[0]))  # one global for gate and up, per row
        bs = reference_block_scales(w, s2)
        assert torch.equal(q["weight_scale"].float(), bs)
        assert bs[0].max() <= 448
        # every code is a nearest E2M1 value of w / (block scale * s2)
        x = w.float().unflatten(1, (-1, 16)) / (bs * s2).unsqueeze(-1)
        got = fmt.e2m1_values(q["weight"]).unflatten(1, (-1, 16))
        best = (x.abs().unsqueeze(-1) - GRID).abs().amin(-1)
        assert torch.equal((got - x).abs(), best)
        assert torch.equal(torch.signbit(got) & (got != 0), (x < 0) & (got != 0))
    assert torch.equal(fmt.e2m1_values(qg["weight"])[5, 16:32], torch.zeros(16))
    assert qg["weight_scale"][5, 1].float() == 1.0


def test_bank_is_the_quantized_source_bit_for_bit(quantized: Path, bf16_src: Path) -> None:
    r = FtwReader(quantized)
    assert r.quant["experts"] == "nvfp4" and r.quant["source"] is None
    meta = r.manifest["metadata"]
    assert meta["options"]["quantize"] == "nvfp4" and meta["quantized"]["experts"] == "nvfp4"
    assert r.tensor("embed_tokens.weight").dtype == torch.bfloat16  # dense weights untouched
    src = {}
    for f in sorted(bf16_src.glob("*.safetensors")):
        src.update(load_file(f))
    n_banks = 0
    for name in r.bank_names():
        layer = int(name.split(".")[1])
        bank = r.bank(name)
        n_banks += 1
        for e in (0, bank.num_experts - 1):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            g, u = quantize_rows(src[p + "gate_proj.weight"].float(), src[p + "up_proj.weight"].float())
            [d] = quantize_rows(src[p + "down_proj.weight"].float())
            for comp, want in (("gate_up", (g, u)), ("down", (d,))):
                ours = fmt.dequantize(bank.expert(e, comp), bank.expert(e, f"{comp}_scale"),
                                      bank.expert(e, f"{comp}_scale_2"))
                direct = torch.cat([fmt.dequantize(q["weight"], q["weight_scale"], q["weight_scale_2"])
                                    for q in want])
                assert torch.equal(ours, direct), (name, e, comp)
                ref = torch.cat([src[p + f"{m}_proj.weight"].float() for m in
                                 (("gate", "up") if comp == "gate_up" else ("down",))])
                # within half the widest E2M1 gap (4 -> 6) of the block scale, which e4m3 rounds by <= 1/16
                assert (ours - ref).abs().max() <= ref.abs().max() / 6 * (1 + 1 / 16)
    assert n_banks >= 1


def test_quantized_model_logits_close_to_bf16(work: Path, bf16_src: Path, ftw_logits) -> None:
    # fp32 compute for both, so the difference is the expert quantization alone
    ref = ftw_logits(compile_checkpoint(bf16_src, work / "ref32.ftw", progress=False, dtype="fp32"))
    q = ftw_logits(compile_checkpoint(bf16_src, work / "q32.ftw", progress=False, dtype="fp32", quantize="nvfp4"))
    delta = (q - ref).abs().max().item()
    top1 = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert 0 < delta < 0.1 * ref.abs().max().item(), delta
    assert top1 >= 0.9, top1


def test_two_compiles_are_byte_identical(work: Path, bf16_src: Path, quantized: Path) -> None:
    b = compile_checkpoint(bf16_src, work / "q3-nvfp4-b.ftw", progress=False, quantize="nvfp4")
    names = sorted(p.name for p in quantized.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in set(names) - {STAMP_NAME}:
        assert (quantized / n).read_bytes() == (b / n).read_bytes(), n


def test_fused_expert_layout_quantizes_like_per_expert(work: Path) -> None:
    per = synth("qwen3_5_moe", "tiny", work / "q35-per", dtype="bf16", expert_layout="per_expert")
    fused = synth("qwen3_5_moe", "tiny", work / "q35-fused", dtype="bf16", expert_layout="fused")
    a = FtwReader(compile_checkpoint(per, work / "q35-per.ftw", progress=False, quantize="nvfp4"))
    b = FtwReader(compile_checkpoint(fused, work / "q35-fused.ftw", progress=False, quantize="nvfp4"))
    assert a.quant["experts"] == b.quant["experts"] == "nvfp4"
    for name in a.bank_names():
        for comp in a.bank(name).components:
            assert torch.equal(a.bank(name).expert(1, comp).view(torch.uint8),
                               b.bank(name).expert(1, comp).view(torch.uint8)), (name, comp)


def test_refusals(work: Path, bf16_src: Path) -> None:
    nv = synth("qwen3_moe", "tiny", work / "q3-nv", dtype="bf16", quant="nvfp4", twin=False)
    with pytest.raises(CheckpointError, match="already quantized"):
        compile_checkpoint(nv, work / "x.ftw", progress=False, quantize="nvfp4")
    with pytest.raises(CheckpointError, match="--quantize 'int4' is not supported"):
        compile_checkpoint(bf16_src, work / "x.ftw", progress=False, quantize="int4")
    with pytest.raises(CheckpointError, match="contradict"):
        compile_checkpoint(bf16_src, work / "x.ftw", progress=False, quantize="nvfp4", dequant=True)
    gpt = synth("gpt_oss", "tiny", work / "gpt-bf16", dtype="bf16")
    with pytest.raises(CheckpointError, match="not supported for gpt_oss"):
        compile_checkpoint(gpt, work / "x.ftw", progress=False, quantize="nvfp4")
    odd = synth("qwen3_moe", "tiny", work / "q3-odd", dtype="bf16", overrides={"moe_intermediate_size": 40})
    with pytest.raises(CheckpointError, match="multiples of 16, got 64 and 40"):
        compile_checkpoint(odd, work / "x.ftw", progress=False, quantize="nvfp4")
    assert not (work / "x.ftw").exists()


def test_cli_flag(work: Path, bf16_src: Path) -> None:
    from typer.testing import CliRunner

    from ft.cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["checkpoint", "--model", str(bf16_src), "--out", str(work / "cli.ftw"),
                              "--quantize", "int4", "--no-progress"])
    assert res.exit_code == 1 and "--quantize 'int4' is not supported" in res.output, res.output
    assert not (work / "cli.ftw").exists()
    res = runner.invoke(app, ["checkpoint", "--model", str(bf16_src), "--out", str(work / "cli.ftw"),
                              "--quantize", "nvfp4", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert FtwReader(work / "cli.ftw").quant["experts"] == "nvfp4"
