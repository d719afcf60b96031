"""The decode GEMV for dense linears (`ft.runtime.gpu.dense_gemv`) against its fp32 PyTorch reference, and its use by
`Linear` for unquantized weights with `_fused` set. Without CUDA the kernel runs under Triton's interpreter
(conftest.py sets TRITON_INTERPRET), which truncates fp32 -> bf16 instead of rounding: bf16 is compared to 1 ulp."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from ft.runtime.gpu.dense_gemv import CONFIGS, gemv, pick_config, reference  # noqa: E402
from ft.runtime.layers import linear as lin  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
RUNS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")


def _data(T, N, K, dtype, seed, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype).to(DEV)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEV)
    b = torch.randn(N, generator=g).to(dtype).to(DEV) if bias else None
    return x, w, b


def _close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # 1 ulp of the output (plus the fp32 summation order, far below it)
        ulp = want.float().abs().clamp_min(1e-3) * 2.0 ** -7
        assert ((got.float() - want.float()).abs() <= ulp + 1e-3).all(), (got - want).abs().max()


@pytest.mark.parametrize("T", range(1, 9))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_reference(T, bias, dtype):
    N, K = 37, 200  # N not a multiple of BLOCK_N, K not a multiple of BLOCK_K
    x, w, b = _data(T, N, K, dtype, T * 7 + bias, bias)
    for config in ((4, 64, 4, 2), (8, 128, 4, 1), (1, 32, 1, 1)):
        _close(gemv(x, w, b, config=config), reference(x, w, b), dtype)


@pytest.mark.parametrize("N,K", [(1, 64), (3, 16), (64, 256), (130, 96)])
def test_gemv_shapes_even_and_tiny(N, K):
    x, w, b = _data(3, N, K, torch.float32, N + K, True)
    _close(gemv(x, w, b), reference(x, w, b), torch.float32)
    _close(gemv(x, w, b, config=(16, 32, 2, 4)), reference(x, w, b), torch.float32)


def test_fp16():
    x, w, b = _data(2, 33, 80, torch.float16, 5, True)
    got, want = gemv(x, w, b, config=(8, 32, 2, 2)).float(), reference(x, w, b).float()
    assert ((got - want).abs() <= want.abs() * 2.0 ** -10 + 1e-2).all()


def test_pick_config():
    assert pick_config(256, 2048, torch.bfloat16) == CONFIGS["tiny"]
    assert pick_config(1, 2048, torch.bfloat16)[0] == 1
    assert pick_config(151936, 2048, torch.float32)[1] == CONFIGS["large"][1] // 2
    assert pick_config(5120, 40, torch.bfloat16)[1] == 64


def test_rejects_bad_inputs():
    x, w, _ = _data(9, 8, 32, torch.float32, 0, False)
    with pytest.raises(ValueError):
        gemv(x, w)
    with pytest.raises(ValueError):
        gemv(x[:2], w.to(torch.bfloat16))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_uses_gemv(monkeypatch, bias):
    x, w, b = _data(4, 24, 48, torch.float32, 11, bias)
    layer = lin.Linear()
    layer.weight, layer.bias = w, b
    layer.prepare("p", None, torch.float32, torch.device(DEV))
    calls = []
    import ft.runtime.gpu.dense_gemv as dg

    monkeypatch.setattr(dg, "gemv", lambda *a, **k: calls.append(tuple(a[0].shape)) or gemv(*a, **k))
    monkeypatch.setattr(lin, "GEMV_DEVICES", [DEV])
    want = reference(x, w, b)
    layer._fused = False
    layer(x)
    assert not calls
    layer._fused = True
    _close(layer(x.view(2, 2, 48)).view(4, 24), want, torch.float32)
    assert calls == [(4, 48)]
    layer(torch.zeros(9, 48, device=DEV))  # prefill: F.linear
    assert len(calls) == 1
