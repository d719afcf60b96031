"""glm4_moe end to end on the CPU: transformers-written tiny checkpoints (plain and NVFP4) -> FTW -> our runtime,
against transformers' forward at fp32 (NVFP4: on the exact BF16 twin).

The tiny preset is GLM-4.5-like: q/k/v biases, q/k-norm, rotary over half of head_dim, one leading dense layer then two
MoE layers with the sigmoid router (correction bias, 2 groups of 4 experts of which the best 1 stays eligible,
routed_scaling_factor 2.5) and the ungated shared expert, plus an MTP layer the compiler skips.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ft.formats import FtwReader, ModelConfig
from ft.runtime.layers.moe import route_sigmoid
from ft.runtime.model import load_model
from ft.runtime.models import model_class

from fidelity_lib import SELF_TOL, TOL, assert_greedy_matches, greedy, prompt, reference, reference_logits, run_all

GEN = 48
@pytest.fixture(scope="module", params=["none", "nvfp4"])
def pair(request, ftw_for, hf_for, twin_for):
    quant = request.param
    ref_dir = hf_for("glm4_moe") if quant == "none" else twin_for("glm4_moe")
    return quant, load_model(ftw_for("glm4_moe", quant)), reference(ref_dir)


def test_layout_and_config(ftw_for):
    r = FtwReader(ftw_for("glm4_moe"))
    cfg = r.config
    assert cfg.mlp_types == ("dense", "moe", "moe") and cfg.rotary_dim == cfg.head_dim // 2 == 8
    assert (cfg.router_scoring, cfg.router_correction_bias, cfg.router_n_group, cfg.router_topk_group) == \
        ("sigmoid", True, 2, 1)
    assert cfg.routed_scaling_factor == 2.5 and cfg.norm_topk_prob and not cfg.shared_expert_gate
    assert cfg.attn_qkv_bias and cfg.attn_qk_norm and not cfg.attn_o_bias
    assert cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size == 32
    names = set(r.tensor_names())
    bias = r.tensor("layers.1.mlp.e_score_correction_bias")
    assert bias.dtype == torch.float32 and bias.shape == (8,) and float(bias.abs().max()) > 0
    assert "layers.1.mlp.shared_expert.gate_up_proj.weight" in names
    assert not any("shared_expert_gate" in n or n.startswith("layers.3.") for n in names)   # no gate; MTP skipped
    assert "layers.0.mlp.gate_up_proj.weight" in names and "layers.0.mlp.gate.weight" not in names
    assert r.metadata["skipped"] == {"model.layers.3.": 44}  # 4 MTP-only + 40 decoder-layer tensors


def test_prompt_logits_match_transformers(pair):
    quant, model, ref = pair
    ids = prompt(model)
    ours = run_all(model, ids)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    print(f"\nglm4_moe {quant}: max |dlogit| over {len(ids)} positions = {diff:.2e}")
    assert diff < TOL and float(theirs.std()) > 0.1


def test_48_greedy_tokens_match_transformers(pair):
    quant, model, ref = pair
    ids = prompt(model, 24, seed=1)
    ours = assert_greedy_matches(model, ref, ids, GEN, f"glm4_moe {quant}")
    assert len(set(ours)) > 3  # not a degenerate repetition
    full = torch.tensor(ids.tolist() + ours[:-1])
    diff = (run_all(model, full) - reference_logits(ref, full)).abs().max().item()
    print(f"\nglm4_moe {quant}: {GEN} greedy tokens equal; max |dlogit| over prompt + generation = {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("chunks", [[1] * 12, [5, 7]])
def test_chunked_prefill_matches_one_shot(pair, chunks):
    _, model, _ = pair
    ids = prompt(model, 12, seed=3)
    assert (run_all(model, ids, chunks) - run_all(model, ids)).abs().max() < SELF_TOL


def _direct_route(logits, bias, k, n_group, topk_group, renorm, scale):
    """Token by token, written from the definition (checkpoint-formats §1.5 router) with Python lists."""
    ids, weights = [], []
    for row in logits.tolist():
        s = [1 / (1 + torch.exp(torch.tensor(-v, dtype=torch.float64)).item()) for v in row]
        c = [a + b for a, b in zip(s, bias.tolist())]
        per = len(c) // n_group
        group = [sum(sorted(c[g * per:(g + 1) * per])[-2:]) for g in range(n_group)]
        keep = sorted(range(n_group), key=lambda g: -group[g])[:topk_group]
        eligible = [e for e in range(len(c)) if e // per in keep]
        chosen = sorted(eligible, key=lambda e: -c[e])[:k]
        w = [s[e] for e in chosen]
        total = sum(w) + 1e-20 if renorm else 1.0
        ids.append(chosen)
        weights.append([x / total * scale for x in w])
    return ids, weights


@pytest.mark.parametrize("n_group, topk_group, renorm, scale",
                         [(4, 2, True, 2.5), (1, 1, False, 1.0), (8, 3, True, 1.0)])
def test_group_limited_routing_matches_a_direct_reference(n_group, topk_group, renorm, scale):
    gen = torch.Generator().manual_seed(n_group)
    logits = torch.randn(64, 32, generator=gen) * 2
    bias = torch.randn(32, generator=gen) * 0.3
    ids, weights = route_sigmoid(logits, bias, 6, n_group, topk_group, renorm, scale)
    want_ids, want_w = _direct_route(logits, bias, 6, n_group, topk_group, renorm, scale)
    for t in range(64):
        order = sorted(range(6), key=lambda j: int(ids[t, j]))
        want = sorted(zip(want_ids[t], want_w[t]))
        assert [int(ids[t, j]) for j in order] == [e for e, _ in want]
        assert torch.allclose(weights[t, order].double(), torch.tensor([w for _, w in want], dtype=torch.float64),
                              atol=1e-6)
    if n_group > 1:  # the groups did restrict: some token's unrestricted top-6 differs
        free = (torch.sigmoid(logits) + bias).topk(6, dim=-1)[1].sort(dim=-1)[0]
        assert not torch.equal(free, ids.sort(dim=-1)[0])


def test_routing_matches_transformers_router():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        routed_scaling_factor=1.8, norm_topk_prob=True)
    router = Glm4MoeTopkRouter(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.2)
    x = torch.randn(40, 32, generator=gen)
    _, want_w, want_ids = router(x)
    ids, weights = route_sigmoid(x @ router.weight.detach().T, router.e_score_correction_bias, 4, 4, 2, True, 1.8)
    a, b = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(a[0], b[0])
    assert torch.allclose(weights.gather(1, a[1]), want_w.gather(1, b[1]), atol=1e-6)


def test_family_rules(ftw_for):
    cfg = FtwReader(ftw_for("glm4_moe")).config
    with pytest.raises(ValueError, match="router_scoring is 'softmax', glm4_moe requires 'sigmoid'"):
        model_class("glm4_moe")(dataclasses.replace(cfg, router_scoring="softmax", router_n_group=1,
                                                    router_topk_group=1, router_correction_bias=False))
    with pytest.raises(ValueError, match="shared_expert_gate is False, qwen2_moe requires True"):
        model_class("qwen2_moe")(dataclasses.replace(cfg, family="qwen2_moe"))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be > 0 for glm4_moe"):
        model_class("glm4_moe")(dataclasses.replace(cfg, shared_expert_intermediate_size=0))


def test_config_keys_are_optional_and_checked(ftw_for):
    qwen = FtwReader(ftw_for("qwen3_moe")).config
    assert not any(k.startswith(("router_", "routed_", "shared_expert_gate")) for k in qwen.to_dict())
    glm = FtwReader(ftw_for("glm4_moe")).config
    d = glm.to_dict()
    assert ModelConfig.from_dict(d) == glm and d["router_n_group"] == 2 and d["shared_expert_gate"] is False
    for change, match in [
        (dict(router_n_group=3), "num_experts 8 must split into router_n_group 3 groups of >= 2 experts"),
        (dict(router_topk_group=3), r"router groups need 1 <= router_topk_group \(3\) <= router_n_group \(2\)"),
        (dict(router_n_group=4, num_experts_per_tok=3), "num_experts_per_tok 3 exceeds the 1 eligible groups' 2"),
        (dict(router_scoring="softmax"), "router groups and the correction bias belong to the sigmoid router"),
        (dict(router_scoring="tanh"), "router_scoring 'tanh' not in"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a positive finite number"),
    ]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_dict(d | change)
    assert ModelConfig.from_dict(d | dict(router_n_group=4, router_topk_group=1, num_experts_per_tok=1))


def test_gpu_scheduler_accepts_nvfp4_experts(ftw_for):
    from ft.runtime.gpu.engine_setup import unsupported_reason

    assert unsupported_reason(FtwReader(ftw_for("glm4_moe", "nvfp4"))) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_cuda_matches_cpu(quant, ftw_for):
    """Dense weights on the GPU (the sigmoid router on its torch path), experts from the CPU bank."""
    cpu, gpu = load_model(ftw_for("glm4_moe", quant)), load_model(ftw_for("glm4_moe", quant), device="cuda")
    ids = prompt(cpu, 24, seed=2)
    assert (run_all(gpu, ids.cuda(), [13, 1, 10]).cpu() - run_all(cpu, ids)).abs().max() < TOL
    assert greedy(gpu, ids.cuda(), 16) == greedy(cpu, ids, 16)
