"""Tensor-core product of quantized dense linears (gpu/kernels/dense_quant_mma.py) against the PyTorch reference of
the dequantizing GEMV; through Triton's interpreter on machines without CUDA, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from ft.runtime.gpu.kernels.dense_quant import quantized_gemv, reference_linear
from ft.runtime.gpu.kernels.dense_quant_mma import MAX_TOKENS, quantized_mma, supported

from .test_gpu_dense_quant import DEVICE, _fp8, _nvfp4


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float().cpu(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("n,k,t", [(70, 64, 3), (33, 96, 8), (64, 512, 16), (9, 48, 1)])
@pytest.mark.parametrize("layout", ["codes_first_per_row", "scales_first_scalar"])
def test_nvfp4_mma_matches_the_reference(n, k, t, layout):
    # 96, 48: K not a multiple of the K chunk (masked tail); 70, 33, 9: rows past the last program's BN masked
    g = torch.Generator().manual_seed(n * k + t)
    codes, scales, s2 = _nvfp4(n, k, g, layout.startswith("scales_first"), layout.endswith("per_row"))
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = quantized_mma("nvfp4", x, codes, scales, s2)
    assert got.shape == (t, n) and got.dtype == torch.bfloat16
    _close(got, reference_linear("nvfp4", x.cpu(), codes.cpu(), scales.cpu(), s2.cpu()))


@pytest.mark.parametrize("n,k,t", [(70, 64, 3), (33, 208, 8), (65, 256, 16)])
def test_fp8_rows_mma_matches_the_reference_and_the_gemv(n, k, t):
    w, s, x = _fp8(n, k, t)
    got = quantized_mma("fp8_row", x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), None)
    want = reference_linear("fp8_row", x, w, s, None)
    _close(got, want)
    if t <= 8:  # the GEMV it would replace gives the same up to summation order
        _close(got, quantized_gemv("fp8_row", x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), None).float().cpu())


def test_activations_off_16_bytes_are_taken(monkeypatch):
    """x starting 2 bytes into a buffer (a view) is copied to an aligned one first, so the kernel sees the one pointer
    specialization `ft kernels build` compiled; the result is the same."""
    import ft.runtime.gpu.kernels.dense_quant_mma as mma

    w, s, x = _fp8(40, 64, 3)
    buf = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device=DEVICE)
    view = buf[1:].view(3, 64)
    view.copy_(x.to(DEVICE))
    assert view.data_ptr() % 16 == 2
    seen, real = [], mma._mma_kernel

    class Spy:  # kernel[grid](w, OFF_S, scale, x, ...): notes where x starts
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(a[3].data_ptr() % 16)
                return real[grid](*a, **kw)
            return launch

    monkeypatch.setattr(mma, "_mma_kernel", Spy())
    got = quantized_mma("fp8_row", view, w.to(DEVICE), s.to(DEVICE), None)
    assert seen == [0]
    _close(got, reference_linear("fp8_row", x, w, s, None))


def test_every_e4m3_byte_and_e2m1_code_decodes_exactly():
    # one-hot rows of x pick single weights: y is the decoded value times its scales, exactly
    b = torch.tensor([v for v in range(256) if v & 0x7F != 0x7F], dtype=torch.uint8)
    w = b[:, None].expand(-1, 16).contiguous().view(torch.float8_e4m3fn)
    x = torch.eye(16)[:4].to(torch.bfloat16)
    got = quantized_mma("fp8_row", x.to(DEVICE), w.to(DEVICE), torch.full((len(b),), 0.5, device=DEVICE), None)
    assert torch.equal(got.float().cpu(), (b.view(torch.float8_e4m3fn).float() * 0.5).to(torch.bfloat16).float()
                       [None, :].expand(4, -1))
    codes = torch.arange(256, dtype=torch.uint8)[:, None].expand(-1, 8).contiguous()  # both nibbles of every byte
    buf = torch.cat([codes.reshape(-1), torch.full((256,), 0x38, dtype=torch.uint8)]).to(DEVICE)  # scales e4m3 1.0
    x = torch.eye(16)[:2].to(torch.bfloat16).to(DEVICE)  # elements 0 (low nibble) and 1 (high nibble)
    got = quantized_mma("nvfp4", x, buf[:2048].view(256, 8), buf[2048:].view(torch.float8_e4m3fn).view(256, 1),
                        torch.tensor(0.25, device=DEVICE))
    from ft.formats.quant.nvfp4 import e2m1_values

    want = e2m1_values(torch.arange(256, dtype=torch.uint8)[:, None])[:, :2].t() * 0.25  # [2, 256]
    assert torch.equal(got.float().cpu(), want.to(torch.bfloat16).float())


def test_unsupported_calls_are_refused():
    assert supported("fp8_row", 32) and supported("nvfp4", 96)
    assert not supported("fp8_row", 32, torch.float32) and not supported("nvfp4", 40)
    w, s = torch.zeros(4, 32, dtype=torch.float8_e4m3fn, device=DEVICE), torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match=f"1 to {MAX_TOKENS} rows"):
        quantized_mma("fp8_row", torch.zeros(MAX_TOKENS + 1, 32, dtype=torch.bfloat16, device=DEVICE), w, s, None)


def test_mma_benchmark_rows():
    import bench_dense  # tools/bench_dense.py (conftest puts tools/ on the path)

    shapes = (("head", "nvfp4", 40, 64), ("proj", "fp8_row", 24, 96))
    rows = bench_dense.quantized(shapes, (3, 8), 1e3, sweep=True, mma=True, configs=[{"BN": 32, "BK": 32}],
                                 device=DEVICE, l2_bytes=0, time_us=lambda fns: 2.0)
    assert [(r["shape"], r["T"], r["default"]) for r in rows] == [
        (s, t, d) for s in ("head", "proj") for t in (3, 8) for d in (True, False)]
    assert rows[1]["tiles"]["BN"] == 32 and all(r["max_rel_diff"] < 2e-2 for r in rows)
