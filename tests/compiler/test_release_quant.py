"""Quantized releases of deepseek_v4 (DeepSeek-V4-Flash / -Pro: block-FP8 with E8M0 `ue8m0` scales, FP4 routed
experts) and glm_moe_dsa (GLM-5-FP8: 128x128 block-FP8): E8M0 scales and FP4 bytes decoded as transformers decodes
them, the synthetic release layouts, compiled banks holding exactly the twin's weights (FP4 experts kept as MXFP4
bytes), and the refusals of variants we do not read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft.compiler import compile_checkpoint
from ft.compiler.quant import fp8_block
from ft.compiler.synth import synth
from ft.formats import FtwReader
from ft.formats.quant import mxfp4

from compile_lib import assert_refused, copy_checkpoint

transformers = pytest.importorskip("transformers")


def _hf_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' exact dequantization of a weight and its scale grid (FP8 tiles or FP4 rows), in float32."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


def test_e8m0_scale_values_are_transformers_powers_of_two():
    e = torch.arange(255, dtype=torch.uint8)
    want = e.view(torch.float8_e8m0fnu).float()  # transformers' cast of float8_e8m0fnu scales
    for stored in (e.view(torch.float8_e8m0fnu), e):
        got = fp8_block.scale_values(stored)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(fp8_block.e8m0(want).view(torch.uint8), e)
    with pytest.raises(ValueError, match=r"E8M0 scale byte 255 \(NaN\) at \(1,\)"):
        fp8_block.scale_values(torch.tensor([127, 255], dtype=torch.uint8))
    with pytest.raises(ValueError, match="float32 or E8M0"):
        fp8_block.scale_values(torch.ones(2, dtype=torch.float16))


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 128), (129, 257), (300, 200)])
def test_ue8m0_tiles_dequantize_as_transformers(shape):
    """Whole tiles: transformers' own dequantization; ragged edges (which its loader floors): the tile formula."""
    g = torch.Generator().manual_seed(shape[1])
    q = (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(100, 140, fp8_block.grid(*shape), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    i, j = torch.arange(shape[0])[:, None] // 128, torch.arange(shape[1])[None, :] // 128
    want = q.float() * torch.exp2(s.view(torch.uint8).float() - 127)[i, j]
    assert torch.equal(fp8_block.dequantize(q, s), want)
    assert torch.equal(fp8_block.dequantize(q, s.view(torch.uint8)), want)
    if shape[0] % 128 == 0 and shape[1] % 128 == 0:
        assert torch.equal(want, _hf_dequant(q, s))


def test_fp4_bytes_are_mxfp4_bytes():
    """transformers' FP4 experts (int8 E2M1 pairs, low nibble first, E8M0 per 32 inputs) decode, byte for byte, as
    our MXFP4 bank records: the bank takes the release's bytes unchanged."""
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8)   # [out, in/2], every code
    scales = torch.randint(110, 140, (48, 4), generator=g, dtype=torch.uint8)    # [out, in/32]
    theirs = _hf_dequant(packed, scales.view(torch.float8_e8m0fnu))
    assert torch.equal(mxfp4.dequantize(packed.view(torch.uint8), scales), theirs)


# ---- synthetic releases and their compilation -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("release-quant")


@pytest.fixture(scope="module")
def v4(work) -> Path:
    return synth("deepseek_v4", "tiny", work / "v4", quant="fp4", dtype="bf16")


@pytest.fixture(scope="module")
def glm5(work) -> Path:
    return synth("glm_moe_dsa", "tiny", work / "glm5", quant="fp8", dtype="bf16")


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _twin(d: Path) -> Path:
    return d.with_name(d.name + "-twin")


def test_v4_release_layout_and_exact_twin(v4):
    cfg = json.loads((v4 / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    t, twin = _tensors(v4), _tensors(_twin(v4))
    e = "model.layers.1.ffn.experts.3.w1"
    assert t[f"{e}.weight"].dtype == torch.int8 and t[f"{e}.weight"].shape == (32, 32)
    assert t[f"{e}.scale"].dtype == torch.float8_e8m0fnu and t[f"{e}.scale"].shape == (32, 2)
    d = "model.layers.1.attn.wq_b"
    assert t[f"{d}.weight"].dtype == torch.float8_e4m3fn and t[f"{d}.scale"].shape == (1, 1)
    for kept in ("model.layers.1.attn.compressor.wkv.weight", "model.layers.1.attn.indexer.weights_proj.weight",
                 "model.layers.1.ffn.gate.weight", "head.weight"):
        assert t[kept].dtype == torch.bfloat16 and not any(n.startswith(kept[:-6] + "scale") for n in t)
    scaled = [n for n in t if n.endswith(".scale")]
    assert set(twin) == set(t) - set(scaled) and len(scaled) > 100
    for n in scaled:
        w = n[: -len("scale")] + "weight"
        assert twin[w].dtype == torch.bfloat16 and torch.equal(twin[w].float(), _hf_dequant(t[w], t[n])), w


def _same_ftw(a: Path, b: Path, *, banks: bool = True) -> None:
    ra, rb = FtwReader(a), FtwReader(b)
    # same tensors, not the same order: a compile writes in its source's disk order (prepare._disk_order)
    assert sorted(ra.tensor_names()) == sorted(rb.tensor_names()) and sorted(ra.bank_names()) == sorted(rb.bank_names())
    for n in ra.tensor_names():
        assert ra.tensor(n).dtype == rb.tensor(n).dtype and torch.equal(ra.tensor(n), rb.tensor(n)), n
    for n in ra.bank_names() if banks else ():
        ba, bb = ra.bank(n), rb.bank(n)
        assert ba.scheme == bb.scheme
        for e in range(ba.num_experts):
            assert torch.equal(ba.record(e), bb.record(e)), f"{n} expert {e}"


def test_v4_compiles_to_an_mxfp4_bank_of_the_twin(v4, work):
    """Dense FP8 linears dequantized exactly to BF16; each routed expert an MXFP4 record (no biases) holding the
    release's bytes, gate rows then up rows, that dequantizes bit for bit to the twin's BF16 bank."""
    ours = compile_checkpoint(v4, work / "v4.ftw", progress=False)
    ref = compile_checkpoint(_twin(v4), work / "v4-twin.ftw", progress=False)
    _same_ftw(ours, ref, banks=False)
    r, rt, src = FtwReader(ours), FtwReader(ref), _tensors(v4)
    assert r.quant["experts"] == "mxfp4" and rt.quant["experts"] == "bf16"
    assert r.quant["source"]["expert_dtype"] == "fp4"  # V4's top-level key, moved as transformers moves it
    for name in r.bank_names():
        b, bt = r.bank(name), rt.bank(name)
        assert {c: (x.dtype, tuple(x.shape)) for c, x in b.components.items()} == {
            "gate_up": ("U8", (64, 32)), "gate_up_scale": ("U8", (64, 2)), "down": ("U8", (64, 16)),
            "down_scale": ("U8", (64, 1))}
        layer = name.split(".")[1]
        for e in range(b.num_experts):
            p = f"model.layers.{layer}.ffn.experts.{e}."
            assert torch.equal(b.expert(e, "gate_up"),
                               torch.cat([src[p + "w1.weight"], src[p + "w3.weight"]]).view(torch.uint8))
            assert torch.equal(b.expert(e, "down_scale"), src[p + "w2.scale"].view(torch.uint8))
            for comp in ("gate_up", "down"):
                deq = mxfp4.dequantize(b.expert(e, comp), b.expert(e, f"{comp}_scale"))
                assert torch.equal(deq.to(torch.bfloat16), bt.expert(e, comp)), f"{name} expert {e} {comp}"


def test_v4_dequant_flag_equals_the_twin(v4, work):
    _same_ftw(compile_checkpoint(v4, work / "v4-deq.ftw", progress=False, dequant=True),
              work / "v4-twin.ftw" if (work / "v4-twin.ftw").is_dir() else
              compile_checkpoint(_twin(v4), work / "v4-twin.ftw", progress=False))


@pytest.mark.parametrize("quantize", [None, "nvfp4"])
def test_glm5_fp8_compiles_as_its_twin(glm5, work, quantize):
    tag = quantize or "plain"
    ours = compile_checkpoint(glm5, work / f"glm5-{tag}.ftw", progress=False, quantize=quantize)
    _same_ftw(ours, compile_checkpoint(_twin(glm5), work / f"glm5-twin-{tag}.ftw", progress=False, quantize=quantize))
    r = FtwReader(ours)
    assert r.quant["experts"] == (quantize or "bf16") and r.quant["source"]["quant_method"] == "fp8"
    assert r.tensor("layers.1.self_attn.qkv_a_proj.weight").dtype == torch.bfloat16


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of `src` whose tensors (every shard) and index went through `edit(dict) -> dict`."""
    copy_checkpoint(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    wmap = {}
    for f in sorted(dst.glob("*.safetensors")):
        t = edit(load_file(f))
        save_file(t, f, metadata={"format": "pt"})
        wmap.update(dict.fromkeys(t, f.name))
    index["weight_map"] = wmap
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


_RELEASE_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
                  "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def _hf_spelling(t):
    """transformers' `weight_scale_inv` names and U8 exponent bytes."""
    return {(k[: -len("scale")] + "weight_scale_inv" if k.endswith(".scale") else k):
            (v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v) for k, v in t.items()}


def _release_names(t):
    """DeepSeek's own names (`embed.weight`, `layers.*`, `hc_head_fn`, ... without `model.`), as the release has."""
    return {_RELEASE_NAMES.get(k, k.removeprefix("model.")): v for k, v in t.items()}


@pytest.mark.parametrize("spelling", ["transformers", "release-names"])
def test_v4_spellings_compile_the_same(v4, work, spelling):
    """transformers' spelling (`weight_scale_inv`, U8 exponents, V4.1's expert_dtype inside the quantization_config)
    and the release's own tensor names give the FTW of the synthetic layout."""
    alt = _rewrite(v4, work / f"v4-{spelling}", _hf_spelling if spelling == "transformers" else _release_names)
    if spelling == "transformers":
        cfg = json.loads((alt / "config.json").read_text())
        cfg["quantization_config"]["expert_dtype"] = cfg.pop("expert_dtype")
        (alt / "config.json").write_text(json.dumps(cfg))
    else:
        assert "layers.1.ffn.experts.0.w1.scale" in _tensors(alt)
    ref = work / "v4.ftw" if (work / "v4.ftw").is_dir() else compile_checkpoint(v4, work / "v4.ftw", progress=False)
    _same_ftw(compile_checkpoint(alt, work / f"v4-{spelling}.ftw", progress=False), ref)


# ---- refusals -------------------------------------------------------------------------------------------------------

def _nan_scale(name: str):
    def edit(t):
        if name in t:
            s = t[name].view(torch.uint8).clone()
            s.view(-1)[0] = 255
            t[name] = s.view(torch.float8_e8m0fnu)
        return t
    return edit


@pytest.mark.parametrize("change, match", [
    (lambda c: c.pop("expert_dtype"), r"experts.0.w1: stored as mxfp4, but .* allows \['fp8_block', 'plain'\]"),
    (lambda c: c.update(expert_dtype="fp6"), "FP8 expert_dtype 'fp6' is not supported"),
    (lambda c: c["quantization_config"].pop("scale_fmt"), "expert_dtype 'fp4' with scale_fmt None is not supported"),
    (lambda c: c["quantization_config"].update(scale_fmt="ue5m3"), "FP8 scale_fmt 'ue5m3' is not supported"),
    (lambda c: c["quantization_config"].update(weight_block_size=[1, 32]),
     r"weight_block_size \[1, 32\] is not supported; supported: \[128, 128\]"),
], ids=["fp4-undeclared", "expert-dtype", "fp4-float-scales", "scale-fmt", "block"])
def test_v4_config_variants_are_refused(v4, work, change, match, request):
    tag = request.node.callspec.id
    assert_refused(copy_checkpoint(v4, work / f"bad-{tag}", change), work / f"bad-{tag}.ftw", match)


@pytest.mark.parametrize("name, match", [
    ("model.layers.1.attn.wq_a.scale", r"wq_a.scale: E8M0 scale byte 255 \(NaN\)"),
    ("model.layers.2.ffn.experts.5.w2.scale", r"experts.5.w2.scale: E8M0 scale byte 255 \(NaN\)"),
])
def test_nan_scales_are_refused(v4, work, name, match):
    tag = name.split(".")[-2]
    assert_refused(_rewrite(v4, work / f"nan-{tag}", _nan_scale(name)), work / f"nan-{tag}.ftw", match)


def test_bad_fp4_scales_and_requantizing_are_refused(v4, work):
    name = "model.layers.1.ffn.experts.0.w3.scale"
    bad = _rewrite(v4, work / "fp4-grid", lambda t: {**t, name: t[name][:, :1].contiguous()} if name in t else t)
    assert_refused(bad, work / "fp4-grid.ftw", r"w3.scale: F8_E8M0 \[32, 1\]; an FP4 weight \[32, 64\] needs "
                                               r"F8_E8M0 \[32, 2\]")
    with pytest.raises(Exception, match="FP4 \\(MXFP4\\) experts are kept as they are; --quantize nvfp4"):
        compile_checkpoint(v4, work / "v4-nv.ftw", progress=False, quantize="nvfp4")
    assert not (work / "v4-nv.ftw").exists()


@pytest.mark.parametrize("quantize", [None, "nvfp4"])
def test_glm5_with_ue8m0_scales(glm5, work, quantize):
    """GLM-5 block-FP8 re-encoded with E8M0 (power-of-two) tile scales, experts included, compiles to exactly what its
    float32 dequantization compiles to (dense linears, an fp32 bank, or NVFP4 with --quantize)."""
    from ft.compiler.synth.fp4_checkpoint import pow2_ceil

    def ue8m0(t):
        out = {}
        for k, v in t.items():
            if k.endswith(".weight_scale_inv"):
                continue
            s = k[: -len("weight")] + "weight_scale_inv"
            if s not in t:
                out[k] = v
                continue
            q, sc = fp8_block.quantize(fp8_block.dequantize(v, t[s]), pow2_ceil)
            out.update({k: q, s: fp8_block.e8m0(sc)})
        return out

    def plain(t):
        return {k: (fp8_block.dequantize(v, t[k[: -len("weight")] + "weight_scale_inv"])
                    if k[: -len("weight")] + "weight_scale_inv" in t else v)
                for k, v in t.items() if not k.endswith(".weight_scale_inv")}

    tag = quantize or "plain"
    src = work / "glm5-ue8m0" if (work / "glm5-ue8m0").is_dir() else _rewrite(glm5, work / "glm5-ue8m0", ue8m0)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (src / "config.json").write_text(json.dumps(cfg))
    ref = _rewrite(src, work / f"glm5-ue8m0-plain-{tag}", plain)
    cfg.pop("quantization_config")
    (ref / "config.json").write_text(json.dumps(cfg))
    assert _tensors(src)["model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    ours = compile_checkpoint(src, work / f"glm5-ue8m0-{tag}.ftw", progress=False, dtype="fp32", quantize=quantize)
    _same_ftw(ours, compile_checkpoint(ref, work / f"glm5-ue8m0-plain-{tag}.ftw", progress=False, dtype="fp32",
                                       quantize=quantize))
    assert FtwReader(ours).quant["experts"] == (quantize or "fp32")
