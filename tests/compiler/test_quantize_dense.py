"""`ft checkpoint --quantize-dense fp8|nvfp4`: the per-row FP8 quantizer against its recipe, which linears a compile
quantizes (and which it must not), their stored bytes against the source weights, the model's logits against the
unquantized compile, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ft.compiler import CheckpointError, compile_checkpoint
from ft.compiler.linear import DENSE_QUANTIZABLE, dense_quantizable
from ft.compiler.quant import fp8 as qfp8, nvfp4 as qnvfp4
from ft.compiler.synth import synth
from ft.formats import FtwReader
from ft.formats.quant import fp8, nvfp4


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantize_dense")


@pytest.fixture(scope="module")
def src(work: Path) -> Path:
    return synth("qwen3_5_moe", "tiny", work / "q35-bf16", dtype="bf16")


def _source(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_fp8_rows_follow_the_recipe():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(7, 48, generator=g) * torch.logspace(-3, 1, 7)[:, None]
    w[3] = 0  # an all-zero row: scale 1, codes 0
    q, s = qfp8.quantize_rows(w, chunk_elems=100)  # several chunks of rows
    want = w.abs().amax(1) / fp8.E4M3_MAX
    want[3] = 1.0
    assert q.dtype == torch.float8_e4m3fn and torch.equal(s, want)
    assert torch.equal(q.view(torch.uint8), (w / want[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(q.float().abs().amax(1)[torch.arange(7) != 3], torch.full((6,), 448.0))  # each row's max
    deq = fp8.dequantize(q, s)
    assert ((deq - w).abs() <= w.abs().amax(1, keepdim=True) / 448 * 2 ** -6 + w.abs() / 16).all()


def test_the_quantizable_names():
    assert dense_quantizable("layers.3.self_attn.qkv_proj", 64) and dense_quantizable("lm_head", 2048)
    assert dense_quantizable("layers.0.mlp.shared_expert.down_proj", 512)
    for name in ("layers.1.mlp.gate", "layers.1.mlp.shared_expert_gate", "layers.2.linear_attn.in_proj_ba",
                 "layers.0.self_attn.kv_b_proj", "layers.0.self_attn.indexer.wk", "embed_tokens"):
        assert not dense_quantizable(name, 64), name
    assert not dense_quantizable("layers.0.self_attn.o_proj", 40)  # not whole 16-wide blocks
    assert all("." in n for n in DENSE_QUANTIZABLE)


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4"])
def test_compile_quantizes_the_projections_and_the_head(work: Path, src: Path, scheme: str):
    ftw = compile_checkpoint(src, work / f"q35-{scheme}.ftw", progress=False, quantize="nvfp4",
                             quantize_dense=scheme)
    r = FtwReader(ftw)
    stored = "fp8_row" if scheme == "fp8" else "nvfp4"
    linears = r.quant["linears"]
    cfg = r.config
    want = {"lm_head"}
    for i, kind in enumerate(cfg.layer_types):
        want |= {f"layers.{i}.{n}" for n in (("self_attn.qkv_proj", "self_attn.o_proj") if kind == "full_attention"
                                             else ("linear_attn.in_proj_qkvz", "linear_attn.out_proj"))}
        want |= {f"layers.{i}.mlp.shared_expert.gate_up_proj", f"layers.{i}.mlp.shared_expert.down_proj"}
    assert linears == dict.fromkeys(sorted(want), stored)
    meta = r.manifest["metadata"]
    assert meta["options"]["quantize_dense"] == scheme and meta["quantized"] == {
        "by": "ft checkpoint --quantize", "recipe": "modelopt", "experts": "nvfp4", "dense": scheme}
    for plain in ("layers.0.mlp.gate.weight", "layers.0.mlp.shared_expert_gate.weight", "embed_tokens.weight"):
        assert r.tensor(plain).dtype == torch.bfloat16, plain
    # the LM head (no fusion, no permutation): the stored bytes are the quantizer's output on the source weight
    head = _source(src)["lm_head.weight"]
    if scheme == "fp8":
        q, s = qfp8.quantize_rows(head)
        assert torch.equal(r.tensor("lm_head.weight").view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(r.tensor("lm_head.weight_scale"), s)
        deq = fp8.dequantize(r.tensor("lm_head.weight"), r.tensor("lm_head.weight_scale"))
        bound = head.float().abs() / 16 + head.float().abs().amax(1, keepdim=True) / 448 * 2 ** -6
    else:
        q, s, s2 = qnvfp4.quantize(head)
        assert torch.equal(r.tensor("lm_head.weight"), q) and torch.equal(r.tensor("lm_head.weight_scale_2"),
                                                                        s2.expand(head.shape[0]))
        deq = nvfp4.dequantize(r.tensor("lm_head.weight"), r.tensor("lm_head.weight_scale"),
                               r.tensor("lm_head.weight_scale_2"))
        bound = head.float().abs().amax() / 6 * (1 + 1 / 16)  # half the widest E2M1 gap of the largest block scale
    assert ((deq - head.float()).abs() <= bound).all()


# measured (tiny qwen3_5_moe, 48 tokens): fp8 max |dlogit| 0.93 of max |logit| 11.0, top-1 0.94; nvfp4 3.28, 0.75
@pytest.mark.parametrize("scheme,rel,top1", [("fp8", 0.15, 0.9), ("nvfp4", 0.4, 0.7)])
def test_logits_stay_close_to_the_unquantized_model(work: Path, src: Path, scheme: str, rel: float, top1: float,
                                                    ftw_logits):
    # fp32 compute for both, so the difference is the dense quantization alone (experts quantized in both)
    ref = ftw_logits(compile_checkpoint(src, work / "ref32.ftw", progress=False, dtype="fp32", quantize="nvfp4",
                                    force=True))
    q = ftw_logits(compile_checkpoint(src, work / f"d32-{scheme}.ftw", progress=False, dtype="fp32", quantize="nvfp4",
                                  quantize_dense=scheme))
    delta = (q - ref).abs().max().item()
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"--quantize-dense {scheme}: max |dlogit| {delta:.4f} of max |logit| {ref.abs().max().item():.3f}, "
          f"top-1 agreement {agree:.3f}")
    assert 0 < delta < rel * ref.abs().max().item(), delta
    assert agree >= top1, agree


def test_refusals(work: Path, src: Path):
    with pytest.raises(CheckpointError, match="--quantize-dense 'int4' is not supported; supported: fp8, nvfp4"):
        compile_checkpoint(src, work / "x.ftw", progress=False, quantize_dense="int4")
    with pytest.raises(CheckpointError, match="--quantize-dense and --dequant contradict"):
        compile_checkpoint(src, work / "x.ftw", progress=False, quantize_dense="fp8", dequant=True)
    assert not (work / "x.ftw").exists()

    from typer.testing import CliRunner

    from ft.cli.main import app

    res = CliRunner().invoke(app, ["checkpoint", "--model", str(src), "--out", str(work / "cli.ftw"),
                                   "--quantize-dense", "fp8", "--no-progress"])
    assert res.exit_code == 0, res.output
    r = FtwReader(work / "cli.ftw")
    assert r.quant["experts"] != "nvfp4" and set(r.quant["linears"].values()) == {"fp8_row"}
