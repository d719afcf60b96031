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
    buf = torch.empty(nc + ns + 96, dtype=torch.uint8)
    c0, s0 = (-(-ns // 16) * 16 + 64, 0) if scales_first else (0, nc + 64)  # codes 16-byte aligned
    buf[c0:c0 + nc] = torch.randint(0, 256, (nc,), dtype=torch.uint8, generator=g)
    buf[s0:s0 + ns] = (torch.rand(ns, generator=g) * 2 + 0.25).to(torch.float8_e4m3fn).view(torch.uint8)
    buf = buf.to(DEVICE)
    codes = buf[c0:c0 + nc].view(n, k // 2)
    scales = buf[s0:s0 + ns].view(torch.float8_e4m3fn).view(n, k // 16)
    s2 = (torch.rand(n, generator=g) * 0.01 + 0.001) if per_row else torch.tensor(0.004)
    return codes, scales, s2.to(DEVICE)


def _fp8(n: int, k: int, t: int):
    """e4m3 weights [n, k] (zeros, the smallest subnormal and +-448 among them), row scales [n], bf16 x [t, k]."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 16).to(torch.float8_e4m3fn)
    w[0, :8] = torch.tensor([0.0, -0.0, 2 ** -9, -(2 ** -7), 448.0, -448.0, 1.125, -3.5]).to(torch.float8_e4m3fn)
    return w, torch.rand(n, generator=g) * 0.1 + 0.01, torch.randn(t, k, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("n,k,t", [(40, 64, 1), (33, 96, 3), (64, 256, 2), (17, 1024, 8), (9, 48, 5), (6, 4112, 2),
                                   (5, 4096, 1)])
@pytest.mark.parametrize("layout", ["codes_first_per_row", "scales_first_scalar"])
def test_nvfp4_gemv_matches_the_reference(n, k, t, layout):
    # k 96, 48: whole rows are not a power of two of words (masked K chunk); 4096: 256 words, two full chunks of TILES'
    # 128; 4112: 257 words, a third (masked) chunk
    g = torch.Generator().manual_seed(n * k + t)
    codes, scales, s2 = _nvfp4(n, k, g, layout.startswith("scales_first"), layout.endswith("per_row"))
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(DEVICE)
    got = quantized_gemv("nvfp4", x, codes, scales, s2)
    want = reference_linear("nvfp4", x.cpu(), codes.cpu(), scales.cpu(), s2.cpu())
    assert got.shape == (t, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("n,k,t", [(40, 64, 1), (33, 208, 4), (70, 1024, 8), (5, 16, 3), (6, 4160, 2)])
def test_fp8_rows_gemv_matches_the_reference(n, k, t):
    # 208: 26 words a row (a masked chunk); 16: two words; 4160: 520 words, a second (masked) chunk past TILES' 512
    w, s, x = _fp8(n, k, t)
    got = quantized_gemv("fp8_row", x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), None)
    want = reference_linear("fp8_row", x, w, s, None)
    assert got.shape == (t, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_fp8_rows_gemv_decodes_every_e4m3_byte_exactly():
    # one row per byte value (NaN encodings excluded), x = one-hot columns: y = the decoded value times the row scale
    b = torch.tensor([v for v in range(256) if v & 0x7F != 0x7F], dtype=torch.uint8)
    w = b[:, None].expand(-1, 16).contiguous()
    x = torch.eye(16)[:3].to(torch.bfloat16)
    s = torch.full((len(b),), 0.5)
    got = quantized_gemv("fp8_row", x.to(DEVICE), w.view(torch.float8_e4m3fn).to(DEVICE), s.to(DEVICE), None)
    want = b.view(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(got.float().cpu(), want.to(torch.bfloat16).float()[None, :].expand(3, -1))


def test_unsupported_calls_are_refused():
    assert supported("fp8_row", 32) and supported("nvfp4", 96) and supported("fp8_row", 32, torch.float32)
    assert not supported("nvfp4", 40) and not supported("fp8_row", 24) and not supported("nvfp4", 64, torch.int8)
    g = torch.Generator().manual_seed(0)
    codes, scales, s2 = _nvfp4(8, 48, g, False, True)
    with pytest.raises(ValueError, match="at most 8 rows"):
        quantized_gemv("nvfp4", torch.zeros(9, 48, dtype=torch.bfloat16, device=DEVICE), codes, scales, s2)


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_activation_dtypes_match_the_reference(scheme, dtype):
    # fp16 / fp32 activations (fp32 test models, fp16 checkpoints) take the element-wise loads
    g = torch.Generator().manual_seed(5)
    n, k, t = 21, 80, 3
    if scheme == "nvfp4":
        w, s, s2 = _nvfp4(n, k, g, False, True)
    else:
        w, s, s2 = (torch.randn(n, k, generator=g) * 16).to(torch.float8_e4m3fn).to(DEVICE), \
            (torch.rand(n, generator=g) * 0.1).to(DEVICE), None
    x = torch.randn(t, k, generator=g).to(dtype)
    got = quantized_gemv(scheme, x.to(DEVICE), w, s, s2)
    want = reference_linear(scheme, x, w.cpu(), s.cpu(), None if s2 is None else s2.cpu())
    assert got.dtype == dtype and got.shape == (t, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())


def _linears(scheme: str, n: int, k: int, g: torch.Generator, monkeypatch, *, bias: bool = False):
    """(dequantized, kept quantized) Linear of the same random [n, k] `scheme` weights (and bias), on DEVICE; on a
    machine without CUDA the interpreter stands in for the GPU."""
    from ft.runtime.layers import linear as linear_mod
    from ft.runtime.layers.linear import Linear

    if DEVICE == "cpu":
        monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])
    parts = ({"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
              "weight_scale": (torch.rand(n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn),
              "weight_scale_2": torch.rand(n, generator=g) * 0.01} if scheme == "nvfp4" else
             {"weight": (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn),
              "weight_scale": torch.rand(n, generator=g) * 0.1})
    b = torch.randn(n, generator=g) if bias else None
    ops = []
    for keep in (False, True):
        op = Linear()
        for name, t in parts.items():
            setattr(op, name, t)
        op.bias = b
        op.prepare("l", scheme, torch.bfloat16, torch.device(DEVICE), keep_quantized=keep)
        ops.append(op)
    return ops


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8_row"])
def test_kept_quantized_linear_runs_the_gemv_for_decode_rows(scheme, monkeypatch):
    g = torch.Generator().manual_seed(11)
    n, k = 48, 128
    ref, kept = _linears(scheme, n, k, g, monkeypatch, bias=True)
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


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8_row"])
def test_kept_quantized_linear_takes_the_tensor_cores_from_the_rows_its_shape_sets(scheme, monkeypatch):
    """`rows_from`, decided at prepare: fewer rows run the GEMV, from there up to 16 the tensor-core product, more
    the chunked dequantization; every path gives the dequantized linear's result."""
    import ft.runtime.gpu.kernels.dense_quant as dq
    import ft.runtime.gpu.kernels.dense_quant_mma as mma

    n, k = 40, 64
    monkeypatch.setitem(mma.MIN_WORK, scheme, 3 * n * k)  # from 3 rows on
    assert mma.rows_from(scheme, n, k) == 3 and mma.rows_from(scheme, n, 17 * k) == 2
    monkeypatch.setitem(mma.MIN_WORK, scheme, 17 * n * k)
    assert mma.rows_from(scheme, n, k) is None  # past MAX_TOKENS: never
    monkeypatch.setitem(mma.MIN_WORK, scheme, 3 * n * k)
    g = torch.Generator().manual_seed(5)
    ref, kept = _linears(scheme, n, k, g, monkeypatch)
    calls = []
    for mod, fn in ((dq, "quantized_gemv"), (mma, "quantized_mma")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, real=real, fn=fn: calls.append(fn) or real(*a))
    for rows, path in ((2, ["quantized_gemv"]), (3, ["quantized_mma"]), (16, ["quantized_mma"]), (17, [])):
        calls.clear()
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
        got, want = kept(x), ref(x)
        assert calls == path, rows
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_quantized_benchmark_rows():
    import bench_dense  # tools/bench_dense.py (conftest puts tools/ on the path)

    shapes = (("head", "nvfp4", 40, 64), ("proj", "fp8_row", 24, 96))
    timed = []
    rows = bench_dense.quantized(shapes, (1, 3), 1e3, sweep=False, device=DEVICE, l2_bytes=0,
                                 time_us=lambda fns: timed.append(len(fns)) or 2.0)
    assert [(r["shape"], r["T"]) for r in rows] == [("head", 1), ("head", 3), ("proj", 1), ("proj", 3)]
    assert timed == [2] * 4 and all(r["default"] and r["us"] == 2.0 for r in rows)
    assert all(r["max_rel_diff"] < 2e-2 for r in rows)
    assert rows[0]["hbm_frac"] == round((40 * 32 + 40 * 4) / 2.0 / 1e3 / 1e3, 3)  # stored bytes: codes + scales
    swept = bench_dense.quantized(shapes[1:], (1,), 1e3, sweep=True, device=DEVICE, l2_bytes=0,
                                  time_us=lambda fns: 1.0)
    assert len(swept) == 1 + len(bench_dense.QUANT_SWEEP) and swept[1]["tiles"] == bench_dense.QUANT_SWEEP[0]


@pytest.mark.parametrize("module,kernel,rows,said", [
    ("dense_quant", "quantized_gemv", 2, "quantized GEMV failed"),  # decode rows: the GEMV
    ("dense_quant_mma", "quantized_mma", 4, "quantized tensor-core product failed"),  # past rows_from: tensor cores
    ("dense_dequant", "dequantize_rows", 12, "row dequantization kernel failed"),  # past it: the chunked path
])
def test_a_failing_kernel_falls_back_to_pytorch_ops(module, kernel, rows, said, monkeypatch, caplog):
    import importlib

    from ft.runtime.layers import linear as linear_mod
    from ft.runtime.layers.linear import Linear

    monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])

    def broken(*a):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(importlib.import_module(f"ft.runtime.gpu.kernels.{module}"), kernel, broken)
    if module == "dense_quant_mma":  # this 16 x 64 linear is far too small to take it: from 3 rows here
        from ft.runtime.gpu.kernels import dense_quant_mma

        monkeypatch.setitem(dense_quant_mma.MIN_WORK, "fp8_row", 3 * 16 * 64)
    g = torch.Generator().manual_seed(2)
    op, ref = Linear(), Linear()
    for o in (op, ref):
        o.weight = (torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 4).to(torch.float8_e4m3fn)
        o.weight_scale, o.bias = torch.full((16,), 0.05), None
    op.prepare("m", "fp8_row", torch.bfloat16, torch.device("cpu"), keep_quantized=True)
    ref.prepare("m", "fp8_row", torch.bfloat16, torch.device("cpu"))
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(op(x), ref(x)) and linear_mod.GEMV_DEVICES == []
    assert f"{said} (RuntimeError: no kernel for this GPU)" in caplog.text


def test_default_tiles_give_each_thread_one_word_of_a_chunk_down_to_short_rows():
    """Without a tile override the warps follow the chunk: one u64 word of the R rows' chunk per thread (the sweep's
    fastest), fewer warps where K is short, never more than the tile's."""
    from ft.runtime.gpu.kernels.dense_quant import launch_consts

    for scheme, k in (("nvfp4", 512), ("nvfp4", 2048), ("nvfp4", 4096), ("fp8_row", 2048), ("fp8_row", 4096)):
        c = launch_consts(scheme, k, 1)
        assert c["num_warps"] * 32 == min(c["R"] * c["BKW"], 8 * 32), (scheme, k, c)
    assert launch_consts("nvfp4", 4096, 1, {"num_warps": 4})["num_warps"] == 4  # an override is taken as given
