"""Block-scaled FP8 sources (128x128 tiles, `weight_scale_inv`): the dequantization against its formula (ragged
shapes too), the synthetic quantizer, compiling FP8 releases (equal to compiling their exact twin, also with
`--quantize nvfp4`) and the refusals of variants we do not read."""

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

from compile_lib import assert_refused, copy_checkpoint

SHAPES = [(1, 1), (64, 32), (128, 128), (129, 257), (300, 200), (256, 384), (77, 130)]


def formula(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W[i, j] = fp8[i, j] * weight_scale_inv[i // 128, j // 128], written with index arithmetic."""
    i = torch.arange(q.shape[0])[:, None] // 128
    j = torch.arange(q.shape[1])[None, :] // 128
    return q.float() * s[i, j]


def random_fp8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    gr, gc = -(-n // 128), -(-k // 128)
    return q, torch.rand(gr, gc, generator=g) * 1e-3 + 1e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_matches_the_formula(shape):
    q, s = random_fp8(*shape, seed=shape[0] * 1000 + shape[1])
    want = formula(q, s)
    assert torch.equal(fp8_block.dequantize(q, s), want)
    rows = fp8_block.rows_of(s, shape[0])  # row-wise form, as the compiler concatenates and slices it
    assert rows.shape == (shape[0], s.shape[1])
    for a in range(0, shape[0], 50):  # any row chunk dequantizes on its own
        assert torch.equal(fp8_block.dequantize_rows(q[a:a + 50], rows[a:a + 50]), want[a:a + 50])


def test_dequantize_agrees_with_transformers_ceil_path():
    """transformers' `_dequantize_fp8_weight` (its backward path) expands the grid with ceil-div like us."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    for shape in SHAPES:
        q, s = random_fp8(*shape, seed=7)
        assert torch.equal(_dequantize_fp8_weight(q, s, [128, 128], torch.float32), fp8_block.dequantize(q, s))


def test_dequantize_refuses_a_floor_grid():
    q, _ = random_fp8(200, 300, seed=1)
    with pytest.raises(ValueError, match=r"want \[2, 3\]"):
        fp8_block.dequantize(q, torch.ones(1, 2))


@pytest.mark.parametrize("shape", SHAPES)
def test_quantizer_tiles_and_error(shape):
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(*shape, generator=g) * 0.02
    w[: min(128, shape[0]), : min(128, shape[1])] = 0  # the first tile all zero
    q, s = fp8_block.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert float(s[0, 0]) == pytest.approx(1e-12 / 448) and not q[:128, :128].float().any()
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            tile = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            if tile.abs().amax() > 0:
                assert float(s[r, c]) == pytest.approx(float(tile.abs().amax()) / 448, rel=1e-6)
    deq = fp8_block.dequantize(q, s)
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    # e4m3 keeps 3 mantissa bits: half an ulp is <= 2^-4 relative; subnormals (below 2^-6) step by 2^-9
    assert ((deq - w).abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) + 1e-12).all()


MODULES = ["lm_head", "model.layers.1.mlp.gate", "model.layers.1.mlp.gate_proj", "model.layers.11.mlp.gate",
           "model.layers.1.self_attn.q_proj", "model.layers.10.mlp.experts.3.down_proj", "mtp.layers.0.fc",
           "model.language_model.layers.2.linear_attn.in_proj_a", "model.visual.blocks.0.attn.qkv"]
PATTERNS = [["lm_head"], ["model.layers.1"], ["model.layers.1.mlp.gate"], ["mlp.gate"], [r"model\.layers\.\d+\.mlp"],
            ["q_proj", "down_proj"], ["mtp", "model.visual"], ["in_proj_a"], ["layers.1"], []]


@pytest.mark.parametrize("patterns", PATTERNS, ids=[",".join(p) or "none" for p in PATTERNS])
def test_module_exclusion_is_transformers_rule(patterns):
    from transformers.quantizers.quantizers_utils import should_convert_module

    from ft.compiler.quant.modelopt import parse_quant

    decl = parse_quant({"quantization_config": dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128],
                                                    modules_to_not_convert=patterns)}, None)
    for m in MODULES:
        assert (decl.allowed(m) == {"plain"}) == (not should_convert_module(m, patterns)), (m, patterns)
        assert decl.allowed(m) in ({"plain"}, {"fp8_block", "plain"})


# ---- compiling FP8 releases -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8block")


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def src(request, work) -> Path:
    return synth(request.param, "tiny", work / request.param, quant="fp8", dtype="bf16")


def test_synth_writes_the_release_layout(src):
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "weight_block_size", "activation_scheme")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    t = {}
    for f in sorted(src.glob("*.safetensors")):
        t.update(load_file(f))
    twin = {}
    for f in sorted(src.with_name(src.name + "-twin").glob("*.safetensors")):
        twin.update(load_file(f))
    scaled = [n for n in t if n.endswith(".weight_scale_inv")]
    assert any(".experts.3.down_proj." in n for n in scaled) and any(".self_attn.o_proj." in n for n in scaled)
    assert not any(".mlp.gate." in n or n.startswith("lm_head") for n in scaled)
    assert set(twin) == set(t) - set(scaled)
    for n in scaled:
        w = n[: -len("_scale_inv")]
        assert t[w].dtype == torch.float8_e4m3fn and twin[w].dtype == torch.bfloat16
        assert torch.equal(twin[w].float(), formula(t[w], t[n]))
    if "modules_to_not_convert" in qc:  # Qwen style: routers, norms and lm_head listed
        assert "lm_head" in qc["modules_to_not_convert"] and "model.layers.1.mlp.gate" in qc["modules_to_not_convert"]


def _same_ftw(a: Path, b: Path) -> None:
    ra, rb = FtwReader(a), FtwReader(b)
    assert ra.tensor_names() == rb.tensor_names() and ra.bank_names() == rb.bank_names()
    for n in ra.tensor_names():
        assert ra.tensor(n).dtype == rb.tensor(n).dtype and torch.equal(ra.tensor(n), rb.tensor(n)), n
    for n in ra.bank_names():
        ba, bb = ra.bank(n), rb.bank(n)
        assert ba.scheme == bb.scheme
        for e in range(ba.num_experts):
            assert torch.equal(ba.record(e), bb.record(e)), f"{n} expert {e}"


@pytest.mark.parametrize("quantize", [None, "nvfp4"])
def test_compile_equals_compiling_the_twin(src, work, quantize):
    """Dense linears dequantized to the checkpoint dtype and experts in a BF16 bank (or NVFP4 with --quantize) hold
    exactly what compiling the exact twin gives."""
    tag = quantize or "plain"
    ours = compile_checkpoint(src, work / f"{src.name}-{tag}.ftw", progress=False, quantize=quantize)
    ref = compile_checkpoint(src.with_name(src.name + "-twin"), work / f"{src.name}-twin-{tag}.ftw", progress=False,
                             quantize=quantize)
    _same_ftw(ours, ref)
    r = FtwReader(ours)
    assert r.quant["experts"] == (quantize or "bf16") and r.quant["linears"] == {}
    assert r.quant["source"]["quant_method"] == "fp8"
    assert r.tensor(next(n for n in r.tensor_names() if n.endswith("o_proj.weight"))).dtype == torch.bfloat16


def test_dequant_flag_and_dtype(src, work):
    out = compile_checkpoint(src, work / f"{src.name}-fp32.ftw", progress=False, dtype="fp32")
    r = FtwReader(out)
    assert r.quant["experts"] == "fp32"
    assert r.tensor(next(n for n in r.tensor_names() if n.endswith("o_proj.weight"))).dtype == torch.float32


# ---- refusals -------------------------------------------------------------------------------------------------------

def _qc(change):
    def edit(cfg):
        change(cfg["quantization_config"])
    return edit


@pytest.mark.parametrize("change, match", [
    (lambda q: q.update(fmt="e5m2"), "FP8 fmt 'e5m2' is not supported; supported: 'e4m3'"),
    (lambda q: q.update(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\] is not supported"),
    (lambda q: q.update(weight_block_size=None), "weight_block_size None is not supported"),
    (lambda q: q.update(scale_fmt="ue8m0"), r"q_proj.weight_scale_inv: F32 \[1, 1\]; .* with scale_fmt 'ue8m0' needs "
     r"F8_E8M0 or U8 \[1, 1\]"),
    (lambda q: q.update(scale_fmt="e4m3"), "FP8 scale_fmt 'e4m3' is not supported"),
    (lambda q: q.update(expert_dtype="fp4"), "expert_dtype 'fp4' with scale_fmt None is not supported"),
    (lambda q: q.update(expert_dtype="fp4", scale_fmt="ue8m0"), r"weight_scale_inv: F32 .* needs F8_E8M0 or U8"),
    (lambda q: q.update(expert_dtype="int4"), "FP8 expert_dtype 'int4' is not supported"),
    (lambda q: q.update(modules_to_convert=["model.embed_tokens"]), "modules_to_convert"),
    (lambda q: q.update(modules_to_not_convert=["model.layers.0.self_attn"]),
     r"model.layers.0.self_attn.q_proj: stored as fp8_block, but .* allows \['plain'\]"),
    (lambda q: q.update(modules_to_not_convert=None, ignored_layers=[r"model\.layers\.\d+\.mlp\.experts"]),
     r"layers.\d.mlp.experts.0.gate_proj: stored as fp8_block, but .* allows \['plain'\]"),
    (lambda q: q.update(modules_to_not_convert=["o_proj"]),
     r"layers.0.self_attn.o_proj: stored as fp8_block, but .* allows \['plain'\]"),
    (lambda q: q.update(modules_to_not_convert=["(unclosed"]), "is not a valid regex"),
    (lambda q: q.update(quant_method="fbgemm_fp8"), "quant_method 'fbgemm_fp8' is not supported"),
], ids=["fmt", "block", "no-block", "ue8m0-f32-scales", "scale-fmt", "fp4-float-scales", "fp4-f32-scales",
         "expert-dtype", "embeddings", "prefix", "regex", "suffix", "bad-regex",
        "method"])
def test_unsupported_variants_are_refused(src, work, change, match, request):
    tag = request.node.callspec.id
    bad = copy_checkpoint(src, work / f"bad-{tag}", _qc(change))
    assert_refused(bad, work / f"bad-{tag}.ftw", match)


def _edit_tensor(src: Path, dst: Path, name: str, value: torch.Tensor) -> Path:
    copy_checkpoint(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    f = dst / index["weight_map"][name]
    t = load_file(f)
    t[name] = value
    save_file(t, f, metadata={"format": "pt"})
    return dst


def test_floor_scale_grid_is_refused(work):
    """A scale grid with floor instead of ceil division (transformers' defect) names the tensor and the grid."""
    src = synth("qwen3_moe", "tiny", work / "ragged", quant="fp8", overrides={"moe_intermediate_size": 136})
    name = "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"
    bad = _edit_tensor(src, work / "ragged-floor", name, torch.ones(1, 1))
    assert_refused(bad, work / "ragged-floor.ftw", r"gate_proj.weight_scale_inv: F32 \[1, 1\]; .* needs F32 \[2, 1\]")


def test_non_fp8_weight_with_scale_inv_is_refused(src, work):
    name = "model.layers.0.self_attn.o_proj.weight"  # [hidden 64, heads * head_dim 64] in both tiny presets
    bad = _edit_tensor(src, work / f"{src.name}-bf16w", name, torch.zeros(64, 64, dtype=torch.bfloat16))
    assert_refused(bad, work / f"{src.name}-bf16w.ftw", "o_proj.weight: dtype BF16 next to a weight_scale_inv")


# ---- fused 3-D experts (transformers' FP8 expert layout) -------------------------------------------------------------

def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """`src`'s side files with `tensors` as the only weights (one shard + index)."""
    copy_checkpoint(src, dst)
    for f in list(dst.glob("*.safetensors")):
        f.unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}))
    return dst


def _load(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("quantize", [None, "nvfp4"])
def test_fused_fp8_experts(work, quantize):
    """qwen3_5_moe with fused block-FP8 experts (gate_up [E, 2I, H] + gate_up_proj_scale_inv [E, 1, 1] ...) compiles
    to what its fused plain dequantization compiles to."""
    src = work / "q35" if (work / "q35").is_dir() else synth("qwen3_5_moe", "tiny", work / "q35", quant="fp8")
    fp8, plain = _load(src), _load(src.with_name(src.name + "-twin"))
    fused_q, fused_p = dict(fp8), dict(plain)
    pat = "model.language_model.layers.{i}.mlp.experts."
    for i in range(4):
        p = pat.format(i=i)
        for d in (fused_q, fused_p):
            for n in [n for n in d if n.startswith(p)]:
                del d[n]
        E = 8
        gate_up = torch.stack([torch.cat([plain[f"{p}{e}.gate_proj.weight"], plain[f"{p}{e}.up_proj.weight"]])
                               for e in range(E)])
        down = torch.stack([plain[f"{p}{e}.down_proj.weight"] for e in range(E)])
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            qs = [fp8_block.quantize(w[e]) for e in range(E)]
            fused_q[p + name] = torch.stack([q for q, _ in qs])
            fused_q[p + name + "_scale_inv"] = torch.stack([s for _, s in qs])
            fused_p[p + name] = torch.stack([fp8_block.dequantize(q, s) for q, s in qs])
    tag = quantize or "plain"
    a = _rewrite(src, work / f"q35-fused-fp8-{tag}", fused_q)
    b = _rewrite(src.with_name(src.name + "-twin"), work / f"q35-fused-plain-{tag}", fused_p)
    out_a = compile_checkpoint(a, work / f"q35-fused-fp8-{tag}.ftw", progress=False, quantize=quantize)
    out_b = compile_checkpoint(b, work / f"q35-fused-plain-{tag}.ftw", progress=False, quantize=quantize)
    _same_ftw(out_a, out_b)
    assert FtwReader(out_a).quant["experts"] == (quantize or "fp32")
    bad = dict(fused_q)
    bad[pat.format(i=0) + "down_proj_scale_inv"] = torch.ones(8, 2, 2)
    assert_refused(_rewrite(src, work / f"q35-fused-bad-{tag}", bad), work / f"q35-fused-bad-{tag}.ftw",
                   r"down_proj_scale_inv: F32 \[8, 2, 2\]; 128x128 block-FP8 experts \[8, 64, 32\] need F32 "
                   r"\[8, 1, 1\]")
