"""Row dequantization of kept-quantized dense linears (gpu/kernels/dense_dequant.py): bit for bit the exact
dequantization of ft.formats.quant rounded to the compute dtype; through Triton's interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

from ft.formats.quant import fp8, nvfp4
from ft.runtime.gpu.kernels.dense_dequant import dequantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_BYTES = torch.tensor([v for v in range(256) if v & 0x7F != 0x7F], dtype=torch.uint8)  # NaNs excluded


def _nvfp4(n: int, k: int, g: torch.Generator, per_row: bool):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[:codes.numel()]  # every code pair
    scales = E4M3_BYTES[torch.randint(0, len(E4M3_BYTES), (n, k // 16), generator=g)].view(torch.float8_e4m3fn)
    s2 = torch.rand(n, generator=g) * 0.01 + 1e-4 if per_row else torch.tensor(0.0037)
    return codes, scales, s2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,rows", [(40, 64, (0, 40)), (33, 4160, (5, 29)), (7, 2048, (6, 7))])
@pytest.mark.parametrize("per_row", [True, False])
def test_nvfp4_rows_equal_the_exact_dequantization(dtype, n, k, rows, per_row):
    # k 4160: 2080 bytes a row, a third (masked) program past two of BB_MAX; rows: a slice, a single last row
    g = torch.Generator().manual_seed(n + k)
    codes, scales, s2 = _nvfp4(n, k, g, per_row)
    r0, r1 = rows
    got = dequantize_rows("nvfp4", codes.to(DEVICE), scales.to(DEVICE), s2.to(DEVICE), r0, r1, dtype)
    want = nvfp4.dequantize(codes, scales, s2)[r0:r1].to(dtype)
    assert got.dtype == dtype and got.shape == (r1 - r0, k)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_equal_the_exact_dequantization_for_every_byte(dtype):
    g = torch.Generator().manual_seed(3)
    n = 12
    w = E4M3_BYTES[torch.randint(0, len(E4M3_BYTES), (n, 1040), generator=g)]
    w[0, :len(E4M3_BYTES)] = E4M3_BYTES
    w = w.view(torch.float8_e4m3fn)
    s = torch.rand(n, generator=g) * 0.1 + 1e-3
    got = dequantize_rows("fp8_row", w.to(DEVICE), s.to(DEVICE), None, 2, n, dtype)
    want = fp8.dequantize(w, s)[2:].to(dtype)
    assert torch.equal(got.cpu(), want) and got.shape == (n - 2, 1040)


def test_kept_quantized_prefill_uses_the_kernel_and_matches_the_dequantized_linear(monkeypatch):
    import ft.runtime.gpu.kernels.dense_dequant as dd
    from ft.runtime.layers import linear as linear_mod
    from ft.runtime.layers.linear import Linear

    if DEVICE == "cpu":  # the interpreter stands in for the GPU
        monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])
    monkeypatch.setattr(linear_mod, "DEQUANT_TRANSIENT", 16 * 64 * 2)  # 16 bf16 rows a chunk: 3 chunks of 40 rows
    calls = []
    real = dd.dequantize_rows
    monkeypatch.setattr(dd, "dequantize_rows", lambda *a: calls.append(a[4:6]) or real(*a))
    g = torch.Generator().manual_seed(9)
    codes, scales, s2 = _nvfp4(40, 64, g, True)
    ops = []
    for keep in (False, True):
        op = Linear()
        op.weight, op.weight_scale, op.weight_scale_2 = codes, scales, s2
        op.bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        op.prepare("l", "nvfp4", torch.bfloat16, torch.device(DEVICE), keep_quantized=keep)
        ops.append(op)
    x = torch.randn(12, 64, generator=g).to(torch.bfloat16).to(DEVICE)  # 12 rows: past the GEMV's 8
    got, want = ops[1](x), ops[0](x)
    assert calls == [(0, 16), (16, 32), (32, 40)]
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_dequant_benchmark_rows():
    import bench_dense  # tools/bench_dense.py (conftest puts tools/ on the path)

    ran = []
    rows = bench_dense.dequant_rows((("head", "nvfp4", 8, 64), ("proj", "fp8_row", 4, 32)), 1e3, device=DEVICE,
                                    time_us=lambda fns: ran.append([f().dtype for f in fns]) or 2.0)
    assert ran == [[torch.bfloat16]] * 4  # the kernel and the PyTorch ops, per shape
    assert [(r["shape"], r["kernel_us"], r["torch_us"]) for r in rows] == [("head", 2.0, 2.0), ("proj", 2.0, 2.0)]
    assert rows[0]["hbm_frac"] == round((8 * 32 + 8 * 4 + 2 * 8 * 64) / 2.0 / 1e3 / 1e3, 3)  # read + written

