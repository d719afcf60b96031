"""`ft checkpoint`: every family compiles (fp32 and NVFP4) and every FTW tensor equals its source after the documented
transform, re-derived here independently of the compiler (views and splits, not the compiler's row indices)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ft.compiler import compile_checkpoint
from ft.compiler.synth import synth
from ft.formats import FtwReader
from ft.formats.summary import summarize

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "glm4_moe")
ZERO_CENTRED = ("qwen3_next", "qwen3_5_moe")
SKIPPED = ("mtp.", "model.visual.")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


def source_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def text_cfg(d: Path) -> dict:
    hf = json.loads((d / "config.json").read_text())
    return hf.get("text_config", hf)


# ---- the documented transforms, written independently ------------------------------------------------------------
def linear(S: dict, module: str) -> dict[str, torch.Tensor]:
    """One source linear as {suffix: tensor}, per-tensor scales broadcast over the output rows."""
    w = S[f"{module}.weight"]
    rows = w.shape[0]
    if f"{module}.weight_scale_2" in S:
        return {"weight": w, "weight_scale": S[f"{module}.weight_scale"],
                "weight_scale_2": S[f"{module}.weight_scale_2"].reshape(1).repeat(rows)}
    if w.dtype == torch.float8_e4m3fn:
        return {"weight": w, "weight_scale": S[f"{module}.weight_scale"].reshape(1).repeat(rows)}
    return {"weight": w}


def rowcat(*parts: dict) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def rowmap(d: dict, fn) -> dict:
    return {k: fn(v) for k, v in d.items()}


def deinterleave_q(t: torch.Tensor, nq: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    v = t.reshape(nq, 2, hd, *t.shape[1:])  # per head: [q_h | gate_h]
    return v[:, 0].reshape(nq * hd, *t.shape[1:]), v[:, 1].reshape(nq * hd, *t.shape[1:])


def expected(d: Path, arch: str) -> tuple[dict[str, torch.Tensor], dict[str, list[dict]]]:
    """FTW tensor name -> expected tensor, and bank name -> per-expert component dicts."""
    S, c = source_tensors(d), text_cfg(d)
    p = "model.language_model." if arch == "qwen3_5_moe" else "model."
    L, H = c["num_hidden_layers"], c["hidden_size"]
    nq = c["num_attention_heads"]
    hd = c.get("head_dim") or H // nq
    zc = arch in ZERO_CENTRED
    T: dict[str, torch.Tensor] = {}
    B: dict[str, list[dict]] = {}

    def norm(name: str, src: str, centred: bool = zc) -> None:
        T[name] = S[src].float() + (1.0 if centred else 0.0)

    def put(name: str, parts: dict) -> None:
        for k, v in parts.items():
            T[f"{name}.{k}"] = v

    T["embed_tokens.weight"] = S[f"{p}embed_tokens.weight"]
    norm("norm.weight", f"{p}norm.weight")
    if "lm_head.weight" in S and not json.loads((d / "config.json").read_text()).get("tie_word_embeddings"):
        put("lm_head", linear(S, "lm_head"))
    for i in range(L):  # (glm4_moe's MTP layer `model.layers.{L}.` is not compiled)
        s, o = f"{p}layers.{i}.", f"layers.{i}."
        norm(o + "input_layernorm.weight", s + "input_layernorm.weight")
        norm(o + "post_attention_layernorm.weight", s + "post_attention_layernorm.weight")
        if f"{s}self_attn.q_proj.weight" in S:
            q, k, v = (linear(S, f"{s}self_attn.{n}_proj") for n in "qkv")
            if zc:  # gated attention: [q | k | v | gate]
                split = {key: deinterleave_q(t, nq, hd) for key, t in q.items()}
                qkv = rowcat({kk: a for kk, (a, _) in split.items()}, k, v, {kk: g for kk, (_, g) in split.items()})
            else:
                qkv = rowcat(q, k, v)
            put(o + "self_attn.qkv_proj", qkv)
            if arch in ("qwen2_moe", "glm4_moe") and f"{s}self_attn.q_proj.bias" in S:
                T[o + "self_attn.qkv_proj.bias"] = torch.cat([S[f"{s}self_attn.{n}_proj.bias"] for n in "qkv"])
            put(o + "self_attn.o_proj", linear(S, f"{s}self_attn.o_proj"))
            if arch not in ("qwen2_moe", "mixtral") and f"{s}self_attn.q_norm.weight" in S:
                norm(o + "self_attn.q_norm.weight", s + "self_attn.q_norm.weight")
                norm(o + "self_attn.k_norm.weight", s + "self_attn.k_norm.weight")
        else:
            a = s + "linear_attn."
            Hk, Hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
            dk, dv, r = c["linear_key_head_dim"], c["linear_value_head_dim"], Hv // Hk
            if arch == "qwen3_next":
                def regroup(t, sizes):
                    g = t.reshape(Hk, sum(sizes), *t.shape[1:])
                    return torch.cat([x.reshape(-1, *t.shape[1:]) for x in torch.split(g, sizes, dim=1)])
                put(o + "linear_attn.in_proj_qkvz", rowmap(linear(S, a + "in_proj_qkvz"),
                                                           lambda t: regroup(t, [dk, dk, r * dv, r * dv])))
                put(o + "linear_attn.in_proj_ba", rowmap(linear(S, a + "in_proj_ba"), lambda t: regroup(t, [r, r])))
            else:
                put(o + "linear_attn.in_proj_qkvz", rowcat(linear(S, a + "in_proj_qkv"), linear(S, a + "in_proj_z")))
                put(o + "linear_attn.in_proj_ba", rowcat(linear(S, a + "in_proj_b"), linear(S, a + "in_proj_a")))
            T[o + "linear_attn.conv1d.weight"] = S[a + "conv1d.weight"][:, 0, :]
            T[o + "linear_attn.dt_bias"] = S[a + "dt_bias"].float()
            T[o + "linear_attn.A_log"] = S[a + "A_log"].float()
            norm(o + "linear_attn.norm.weight", a + "norm.weight", centred=False)
            put(o + "linear_attn.out_proj", linear(S, a + "out_proj"))
        m = s + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        if f"{m}gate.weight" not in S:  # dense layer
            put(o + "mlp.gate_up_proj", rowcat(linear(S, m + "gate_proj"), linear(S, m + "up_proj")))
            put(o + "mlp.down_proj", linear(S, m + "down_proj"))
            continue
        T[o + "mlp.gate.weight"] = S[m + "gate.weight"]
        if f"{m}gate.e_score_correction_bias" in S:
            T[o + "mlp.e_score_correction_bias"] = S[m + "gate.e_score_correction_bias"].float()
        E = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
        g, u, dn = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        recs = []
        for e in range(E):
            if f"{m}experts.gate_up_proj" in S:
                recs.append({"gate_up": S[f"{m}experts.gate_up_proj"][e], "down": S[f"{m}experts.down_proj"][e]})
                continue
            gu = rowcat(linear(S, f"{m}experts.{e}.{g}"), linear(S, f"{m}experts.{e}.{u}"))
            down = linear(S, f"{m}experts.{e}.{dn}")
            rec = {"gate_up": gu["weight"], "down": down["weight"]}
            if "weight_scale" in gu:
                rec.update(gate_up_scale=gu["weight_scale"], gate_up_scale_2=gu["weight_scale_2"],
                           down_scale=down["weight_scale"], down_scale_2=down["weight_scale_2"])
            recs.append(rec)
        B[o + "mlp.experts"] = recs
        if f"{m}shared_expert.gate_proj.weight" in S:
            put(o + "mlp.shared_expert.gate_up_proj", rowcat(linear(S, m + "shared_expert.gate_proj"),
                                                            linear(S, m + "shared_expert.up_proj")))
            put(o + "mlp.shared_expert.down_proj", linear(S, m + "shared_expert.down_proj"))
            T[o + "mlp.shared_expert_gate.weight"] = S[m + "shared_expert_gate.weight"]
        if f"{m}shared_experts.gate_proj.weight" in S:  # glm4_moe: plural, no gate
            put(o + "mlp.shared_expert.gate_up_proj", rowcat(linear(S, m + "shared_experts.gate_proj"),
                                                            linear(S, m + "shared_experts.up_proj")))
            put(o + "mlp.shared_expert.down_proj", linear(S, m + "shared_experts.down_proj"))
    return T, B


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def source_params(d: Path) -> int:
    """Parameters of the source as `ft inspect` counts them: NVFP4 bytes hold 2, scales and skipped parts hold 0."""
    n = 0
    L = text_cfg(d)["num_hidden_layers"]
    for name, t in source_tensors(d).items():
        if name.startswith(SKIPPED + (f"model.layers.{L}.",)) or "_scale" in name:
            continue
        n += t.numel() * (2 if t.dtype == torch.uint8 else 1)
    return n


def assert_matches_source(ftw: Path, src: Path, arch: str) -> FtwReader:
    r = FtwReader(ftw)
    T, B = expected(src, arch)
    assert sorted(r.tensor_names()) == sorted(T)
    for name, want in T.items():
        assert same_bits(r.tensor(name), want), name
    assert sorted(r.bank_names()) == sorted(B)
    for name, recs in B.items():
        bank = r.bank(name)
        assert bank.num_experts == len(recs)
        assert bank.stride % 4096 == 0 and bank.offset % 4096 == 0
        assert all(c.offset % 256 == 0 for c in bank.components.values())
        assert bank.offset + bank.num_experts * bank.stride <= bank.file.stat().st_size
        for e, rec in enumerate(recs):
            record = bank.record(e)  # the whole expert is one contiguous byte range
            assert record.numel() == bank.stride
            assert sorted(rec) == sorted(bank.components)
            for comp, want in rec.items():
                c = bank.components[comp]
                assert same_bits(record[c.offset:c.offset + c.nbytes].view(want.dtype).view(want.shape), want)
                assert same_bits(bank.expert(e, comp), want), f"{name}[{e}].{comp}"
    assert summarize(r)["parameters"]["total"] == source_params(src)
    return r


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_family_compiles_to_documented_layout(work: Path, arch: str, quant: str) -> None:
    src = synth(arch, "tiny", work / f"{arch}-{quant}", dtype="fp32", quant=quant)
    ftw = compile_checkpoint(src, work / f"{arch}-{quant}.ftw", progress=False)
    r = assert_matches_source(ftw, src, arch)
    c = text_cfg(src)
    cfg = r.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (
        arch, c["num_hidden_layers"], c["hidden_size"], c["vocab_size"])
    assert cfg.norm_topk_prob is c.get("norm_topk_prob", True)  # mixtral and qwen3_5_moe always renormalise
    assert r.provenance["source"] == src.name and r.provenance["compiler"].startswith("ft ")
    assert set(r.provenance["files"]) >= {"config.json", "tokenizer.json"}
    assert (r.tokenizer["file"] == "tokenizer.json"
            and r.asset("tokenizer.json") == (src / "tokenizer.json").read_bytes())
    assert r.tokenizer["chat_template"] == "chat_template.jinja" and r.asset("chat_template.jinja")
    assert r.generation["eos_token_ids"] == list(cfg.eos_token_ids) and cfg.eos_token_ids
    if quant == "nvfp4":
        assert r.quant["experts"] == "nvfp4" and r.quant["source"]
        assert r.quant["linears"] and set(r.quant["linears"].values()) <= {"nvfp4", "fp8_row"}
        for module, scheme in r.quant["linears"].items():
            assert r.tensor(f"{module}.weight").dtype == (torch.uint8 if scheme == "nvfp4" else torch.float8_e4m3fn)
    else:
        assert r.quant == {"linears": {}, "experts": "fp32", "source": None}
    if arch in ("qwen3_next", "qwen3_5_moe"):
        assert r.metadata["skipped"].get("mtp.", 0) > 0
    if arch == "glm4_moe":
        assert r.metadata["skipped"].get(f"model.layers.{cfg.num_layers}.", 0) > 0
    if arch == "qwen3_5_moe":
        assert r.metadata["skipped"].get("model.visual.", 0) > 0


def test_dequant_equals_the_exact_twin(work: Path) -> None:
    """--dequant of NVFP4 == compiling the synthetic BF16-exact twin (dequantized weights, same plain tensors)."""
    src = synth("qwen3_5_moe", "tiny", work / "dq", dtype="bf16", quant="nvfp4")
    twin = src.with_name(src.name + "-twin")
    a = FtwReader(compile_checkpoint(src, work / "dq.ftw", dequant=True, progress=False))
    b = FtwReader(compile_checkpoint(twin, work / "dq-twin.ftw", progress=False))
    assert a.quant["linears"] == {} and a.quant["experts"] == "bf16" and a.quant["source"]
    assert sorted(a.tensor_names()) == sorted(b.tensor_names())
    for n in a.tensor_names():
        assert same_bits(a.tensor(n), b.tensor(n)), n
    for n in a.bank_names():
        ba, bb = a.bank(n), b.bank(n)
        assert ba.stride == bb.stride
        assert all(torch.equal(ba.record(e), bb.record(e)) for e in range(ba.num_experts))


def test_dtype_conversion_is_exact_where_possible(work: Path) -> None:
    src = synth("qwen3_moe", "tiny", work / "conv", dtype="bf16")
    r = FtwReader(compile_checkpoint(src, work / "conv.ftw", dtype="fp32", progress=False))
    S = source_tensors(src)
    assert r.quant["experts"] == "fp32"
    assert torch.equal(r.tensor("embed_tokens.weight"), S["model.embed_tokens.weight"].float())
    assert r.tensor("layers.0.mlp.gate.weight").dtype == torch.bfloat16  # routers keep the source dtype
    e0 = r.bank("layers.0.mlp.experts").expert(0, "down")
    assert torch.equal(e0, S["model.layers.0.mlp.experts.0.down_proj.weight"].float())
