"""`ft synth` tiny presets: every architecture x quant has exactly the tensors of the real release (names, shapes by
formula from the config, dtypes; table written here from the checkpoint-formats reference, not from the generator),
loads into transformers and runs; the NVFP4 twin is the exact dequantization; configs look like the real ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ft.compiler.synth import synth

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "glm4_moe")
LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Lazily generated tiny checkpoints, shared by the tests of this module: (arch, quant, layout) -> dir."""
    root = tmp_path_factory.mktemp("synth")
    cache: dict = {}

    def get(arch: str, quant: str = "none", layout: str = "auto") -> Path:
        key = (arch, quant, layout)
        if key not in cache:
            cache[key] = synth(arch, "tiny", root / f"{arch}-{quant}-{layout}", quant=quant, expert_layout=layout)
        return cache[key]
    return get


def headers(d: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def expected_shapes(arch: str, cfg: dict, fused: bool) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the real release, from the config (reference §1.1-1.8), vision tower excluded."""
    t = cfg.get("text_config", cfg)
    H, L, V = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    hd = t.get("head_dim") or H // nq
    E = t.get("num_experts") or t.get("num_local_experts") or t["n_routed_experts"]
    I = t["intermediate_size"] if arch == "mixtral" else t["moe_intermediate_size"]
    Is = t.get("shared_expert_intermediate_size", 0) or I * t.get("n_shared_experts", 0)  # glm4_moe: shared_experts
    P = "model.language_model." if arch == "qwen3_5_moe" else "model."
    out = {P + "embed_tokens.weight": (V, H), P + "norm.weight": (H,), "lm_head.weight": (V, H)}
    if arch == "qwen3_next":
        kinds = ["full_attention" if (i + 1) % t["full_attention_interval"] == 0 else "linear_attention"
                 for i in range(L)]
    else:
        kinds = t.get("layer_types") or ["full_attention"] * L

    def attention(p: str) -> None:
        gated = arch in ("qwen3_next", "qwen3_5_moe")
        out.update({p + "self_attn.q_proj.weight": (nq * hd * (2 if gated else 1), H),
                    p + "self_attn.k_proj.weight": (nkv * hd, H), p + "self_attn.v_proj.weight": (nkv * hd, H),
                    p + "self_attn.o_proj.weight": (H, nq * hd)})
        if arch not in ("qwen2_moe", "mixtral", "glm4_moe") or t.get("use_qk_norm"):
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if arch == "qwen2_moe" or t.get("attention_bias"):
            out.update({p + "self_attn.q_proj.bias": (nq * hd,), p + "self_attn.k_proj.bias": (nkv * hd,),
                        p + "self_attn.v_proj.bias": (nkv * hd,)})

    def deltanet(p: str) -> None:
        hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        dk, dv, K = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
        a = p + "linear_attn."
        out.update({a + "conv1d.weight": (2 * hk * dk + hv * dv, 1, K), a + "dt_bias": (hv,), a + "A_log": (hv,),
                    a + "norm.weight": (dv,), a + "out_proj.weight": (H, hv * dv)})
        if arch == "qwen3_next":
            out.update({a + "in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, H),
                        a + "in_proj_ba.weight": (2 * hv, H)})
        else:
            out.update({a + "in_proj_qkv.weight": (2 * hk * dk + hv * dv, H), a + "in_proj_z.weight": (hv * dv, H),
                        a + "in_proj_b.weight": (hv, H), a + "in_proj_a.weight": (hv, H)})

    def moe(p: str) -> None:
        if arch == "mixtral":
            out[p + "block_sparse_moe.gate.weight"] = (E, H)
            for e in range(E):
                x = f"{p}block_sparse_moe.experts.{e}."
                out.update({x + "w1.weight": (I, H), x + "w3.weight": (I, H), x + "w2.weight": (H, I)})
            return
        out[p + "mlp.gate.weight"] = (E, H)
        if arch == "glm4_moe":
            out[p + "mlp.gate.e_score_correction_bias"] = (E,)
        if fused:
            out.update({p + "mlp.experts.gate_up_proj": (E, 2 * I, H), p + "mlp.experts.down_proj": (E, H, I)})
        else:
            for e in range(E):
                x = f"{p}mlp.experts.{e}."
                out.update({x + "gate_proj.weight": (I, H), x + "up_proj.weight": (I, H),
                            x + "down_proj.weight": (H, I)})
        if Is and arch == "glm4_moe":  # plural, no gate
            s = p + "mlp.shared_experts."
            out.update({s + "gate_proj.weight": (Is, H), s + "up_proj.weight": (Is, H),
                        s + "down_proj.weight": (H, Is)})
        elif Is:
            s = p + "mlp.shared_expert."
            out.update({s + "gate_proj.weight": (Is, H), s + "up_proj.weight": (Is, H), s + "down_proj.weight": (H, Is),
                        p + "mlp.shared_expert_gate.weight": (1, H)})

    def layer(p: str, kind: str, dense: bool = False) -> None:
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
        attention(p) if kind == "full_attention" else deltanet(p)
        if dense:  # glm4_moe's first_k_dense_replace layers
            Id = t["intermediate_size"]
            out.update({p + "mlp.gate_proj.weight": (Id, H), p + "mlp.up_proj.weight": (Id, H),
                        p + "mlp.down_proj.weight": (H, Id)})
        else:
            moe(p)

    for i, kind in enumerate(kinds):
        layer(f"{P}layers.{i}.", kind, dense=i < t.get("first_k_dense_replace", 0))
    if arch == "glm4_moe":  # the MTP layer after the decoder
        x = f"model.layers.{L}."
        out.update({x + "eh_proj.weight": (H, 2 * H), x + "enorm.weight": (H,), x + "hnorm.weight": (H,),
                    x + "shared_head.norm.weight": (H,)})
        layer(x, "full_attention")
    if arch in ("qwen3_next", "qwen3_5_moe"):
        out.update({"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
                    "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)})
        layer("mtp.layers.0.", "full_attention")
    return out


# ModelOpt precision per linear, written from the release descriptions (reference §2.1-2.3)
FP8_35 = re.compile(r"^model\.language_model\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|"
                    r"self_attn\.[qkvo]_proj)\.weight$")
FP4_35 = re.compile(r"^(lm_head|model\.language_model\.layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\."
                    r"(gate|up|down)_proj)\.weight$")
FP4_OTHER = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj|"
                       r"mlp\.shared_experts?\.(gate|up|down)_proj|mlp\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123]|"
                       r"linear_attn\.(in_proj_qkvz|out_proj))\.weight$")


def precision(arch: str, name: str) -> str | None:
    if arch == "qwen3_5_moe":
        return "fp8" if FP8_35.match(name) else "nvfp4" if FP4_35.match(name) else None
    return "nvfp4" if FP4_OTHER.match(name) else None


def expected_table(arch: str, cfg: dict, quant: str, fused: bool, dtype: str) -> dict[str, tuple[str, tuple]]:
    out = {}
    for name, shape in expected_shapes(arch, cfg, fused).items():
        kind = precision(arch, name) if quant == "nvfp4" else None
        mod = name[: -len(".weight")]
        if kind is None:
            out[name] = (dtype, shape)
        elif kind == "nvfp4":
            out.update({name: ("U8", (shape[0], shape[1] // 2)),
                        mod + ".weight_scale": ("F8_E4M3", (shape[0], shape[1] // 16)),
                        mod + ".weight_scale_2": ("F32", ()), mod + ".input_scale": ("F32", ())})
        else:
            out.update({name: ("F8_E4M3", shape), mod + ".weight_scale": ("F32", ()),
                        mod + ".input_scale": ("F32", ())})
    return out


CASES = [(a, q) for a in ARCHS for q in ("none", "nvfp4")]


@pytest.mark.parametrize("arch,quant", CASES)
def test_tensor_table_matches_real_release(made, arch, quant):
    d = made(arch, quant)
    cfg = json.loads((d / "config.json").read_text())
    fused = arch == "qwen3_5_moe" and quant == "none"  # auto layout: official BF16 fused, NVFP4 per expert
    got = headers(d)
    visual = {k for k in got if k.startswith("model.visual.")}
    assert bool(visual) == (arch == "qwen3_5_moe")
    want = expected_table(arch, cfg, quant, fused, "F32")
    body = {k: v for k, v in got.items() if k not in visual}
    assert sorted(set(want) - set(body)) == [] and sorted(set(body) - set(want)) == []
    assert body == want
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got) and len(set(index["weight_map"].values())) >= 2
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in index["weight_map"].values())
    if quant == "nvfp4":
        twin = headers(d.with_name(d.name + "-twin"))
        assert twin == {k: v for k, v in expected_table(arch, cfg, "none", False, "F32").items()} | {
            k: got[k] for k in visual}


def ref_nvfp4(w: torch.Tensor, s: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(LUT)
    codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).long()
    block = (s.float() * s2).repeat_interleave(16, dim=1)
    return lut[codes] * block


@pytest.mark.parametrize("arch", ARCHS)
def test_nvfp4_checkpoint_and_exact_twin(made, arch):
    d = made(arch, "nvfp4")
    q, twin = tensors(d), tensors(d.with_name(d.name + "-twin"))
    num_quant = 0
    for name, t in twin.items():
        kind = precision(arch, name)
        mod = name[: -len(".weight")]
        if kind is None:
            assert torch.equal(q[name], t), name  # untouched tensors are identical in both
            continue
        num_quant += 1
        if kind == "nvfp4":
            ref = ref_nvfp4(q[name], q[mod + ".weight_scale"], q[mod + ".weight_scale_2"])
        else:
            ref = q[name].float() * q[mod + ".weight_scale"]
        assert torch.equal(t.float(), ref), name
        assert float(q[mod + ".input_scale"]) > 0
    assert num_quant > 0
    gate_globals = set()
    for n in q:  # ModelOpt syncs the globals of gate/up pairs; they differ between experts
        m = re.fullmatch(r"(.+\.experts\.\d+)\.(gate_proj|w1)\.weight_scale_2", n)
        if m:
            up = m.group(1) + (".up_proj" if m.group(2) == "gate_proj" else ".w3") + ".weight_scale_2"
            assert torch.equal(q[n], q[up])
            gate_globals.add(float(q[n]))
    assert len(gate_globals) > 1
    cfg = json.loads((d / "config.json").read_text())
    legacy = json.loads((d / "hf_quant_config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and legacy["producer"]["name"] == "modelopt"
    if arch == "qwen3_5_moe":
        assert qc["quant_algo"] == legacy["quantization"]["quant_algo"] == "MIXED_PRECISION"
        layers = qc["quantized_layers"]
        assert layers["lm_head"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
        assert layers["model.language_model.layers.0.mlp.experts"]["quant_algo"] == "W4A16_NVFP4"
        assert layers["model.language_model.layers.3.self_attn.q_proj"] == {"quant_algo": "FP8"}
        assert layers["model.language_model.layers.0.linear_attn.in_proj_z"] == {"quant_algo": "FP8"}
        assert not any("in_proj_a" in k or "in_proj_b" in k or k.endswith("mlp.gate") for k in layers)
        assert qc["ignore"] == ["mtp.layers.0*", "mtp*"]
    else:
        assert qc["quant_algo"] == legacy["quantization"]["quant_algo"] == "NVFP4"
        assert legacy["quantization"]["group_size"] == 16 and "lm_head" in legacy["quantization"]["exclude_modules"]
        router = "block_sparse_moe.gate" if arch == "mixtral" else "mlp.gate"
        assert f"model.layers.{cfg.get('first_k_dense_replace', 0)}.{router}" in qc["ignore"]  # first MoE layer
    assert "quantization_config" not in json.loads((d.with_name(d.name + "-twin") / "config.json").read_text())


@pytest.mark.parametrize("arch,quant", CASES)
def test_transformers_loads_and_runs(made, arch, quant):
    from ft.compiler.synth.hf_small import load_reference

    d = made(arch, quant)
    ref = d.with_name(d.name + "-twin") if quant == "nvfp4" else d
    model = load_reference(ref, arch)
    cfg = json.loads((d / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 12, vocab) and bool(torch.isfinite(logits).all())
    assert float(logits.std()) > 0.5  # lm_head gives non-trivial logits


def test_qwen3_5_layouts_load_with_identical_logits(made):
    from ft.compiler.synth.hf_small import load_reference

    fused, per_expert = made("qwen3_5_moe"), made("qwen3_5_moe", layout="per_expert")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in headers(fused)
    assert "model.language_model.layers.0.mlp.experts.7.up_proj.weight" in headers(per_expert)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        a = load_reference(fused, "qwen3_5_moe")(input_ids=ids).logits
        b = load_reference(per_expert, "qwen3_5_moe")(input_ids=ids).logits
    assert torch.equal(a, b)


def test_configs_look_like_real_releases(made):
    c = json.loads((made("qwen3_moe") / "config.json").read_text())
    assert "num_experts" in c and "num_local_experts" not in c and "rope_parameters" not in c
    assert c["rope_theta"] == 1e6 and c["torch_dtype"] == "float32" and c["architectures"] == ["Qwen3MoeForCausalLM"]
    m = json.loads((made("mixtral") / "config.json").read_text())
    assert m["num_local_experts"] == 8 and "rope_theta" in m and m["model_type"] == "mixtral"
    n = json.loads((made("qwen3_next") / "config.json").read_text())
    assert n["full_attention_interval"] == 4 and "layer_types" not in n and n["partial_rotary_factor"] == 0.25
    q = json.loads((made("qwen3_5_moe") / "config.json").read_text())
    t = q["text_config"]
    assert q["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and q["dtype"] == "float32"
    assert t["full_attention_interval"] == 4 and t["layer_types"][3] == "full_attention"
    assert t["rope_parameters"]["mrope_section"] == [2, 1, 1] and t["rope_parameters"]["mrope_interleaved"]
    assert t["mtp_num_hidden_layers"] == 1 and t["attn_output_gate"] and t["tie_word_embeddings"] is False
    tok = json.loads((made("qwen3_5_moe") / "tokenizer.json").read_text())
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert q["image_token_id"] == ids["<|image_pad|>"] and t["eos_token_id"] == ids["<|endoftext|>"]
    assert t["vocab_size"] == max(ids.values()) + 1  # tiny: truncated tokenizer, vocab = tokenizer size
    gen = json.loads((made("qwen3_moe") / "generation_config.json").read_text())
    qt = json.loads((made("qwen3_moe") / "tokenizer.json").read_text())
    qids = {a["content"]: a["id"] for a in qt["added_tokens"]}
    assert gen["eos_token_id"] == [qids["<|im_end|>"], qids["<|endoftext|>"]]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (made("qwen3_moe") / f).is_file()


# Block-FP8 releases quantize every decoder Linear (MTP heads included) but routers, gates and in_proj_a/b/ba
FP8_BLOCK = re.compile(r"^(model\.(language_model\.)?layers\.\d+|mtp\.layers\.\d+)\.(self_attn\.[qkvo]_proj|"
                       r"mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_experts?\.(gate|up|down)_proj|"
                       r"mlp\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123]|"
                       r"linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj))\.weight$")


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_block_table_and_config(made, arch):
    from ft.compiler.synth import tensor_table

    d = made(arch, "fp8")
    cfg = json.loads((d / "config.json").read_text())
    got = headers(d)
    want = {}
    for name, shape in expected_shapes(arch, cfg, False).items():
        if FP8_BLOCK.match(name):
            want.update({name: ("F8_E4M3", shape), name[: -len("weight")] + "weight_scale_inv":
                         ("F32", (-(-shape[0] // 128), -(-shape[1] // 128)))})
        else:
            want[name] = ("F32", shape)
    assert {k: v for k, v in got.items() if not k.startswith("model.visual.")} == want
    assert {t.name: (t.shape, t.dtype) for t in tensor_table(arch, "tiny", quant="fp8")} == \
        {k: (s, {"F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}[dt]) for k, (dt, s) in got.items()}
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
    if arch == "glm4_moe":
        assert "modules_to_not_convert" not in qc
    else:
        first_moe = "model.language_model.layers.0.mlp.gate" if arch == "qwen3_5_moe" else \
            f"model.layers.0.{'block_sparse_moe' if arch == 'mixtral' else 'mlp'}.gate"
        assert "lm_head" in qc["modules_to_not_convert"] and first_moe in qc["modules_to_not_convert"]
    twin = d.with_name(d.name + "-twin")
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    assert set(headers(twin)) == {k for k in got if not k.endswith("_scale_inv")}
