"""The one-launch decode router (`ft.runtime.gpu.kernels.router.router_topk`) against its PyTorch reference, and
`SparseMoe` with `_fused` on against the reference path. Without CUDA the kernel runs under Triton's interpreter
(conftest.py sets TRITON_INTERPRET) on CPU tensors; sizes are tiny.

Inputs are multiples of 1/16 with |v| <= 1, so every dot over H (<= 2048) is a multiple of 1/256 below 2^11, exact
in fp32 whatever the summation order: the rounded logits, and so extra_logit, must equal the reference bit for bit in
every dtype. In bf16 a logit in [1, 2) that is an odd multiple of 1/256 sits exactly halfway between two bf16 values,
which checks round-to-nearest-even (truncation fails these tests). Exact ties between rounded logits do occur; the
expected ids are then those of a stable descending sort (ties by ascending id)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels import fused_ops as fo  # noqa: E402
from ft.runtime.gpu.kernels import router  # noqa: E402
from ft.runtime.layers.linear import Linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sixteenths(*shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, shape, generator=g) / 16).to(dtype).to(DEV)


def _check(x, weight, k, renorm, extra=None, rtol=2e-6, tiles=None):
    ids, w, xl = router.router_topk(x, weight, k, renorm, extra, tiles=tiles)
    ids_ref, w_ref, xl_ref = router.router_topk_ref(x, weight, k, renorm, extra)
    T = x.shape[0]
    assert ids.shape == w.shape == (T, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    probs = torch.softmax(torch.nn.functional.linear(x, weight), -1, dtype=torch.float32)
    want_ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]     # ties: lowest id first
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=rtol, atol=1e-7)
    if extra is None:
        assert xl is None
    else:
        assert xl.shape == (T, 1) and xl.dtype == x.dtype
        assert torch.equal(xl.cpu(), xl_ref.cpu())
    return ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,H", [(1, 8, 32), (3, 60, 96), (16, 64, 32), (3, 64, 96)])
def test_router_topk(dtype, T, E, H):
    x = _sixteenths(T, H, seed=T * E + H, dtype=dtype)
    weight = _sixteenths(E, H, seed=E, dtype=dtype)
    extra = _sixteenths(1, H, seed=H, dtype=dtype)
    for i, k in enumerate((1, 2, 4)):
        for renorm in (False, True):
            _, w = _check(x, weight, k, renorm, extra if (i + renorm) % 2 else None)
            if renorm:
                torch.testing.assert_close(w.sum(-1).cpu(), torch.ones(T), rtol=1e-6, atol=0)


def test_router_topk_random_fp32():
    # general values: sums differ from cuBLAS / torch by summation order only
    g = torch.Generator().manual_seed(1)
    x, weight, extra = (torch.randn(*s, generator=g).to(DEV) for s in ((5, 96), (60, 96), (1, 96)))
    ids, w, xl = router.router_topk(x, weight, 4, True, extra)
    ids_ref, w_ref, xl_ref = router.router_topk_ref(x, weight, 4, True, extra)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xl.cpu(), xl_ref.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_topk_adds_the_routers_bias_before_rounding(dtype):
    # gpt-oss: logits = F.linear(x, weight, bias), one rounding of the fp32 dot plus the bias; sixteenths keep the
    # dot exact, and a bias in 1/512 steps lands sums between bf16 values, where a second rounding would show
    x, weight = _sixteenths(3, 96, seed=12, dtype=dtype), _sixteenths(32, 96, seed=13, dtype=dtype)
    bias = ((torch.arange(32) % 9 - 4) / 512 + 1).to(dtype).to(DEV)
    ids, w, _ = router.router_topk(x, weight, 4, True, bias=bias)
    logits = torch.nn.functional.linear(x, weight, bias)
    probs = torch.softmax(logits.float(), -1)
    assert torch.equal(ids.cpu(), torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :4].cpu())
    torch.testing.assert_close(w.cpu(), router.router_topk_ref(x, weight, 4, True, bias=bias)[1].cpu(),
                               rtol=2e-6, atol=1e-7)


def test_router_topk_ties_and_repeat_calls():
    # x = e_0: logits are weight[:, 0]; experts 1, 4, 6 tie first and 2, 5 fourth -> ids by ascending id
    x = torch.zeros(2, 32, device=DEV)
    x[:, 0] = 1.0
    weight = torch.zeros(8, 32, device=DEV)
    weight[:, 0] = torch.tensor([0.0, 2.0, 1.0, -1.0, 2.0, 1.0, 2.0, 0.5])
    for _ in range(2):  # the second call finds the counter zeroed again
        ids, _ = _check(x, weight, 4, True)
        assert ids.cpu().tolist() == [[1, 4, 6, 2]] * 2
        assert not router._counter(x.device).any()
    x2, w2 = _sixteenths(3, 96, seed=5, dtype=torch.bfloat16), _sixteenths(60, 96, seed=6, dtype=torch.bfloat16)
    _check(x2, w2, 2, False, _sixteenths(1, 96, seed=7, dtype=torch.bfloat16))   # other shapes, same counter


def test_router_topk_tiles_and_bounds():
    x, weight = _sixteenths(4, 96, seed=8, dtype=torch.float32), _sixteenths(60, 96, seed=9, dtype=torch.float32)
    extra = _sixteenths(1, 96, seed=10, dtype=torch.float32)
    # many programs and K steps; the last program padded past row E
    for tiles in ({"BLOCK_E": 2, "BLOCK_K": 16, "num_warps": 2}, {"BLOCK_E": 8, "BLOCK_K": 64}):
        _check(x, weight, 3, True, extra, tiles=tiles)
    with pytest.raises(ValueError, match="unknown router tile keys"):
        router.router_topk(x, weight, 3, True, tiles={"BLOCK_T": 4})
    big = _sixteenths(router.MAX_TOKENS + 1, 96, seed=11, dtype=torch.float32)  # prefill size: the reference
    got, want = router.router_topk(big, weight, 3, False), router.router_topk_ref(big, weight, 3, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- the layer: SparseMoe with _fused on (router_topk at T <= MAX_TOKENS) against the reference path -------------
def _moe_config(family: str, E: int, k: int, shared_I: int, **fields):
    """A one-layer MoE config of hidden size 32 and expert width 16 (`fields` over the defaults)."""
    from ft.formats.config import ModelConfig

    return ModelConfig(
        family=family, vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, rotary_dim=16, max_position_embeddings=64,
        layer_types=("full_attention",), mlp_types=("moe",), attn_qkv_bias=False, attn_qk_norm=True,
        attn_output_gate=False, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=16, norm_topk_prob=True,
        shared_expert_intermediate_size=shared_I, intermediate_size=0, linear_num_key_heads=0,
        linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0, linear_conv_kernel_dim=0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(1,), **fields)


def _count_routing_calls(monkeypatch) -> dict:
    """Counts the calls of router.router_topk and fused_ops.route_topk from here on."""
    calls = {"router_topk": 0, "route_topk": 0}
    for mod, name in ((router, "router_topk"), (fo, "route_topk")):
        def counted(*a, _fn=getattr(mod, name), _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(mod, name, counted)
    return calls


def _moe(dtype, shared: bool):
    from ft.runtime.layers.moe import BoundExperts, SparseMoe

    E, H, I = 12, 32, 16
    moe = SparseMoe(_moe_config("qwen3_5_moe", E, 3, I if shared else 0))
    moe.gate.weight = _sixteenths(E, H, seed=20, dtype=dtype)
    scale = torch.arange(1, E + 1, dtype=dtype, device=DEV) / E

    def experts(layer, x, ids, weights):   # expert e scales x by (e + 1) / E: y = sum_j w_j scale[ids_j] x
        return ((weights * scale[ids].float()).sum(-1, keepdim=True) * x.float()).to(x.dtype)

    moe.experts = BoundExperts(experts, 0)
    if shared:
        moe.shared_expert.gate_up_proj.weight = _sixteenths(2 * I, H, seed=21, dtype=dtype)
        moe.shared_expert.down_proj.weight = _sixteenths(H, I, seed=22, dtype=dtype)
        moe.shared_expert_gate.weight = _sixteenths(1, H, seed=23, dtype=dtype)
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared,biased", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("T", [1, 5, router.MAX_TOKENS + 2])
def test_sparse_moe_fused_matches_reference(monkeypatch, dtype, shared, biased, T):
    moe = _moe(dtype, shared)
    if biased:  # gpt-oss's router bias rides along in the one decode launch
        moe.gate.bias = ((torch.arange(12) % 5 - 2) / 64).to(dtype).to(DEV)
    x = _sixteenths(T, 32, seed=T, dtype=dtype)
    moe._fused = False
    ref = moe(x)
    calls = _count_routing_calls(monkeypatch)
    calls["gate_linear"] = 0
    if shared:
        sg, linear_call = moe.shared_expert_gate, Linear.__call__

        def gate_call(self, x):
            calls["gate_linear"] += self is sg
            return linear_call(self, x)
        monkeypatch.setattr(Linear, "__call__", gate_call)
    moe._fused = True
    got = moe(x)
    decode = T <= router.MAX_TOKENS
    assert (calls["router_topk"], calls["route_topk"]) == ((1, 0) if decode else (0, 1))
    assert calls["gate_linear"] == (shared and not decode)   # the shared gate's GEMV rides along in router_topk
    if dtype == torch.float32 or not shared:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # sigmoid_gate_add may round its product one bf16 ulp away from torch (large relative where y cancels it)
        assert (got.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8])
def test_router_topk_cuda_model_shape(T):
    # E = 256, H = 2048, bf16, top-8 with renorm and the shared gate: the decode shape of the target models
    x, weight = _sixteenths(T, 2048, seed=T, dtype=torch.bfloat16), _sixteenths(256, 2048, seed=2, dtype=torch.bfloat16)
    extra = _sixteenths(1, 2048, seed=3, dtype=torch.bfloat16)
    for _ in range(2):  # exact sums: equal to the reference but for the last ulp of exp
        _check(x, weight, 8, True, extra, rtol=1e-5)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 2048, generator=g, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(256, 2048, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    extra = (torch.randn(1, 2048, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    ids, w, xl = router.router_topk(x, weight, 8, True, extra)
    ids_ref, w_ref, xl_ref = router.router_topk_ref(x, weight, 8, True, extra)
    # general values: cuBLAS sums in another order, so a logit may round one bf16 ulp apart (rarely), which moves
    # every weight a little and may swap near-equal ids (bf16 logits also tie exactly at times)
    assert (ids == ids_ref).float().mean() >= 0.9
    assert (w - w_ref).abs().max() <= 2e-2 * w_ref.max()
    assert ((xl.float() - xl_ref.float()).abs() <= xl_ref.float().abs() * 2 ** -7 + 1e-6).all()
    assert not router._counter(x.device).any()


# ---- the sigmoid router (glm4_moe, glm_moe_dsa): selection kernel and decode router against route_sigmoid ---------
def _sigmoid_expected(logits, bias, k, n_group, topk_group, renorm, scale):
    """ids in descending c = sigmoid + bias within the kept groups (ties: lowest id / lowest group), weights as
    route_sigmoid: the reference with a defined order."""
    s = logits.float().sigmoid()
    c = s + (bias if bias is not None else 0)
    T, E = c.shape
    if n_group > 1:
        top2 = torch.sort(c.view(T, n_group, -1), dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        groups = torch.sort(top2, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=c.device).scatter_(1, groups, True)
        c = c.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = torch.sort(c, dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(1, ids)
    if renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


def _by_id(ids, w):
    order = ids.argsort(-1)
    return ids.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize("E,k,n_group,topk_group", [(8, 2, 1, 1), (60, 4, 1, 1), (64, 8, 8, 4), (48, 6, 4, 2)])
@pytest.mark.parametrize("renorm,scale", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_topk_sigmoid(E, k, n_group, topk_group, renorm, scale, with_bias):
    from ft.runtime.gpu.kernels.sigmoid_topk import SigmoidRoute
    from ft.runtime.layers.moe import route_sigmoid

    g = torch.Generator().manual_seed(E + k + n_group)
    logits = (torch.randn(5, E, generator=g) * 2).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.5).to(DEV) if with_bias else None
    how = SigmoidRoute(bias, n_group, topk_group, scale)
    ids, w = fo.route_topk(logits, k, renorm, how)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (5, k)
    want_ids, want_w = _sigmoid_expected(logits, bias, k, n_group, topk_group, renorm, scale)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(w.cpu(), want_w.cpu(), rtol=2e-6, atol=1e-7)
    ref_ids, ref_w = _by_id(*route_sigmoid(logits, bias, k, n_group, topk_group, renorm, scale))  # the layer's ops
    got_ids, got_w = _by_id(ids, w)
    assert torch.equal(got_ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(got_w.cpu(), ref_w.cpu(), rtol=2e-6, atol=1e-7)


def test_route_topk_sigmoid_ties_and_groups():
    from ft.runtime.gpu.kernels.sigmoid_topk import SigmoidRoute

    # 4 groups of 4: group sums (top-2) 1.6 | 1.6 | 1.7 | 1.0 -> groups 2 and 0 (the tie with group 1 goes to the
    # lower group); within them experts 8, 9 tie and 0 follows; the bias chooses but never weighs
    c = torch.tensor([[0.8, 0.8, 0.1, 0.1, 0.8, 0.8, 0.0, 0.0, 0.9, 0.9, 0.8, 0.0, 0.5, 0.5, 0.0, 0.0]])
    bias = torch.full((16,), 0.05)
    s = (c - 0.05).clamp(1e-3, 1 - 1e-3)
    logits = torch.log(s / (1 - s))                                                        # sigmoid(logits) = s
    ids, w = fo.route_topk(logits.to(DEV), 3, False, SigmoidRoute(bias.to(DEV), 4, 2, 1.0))
    assert ids.cpu().tolist() == [[8, 9, 0]]
    torch.testing.assert_close(w.cpu(), s[:, [8, 9, 0]], rtol=1e-5, atol=0)
    # groups the kernels cannot take (E not split evenly; fewer eligible experts than k) go to the reference
    assert not SigmoidRoute(None, 3, 1, 1.0).supported(16, 2)
    assert not SigmoidRoute(None, 4, 1, 1.0).supported(16, 5)
    ids, _ = fo.route_topk(logits.to(DEV), 5, True, SigmoidRoute(None, 4, 1, 1.0))   # the reference's choice
    assert ids.shape == (1, 5) and set(ids[0, :4].tolist()) == {8, 9, 10, 11}


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,E,H,n_group,topk_group", [(1, 16, 32, 1, 1), (3, 64, 96, 8, 4), (16, 60, 32, 1, 1)])
def test_router_topk_sigmoid(wdtype, T, E, H, n_group, topk_group):
    from ft.runtime.gpu.kernels.sigmoid_topk import SigmoidRoute

    x = _sixteenths(T, H, seed=T + H, dtype=torch.bfloat16)
    weight = _sixteenths(E, H, seed=E, dtype=wdtype)                    # logits exact in fp32: any summation order
    bias = (torch.arange(E, dtype=torch.float32) % 7 / 64).to(DEV)
    for k, renorm, scale in ((4, True, 2.5), (2, False, 1.0)):
        how = SigmoidRoute(bias, n_group, topk_group, scale)
        ids, w, extra = router.router_topk(x, weight, k, renorm, sigmoid=how)
        assert extra is None
        logits = torch.nn.functional.linear(x.float(), weight.float())
        want_ids, want_w = _sigmoid_expected(logits, bias, k, n_group, topk_group, renorm, scale)
        assert torch.equal(ids.cpu(), want_ids.cpu())
        torch.testing.assert_close(w.cpu(), want_w.cpu(), rtol=2e-6, atol=1e-7)
    assert not router._counter(x.device).any()
    with pytest.raises(AssertionError, match="no shared expert gate"):
        router.router_topk(x, weight, 2, True, extra=x[:1].contiguous(), sigmoid=SigmoidRoute(None, 1, 1, 1.0))


@pytest.mark.parametrize("T", [1, 5, router.MAX_TOKENS + 2])
def test_sparse_moe_sigmoid_fused_matches_reference(monkeypatch, T):
    from ft.runtime.layers.moe import BoundExperts, SparseMoe

    E, H = 16, 32
    cfg = _moe_config("glm4_moe", E, 4, 16, router_scoring="sigmoid", router_correction_bias=True, router_n_group=4,
                      router_topk_group=2, routed_scaling_factor=2.5, shared_expert_gate=False)
    moe = SparseMoe(cfg)  # with an ungated shared expert, added by one fused launch
    moe.gate.weight = _sixteenths(E, H, seed=30, dtype=torch.bfloat16)
    moe.shared_expert.gate_up_proj.weight = _sixteenths(32, H, seed=31, dtype=torch.bfloat16)
    moe.shared_expert.down_proj.weight = _sixteenths(H, 16, seed=32, dtype=torch.bfloat16)
    moe.e_score_correction_bias = (torch.arange(E, dtype=torch.float32) % 5 / 32).to(DEV)
    scale = torch.arange(1, E + 1, dtype=torch.float32, device=DEV) / E
    seen = []

    def experts(layer, x, ids, weights):   # y = sum_j w_j scale[ids_j] x, and the routing as a set per token
        seen.append((ids.sort(-1).values.cpu(), weights.gather(1, ids.argsort(-1)).cpu()))
        return ((weights * scale[ids]).sum(-1, keepdim=True) * x.float()).to(x.dtype)

    moe.experts = BoundExperts(experts, 0)
    x = _sixteenths(T, H, seed=T, dtype=torch.bfloat16)
    moe._fused = False
    ref = moe(x)
    calls = _count_routing_calls(monkeypatch)
    moe._fused = True
    got = moe(x)
    assert (calls["router_topk"], calls["route_topk"]) == ((1, 0) if T <= router.MAX_TOKENS else (0, 1))
    assert torch.equal(seen[1][0], seen[0][0])                          # the same experts for every token
    torch.testing.assert_close(seen[1][1], seen[0][1], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("E,H,n_group,topk_group", [(128, 4096, 1, 1), (160, 5120, 1, 1), (256, 7168, 8, 4)])
def test_router_topk_sigmoid_cuda_model_shape(E, H, n_group, topk_group):
    # GLM-4.5-Air, GLM-4.5 and a grouped DeepSeek-V3-style router at decode (T = 1, 8), top-8 with renorm and scale
    from ft.runtime.gpu.kernels.sigmoid_topk import SigmoidRoute

    g = torch.Generator(device="cuda").manual_seed(E)
    weight = (torch.randn(E, H, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    how = SigmoidRoute(torch.randn(E, generator=g, device="cuda") * 0.01, n_group, topk_group, 2.5)
    for T in (1, 8):
        x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
        ids, w, _ = router.router_topk(x, weight, 8, True, sigmoid=how)
        logits = torch.nn.functional.linear(x.float(), weight.float())
        want_ids, want_w = _sigmoid_expected(logits, how.bias, 8, n_group, topk_group, True, 2.5)
        # fp32 sums in another order than cuBLAS: a near tie may swap, the weights move by ulps
        assert (ids == want_ids).float().mean() >= 0.95
        same = (ids == want_ids).all(-1)
        torch.testing.assert_close(w[same], want_w[same], rtol=1e-4, atol=1e-6)
        assert not router._counter(x.device).any()
