"""Dequantizing GEMV of quantized dense linears (gpu/kernels/dense_quant.py) against its PyTorch reference; through
Triton's interpreter on machines without CUDA, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from ft.runtime.gpu.kernels.dense_quant import quantized_gemv, reference_linear, supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _nvfp4(n: int, k: int, g: torch.Generator, scales_first: bool, per_row: bool):
    """codes u8 [n, k/2] and e4m3 scales [n, k/16] carved from one buffer (as Linear keeps them)."""
    nc, ns = n * k // 2, n * k // 16
    buf = torch.empty(nc + ns + 64, dtype=torch.uint8)
    c0, s0 = (ns + 64, 0) if scales_first else (0, nc + 64)
    buf[c0:c0 + nc] = torch.randint(0, 256, (nc,), dtype=torch.uint8, generator=g)
    buf[s0:s0 + ns] = (torch.rand(ns, generator=g) * 2 + 0.25).to(torch.float8_e4m3fn).view(torch.uint8)
    buf = buf.to(DEVICE)
    codes = buf[c0:c0 + nc].view(n, k // 2)
    scales = buf[s0:s0 + ns].view(torch.float8_e4m3fn).view(n, k // 16)
    s2 = (torch.rand(n, generator=g) * 0.01 + 0.001) if per_row else torch.tensor(0.004)
    return codes, scales, s2.to(DEVICE)


@pytest.mark.parametrize("n,k,t", [(40, 64, 1), (33, 96, 3), (64, 256, 2)])
@pytest.mark.parametrize("layout", ["codes_first_per_row", "scales_first_scalar"])
def test_nvfp4_gemv_matches_the_reference(n, k, t, layout):
    g = torch.Generator().manual_seed(n * k + t)
    codes, scales, s2 = _nvfp4(n, k, g, layout.startswith("scales_first"), layout.endswith("per_row"))
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = quantized_gemv("nvfp4", x, codes, scales, s2)
    want = reference_linear("nvfp4", x.cpu(), codes.cpu(), scales.cpu(), s2.cpu())
    assert got.shape == (t, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("n,k,t", [(40, 64, 1), (33, 200, 4)])  # 200: K not a multiple of the tile
def test_fp8_rows_gemv_matches_the_reference(n, k, t):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 16).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=g) * 0.1 + 0.01
    x = torch.randn(t, k, generator=g).to(torch.float32)
    got = quantized_gemv("fp8_row", x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), None)
    want = reference_linear("fp8_row", x, w, s, None)
    assert got.shape == (t, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)


def test_unsupported_shapes_are_refused():
    assert supported("fp8_row", 7) and supported("nvfp4", 96) and not supported("nvfp4", 48)
    g = torch.Generator().manual_seed(0)
    codes, scales, s2 = _nvfp4(8, 48, g, False, True)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantized_gemv("nvfp4", torch.zeros(1, 48, device=DEVICE), codes, scales, s2)


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8_row"])
def test_kept_quantized_linear_runs_the_gemv_for_decode_rows(scheme, monkeypatch):
    from ft.runtime.layers import linear as linear_mod
    from ft.runtime.layers.linear import Linear

    if DEVICE == "cpu":  # the interpreter stands in for the GPU
        monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])
    g = torch.Generator().manual_seed(11)
    n, k = 48, 128
    parts = ({"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
              "weight_scale": (torch.rand(n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn),
              "weight_scale_2": torch.rand(n, generator=g) * 0.01} if scheme == "nvfp4" else
             {"weight": (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn),
              "weight_scale": torch.rand(n, generator=g) * 0.1})
    ops = []
    for keep in (False, True):
        op = Linear()
        for name, t in parts.items():
            setattr(op, name, t)
        op.bias = torch.randn(n, generator=g) if not ops else ops[0].bias.cpu()
        op.prepare("l", scheme, torch.bfloat16, torch.device(DEVICE), keep_quantized=keep)
        ops.append(op)
    ref, kept = ops
    calls = []
    import ft.runtime.gpu.kernels.dense_quant as dq
    real = dq.quantized_gemv
    monkeypatch.setattr(dq, "quantized_gemv", lambda *a: calls.append(a[0]) or real(*a))
    x = torch.randn(2, 3, k, generator=g).to(torch.bfloat16).to(DEVICE)  # 6 rows: the GEMV
    got, want = kept(x), ref(x)
    assert calls == [scheme] and got.shape == want.shape == (2, 3, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    kept(torch.randn(9, k).to(torch.bfloat16).to(DEVICE))  # 9 rows: the chunked path
    assert calls == [scheme]


def test_dense_benchmark_rows(monkeypatch):
    import kernel_bench  # tools/kernel_bench.py (conftest puts tools/ on the path)
    from ft.runtime.layers import linear as linear_mod

    monkeypatch.setattr(kernel_bench, "_time_ms", lambda fn: 2.0)
    if DEVICE == "cpu":
        monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])
    rows = kernel_bench.bench_dense_quant(shapes=(("head", "nvfp4", 40, 64), ("proj", "fp8_row", 24, 96)),
                                          tokens=(1,), device=DEVICE)
    assert [(r["linear"], r["method"]) for r in rows] == [
        (lin, m) for lin in ("head", "proj") for m in ("gemv", "chunked", "bf16")]
    assert all(r["rel_err_vs_bf16"] < 2e-2 and r["ms"] == 2.0 for r in rows)
    assert rows[0]["gbs"] == (40 * 32 + 40 * 4) / 2.0 / 1e6 and rows[2]["gbs"] == 40 * 64 * 2 / 2.0 / 1e6


def test_a_failing_gemv_falls_back_to_chunked_dequantization(monkeypatch, caplog):
    import ft.runtime.gpu.kernels.dense_quant as dq
    from ft.runtime.layers import linear as linear_mod
    from ft.runtime.layers.linear import Linear

    monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])

    def broken(*a):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(dq, "quantized_gemv", broken)
    g = torch.Generator().manual_seed(2)
    op, ref = Linear(), Linear()
    for o in (op, ref):
        o.weight = (torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 4).to(torch.float8_e4m3fn)
        o.weight_scale, o.bias = torch.full((16,), 0.05), None
    op.prepare("m", "fp8_row", torch.float32, torch.device("cpu"), keep_quantized=True)
    ref.prepare("m", "fp8_row", torch.float32, torch.device("cpu"))
    x = torch.randn(2, 64, generator=g)
    assert torch.equal(op(x), ref(x)) and linear_mod.GEMV_DEVICES == []
    assert "quantized GEMV failed (RuntimeError: no kernel for this GPU)" in caplog.text
