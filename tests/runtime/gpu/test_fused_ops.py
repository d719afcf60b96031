"""The fused elementwise kernels (`gpu/kernels/fused_ops.py`) against their PyTorch references, and a tiny model's
logits with `_fused` on against the reference path. Without CUDA the kernels run under Triton's interpreter
(conftest.py sets TRITON_INTERPRET) on CPU tensors; sizes are tiny.

Tolerances: fp32 results differ only by summation order and the last ulp of exp/rsqrt; bf16 results may differ by
one bf16 ulp where that changes a rounding, and must agree exactly almost everywhere (which checks the rounding of
every intermediate the reference rounds)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels import fused_ops as fo  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values: one ulp of a value in [1, 2)


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    got, want = got.float().cpu(), want.float().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    torch.testing.assert_close(got, want, rtol=BF16_ULP, atol=1e-6)  # at most one ulp off
    assert (got == want).float().mean() >= 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,D", [(1, 96), (5, 64), (3, 40)])
def test_rms_norm(dtype, T, D):
    x = _rand(T, D, dtype=dtype, seed=T * D, scale=3.0)
    w = _rand(D, seed=1) + 1.0
    for eps in (1e-6, 0.5):  # a large eps: a misplaced eps shows
        _check(fo.rms_norm(x, w, eps), fo.rms_norm_ref(x, w, eps), dtype)


def test_rms_norm_strided_heads():
    # q/k norms: [N, heads, hd] heads of a qkv split, read in place (row stride of the split, not heads * hd)
    qkv = _rand(3, 4 * 16 + 2 * 16, dtype=torch.bfloat16, seed=7)
    q = qkv[:, : 4 * 16].reshape(3, 4, 16)
    k = qkv[:, 4 * 16:].reshape(3, 2, 16)
    assert not q.is_contiguous()
    w = _rand(16, seed=8) + 1.0
    for t in (q, k):
        _check(fo.rms_norm(t, w, 1e-6), fo.rms_norm_ref(t, w, 1e-6), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,D", [(1, 96), (6, 64)])
def test_add_rms_norm(dtype, T, D):
    x = _rand(T, D, dtype=dtype, seed=2, scale=4.0)
    delta = _rand(T, D, dtype=dtype, seed=3)
    w = _rand(D, seed=4) + 1.0
    s, y = fo.add_rms_norm(x, delta, w, 1e-6)
    s_ref, y_ref = fo.add_rms_norm_ref(x, delta, w, 1e-6)
    assert torch.equal(s.cpu(), s_ref.cpu())  # the rounded residual sum, bit for bit
    _check(y, y_ref, dtype)


def _distinct_logits(T, E, dtype, seed):
    # distinct values in every row, also after rounding to bf16 (no ties: ids must match torch.topk exactly)
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(E, generator=g).float() * 0.0625 - E * 0.03 for _ in range(T)]
    return torch.stack(rows).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (4, 12, 3), (2, 256, 8)])
@pytest.mark.parametrize("renorm", [False, True])
def test_route_topk(dtype, T, E, k, renorm):
    logits = _distinct_logits(T, E, dtype, seed=E + k)
    ids, w = fo.route_topk(logits, k, renorm)
    ids_ref, w_ref = fo.route_topk_ref(logits, k, renorm)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-7)
    if renorm:
        torch.testing.assert_close(w.sum(-1).cpu(), torch.ones(T), rtol=1e-5, atol=0)


def test_route_topk_ties():
    # experts 1, 4, 6 tie for first place and 2, 5 for fourth: ids descending by weight, ties by ascending id
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0, 2.0, 1.0, 2.0, 0.5]], device=DEV)
    ids, w = fo.route_topk(logits, 4, True)
    assert ids.cpu().tolist() == [[1, 4, 6, 2]]
    _, w_ref = fo.route_topk_ref(logits, 4, True)
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 48), (3, 32)])
def test_silu_mul(dtype, T, I):
    gate_up = _rand(T, 2 * I, dtype=dtype, seed=I, scale=3.0)
    _check(fo.silu_mul(gate_up), fo.silu_mul_ref(gate_up), dtype)
    wide = _rand(T, 2 * I + 8, dtype=dtype, seed=5)[:, 4: 4 + 2 * I]  # rows with a stride other than 2I
    _check(fo.silu_mul(wide), fo.silu_mul_ref(wide), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ungated_shared_add_rounds_once_as_torch(dtype):
    # gate None (glm4_moe's ungated shared expert): cast(y + shared), bit for bit torch's `y + shared`
    y, shared = _rand(3, 96, dtype=dtype, seed=4), _rand(3, 96, dtype=dtype, seed=5, scale=3.0)
    got = fo.sigmoid_gate_add(y, None, shared)
    assert got.dtype == dtype and torch.equal(got.cpu(), (y + shared).cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(1, 96), (4, 64)])
def test_sigmoid_gate_add(dtype, T, H):
    y, gate, shared = _rand(T, H, dtype=dtype, seed=1), _rand(T, 1, dtype=dtype, seed=2), _rand(T, H, dtype=dtype,
                                                                                             seed=3)
    got, want = fo.sigmoid_gate_add(y, gate, shared), fo.sigmoid_gate_add_ref(y, gate, shared)
    if dtype == torch.float32:
        _check(got, want, dtype)
        return
    # bf16: the reference rounds sigmoid, the product and the sum; the GPU may round the product differently, which
    # moves the sum by one ulp of the operands (a large relative change where y and the product nearly cancel)
    scale = (y.float().abs() + shared.float().abs()).cpu()
    assert got.dtype == want.dtype == dtype
    assert ((got.float() - want.float()).abs().cpu() <= BF16_ULP * scale + 1e-6).all()
    assert (got == want).float().mean() >= 0.9


# ---- model level: the fused path inside the decoder layers --------------------------------------------------------
@pytest.fixture
def counted(monkeypatch):
    """Counts calls of each fused function (the layers import them at call time, so the patch is seen); the decode
    router (`router.router_topk`, routing at T <= router.MAX_TOKENS) counts as "route_topk"."""
    from ft.runtime.gpu.kernels import router

    calls = {}
    for mod, name, key in [(fo, n, n) for n in ("rms_norm", "add_rms_norm", "route_topk", "silu_mul",
                                                "sigmoid_gate_add")] + [(router, "router_topk", "route_topk")]:
        def wrapped(*a, _fn=getattr(mod, name), _key=key, **kw):
            calls[_key] = calls.get(_key, 0) + 1
            return _fn(*a, **kw)

        monkeypatch.setattr(mod, name, wrapped)
    return calls


@pytest.mark.parametrize("arch,dtype", [("qwen3_moe", "fp32"), ("qwen3_5_moe", "fp32"), ("qwen3_5_moe", "bf16")])
def test_model_fused_matches_reference(ftw_for, counted, arch, dtype):
    from ft.runtime.model import Segment, load_model

    model = load_model(ftw_for(arch, "none", dtype=dtype), device=DEV)
    ids = torch.tensor([3, 17, 101, 255, 42, 7])

    def logits(fused: bool) -> torch.Tensor:
        model.set_fused(fused)
        state = model.new_state(max_tokens=16)
        [out] = model.forward(ids, [Segment(state, len(ids), "all")])
        return out

    ref = logits(False)
    assert not counted
    got = logits(True)
    L = model.config.num_layers
    # every residual add inside a norm: L - 1 layer inputs, L post-mixer norms (+ the final norm once `forward`
    # hands `layers_pending`'s pair to `logits_head`)
    assert counted["add_rms_norm"] in (2 * L - 1, 2 * L)
    assert counted["route_topk"] == sum(t == "moe" for t in model.config.mlp_types)
    if model.config.shared_expert_intermediate_size:
        assert counted["sigmoid_gate_add"] == counted["route_topk"] and counted["silu_mul"] >= counted["route_topk"]
    if dtype == "fp32":
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:  # one-ulp bf16 flips propagate through the layers; the logits stay close
        assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_logits_head_takes_the_pending_sum(ftw_for):
    from ft.runtime.model import load_model

    model = load_model(ftw_for("qwen3_moe", "none", dtype="bf16"), device=DEV)
    H = model.config.hidden_size
    h, delta = _rand(3, H, dtype=torch.bfloat16, seed=1), _rand(3, H, dtype=torch.bfloat16, seed=2)
    model.set_fused(False)
    ref = model.logits_head(h + delta)
    assert torch.equal(model.logits_head(h, delta), ref)
    model.set_fused(True)
    got = model.logits_head(h, delta)
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max() and torch.equal(got.argmax(-1), ref.argmax(-1))
