"""The decode skinny GEMM (`gpu/kernels/dense_gemv.py`) against `F.linear` and its reference, and the layers that
route decode-size calls through it (`Linear`, `linear`, the stacked DeltaNet projections). Without CUDA the kernel
runs under Triton's interpreter (conftest.py sets TRITON_INTERPRET) on CPU tensors; sizes are tiny.

Tolerance: the kernel and F.linear both sum exact products (bf16 / fp16 products are exact in fp32) in fp32 and
round once to the output dtype; they differ only in summation order, by at most about K 2^-24 (|x| · |w|ᵀ + |b|)
before the rounding. So an element equals F.linear's or sits one ulp of the output dtype away (where the fp32 sums
straddle a rounding boundary, rare for bf16's 2^-8 relative ulp), and never further than 1 ulp + that fp32 bound
(`_check`). With inputs that are multiples of 1/16 every sum is exact in fp32 and the results are bit-equal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels import dense_gemv as dg  # noqa: E402
from ft.runtime.layers import linear as linear_mod  # noqa: E402
from ft.runtime.layers.batch import ForwardBatch, SegmentRows  # noqa: E402
from ft.runtime.layers.linear import Linear, gemv_eligible, linear, stack_rows  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 [..] -> the spacing of `dtype` values at |v| (its subnormal spacing below the normal range)."""
    fi = torch.finfo(dtype)
    e = torch.frexp(v.float().abs().clamp_min(fi.tiny))[1]                 # |v| in [2^(e-1), 2^e)
    return torch.ldexp(torch.full(v.shape, fi.eps), e - 1)


def _check(got, x, w, b=None, exact_frac=0.99):
    """got against F.linear (module docstring): all within 1 ulp plus the fp32 summation bound, for bf16 / fp16 also
    >= exact_frac of the elements within 1 ulp (fp32 outputs: the summation order alone moves them several ulps),
    and the same result as dense_gemv_ref under the same bound."""
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == x.dtype
    g, wf = got.float().cpu(), want.float().cpu()
    mag = x.float().abs().cpu() @ w.float().abs().cpu().t() + (0 if b is None else b.float().abs().cpu())
    ulp = torch.maximum(_ulp(g, x.dtype), _ulp(wf, x.dtype))
    err = (g - wf).abs()
    bound = ulp + 2 * x.shape[-1] * 2.0 ** -24 * mag
    if x.dtype != torch.float32:
        assert (err <= ulp).float().mean() >= exact_frac, float((err <= ulp).float().mean())
    assert (err <= bound).all(), float((err - bound).max())
    ref = dg.dense_gemv_ref(x, w, b).float().cpu()
    assert ((g - ref).abs() <= bound).all()
    return err


def _randn(*shape, seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _sixteenths(*shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, shape, generator=g) / 16).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 8, 16])
@pytest.mark.parametrize("N,K,bias", [(16, 32, False), (64, 128, True), (96, 272, True)])
def test_dense_gemv_matches_linear(dtype, T, N, K, bias):
    # K = 272, N = 96: neither a multiple of the tiles; both inner products (FMA and tensor-core dot) at every T
    x = _randn(T, K, seed=T * K, dtype=dtype)
    w = _randn(N, K, seed=N, dtype=dtype, scale=0.1)
    b = _randn(N, seed=N + 1, dtype=dtype) if bias else None
    for dot in (False, True):
        _check(dg.dense_gemv(x, w, b, tiles={"DOT": dot}), x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_exact_sums_are_bit_equal(dtype, T):
    # multiples of 1/16: every sum exact, so both sides round the same value once (in bf16 many outputs are ties
    # between two bf16 values, which checks round-to-nearest-even)
    x, w, b = (_sixteenths(*s, seed=i + T, dtype=dtype) for i, s in enumerate(((T, 200), (40, 200), (40,))))
    for dot in (False, True):
        got = dg.dense_gemv(x, w, b, tiles={"DOT": dot})
        assert torch.equal(got, F.linear(x, w, b)) and torch.equal(got, dg.dense_gemv_ref(x, w, b))


def test_strided_rows_tiles_and_bounds():
    K, N = 272, 96
    w = _randn(N, K, seed=1, dtype=torch.bfloat16, scale=0.1)
    big = _randn(dg.MAX_TOKENS + 1, K + 24, seed=2, dtype=torch.bfloat16)
    for x in (big[:16, 8:8 + K], big[::3, 24:], big[:5, :K].contiguous()):    # strided rows (offset), contiguous
        assert x.stride(1) == 1 and x.stride(0) >= K
        _check(dg.dense_gemv(x, w), x, w)
    xt = _randn(K, 4, seed=3, dtype=torch.bfloat16).t()                       # a last stride of K: copied
    _check(dg.dense_gemv(xt, w), xt, w)
    x = big[:7, :K]
    # many programs and K steps, one weight row per program, masked tails, wide tiles
    for tiles in ({"DOT": False, "BLOCK_N": 1, "BLOCK_K": 16, "num_warps": 1}, {"DOT": False, "BLOCK_N": 32},
                  {"DOT": True, "BLOCK_N": 32, "BLOCK_K": 64, "num_stages": 2}, {"DOT": True, "BLOCK_K": 512}):
        _check(dg.dense_gemv(x, w, tiles=tiles), x, w)
    assert dg.dense_gemv(x[:0], w).shape == (0, N)
    with pytest.raises(ValueError, match="T <= 16"):
        dg.dense_gemv(big[:, :K], w)                           # prefill sizes: the caller's GEMM
    with pytest.raises(ValueError):
        dg.dense_gemv(x.float(), w)                            # dtypes differ
    with pytest.raises(ValueError):
        dg.dense_gemv(x, w, torch.zeros(N + 1, dtype=w.dtype, device=DEV))


def test_launch_tiles():
    dot, fma = dg.TILES["dot"], dg.TILES["fma"]
    for T in (1, 2, 3, 8, 16):
        for N in (1, 64, 256, 1024, 2048, 5120, 12352, 151936):
            for K in (512, 2048, 4096):
                t = dg.launch_tiles(N, K, T)
                bn, bk = t["BLOCK_N"], t["BLOCK_K"]
                assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and 16 <= bk <= K, (T, N, K, t)
                assert t["BLOCK_T"] >= T
                if t["DOT"]:                      # tensor cores: padded tokens, >= PROGRAMS programs or the least rows
                    assert t["BLOCK_T"] >= 8 and dot["min_block_n"] <= bn <= dot["max_block_n"]
                    assert triton.cdiv(N, bn) >= dg.PROGRAMS or bn == dot["min_block_n"], (T, N, t)
                    assert bn * bk <= dot["tile_elems"] and K // bk >= dot["min_k_steps"], (T, N, K, t)
                else:                             # the fp32 accumulator stays bounded
                    assert t["BLOCK_T"] * bn * bk <= fma["acc_elems"], (T, N, K, t)
    # which product runs: FMA for small weights at T <= 2 and tiny N above, the tensor cores otherwise
    assert not dg.launch_tiles(5120, 2048, 1)["DOT"] and dg.launch_tiles(5120, 2048, 1)["BLOCK_N"] == 4
    assert dg.launch_tiles(12288, 2048, 1)["DOT"] and dg.launch_tiles(248320, 2048, 2)["DOT"]
    assert not dg.launch_tiles(64, 2048, 8)["DOT"] and dg.launch_tiles(64, 2048, 8)["BLOCK_N"] == 1
    assert dg.launch_tiles(2048, 4096, 8) == {"DOT": True, "BLOCK_T": 8, "BLOCK_N": 8, "BLOCK_K": 256,
                                                "num_warps": 1, "num_stages": 4}
    assert dg.launch_tiles(2048, 2048, 8, {"num_warps": 4})["num_warps"] == 4
    assert dg.launch_tiles(2048, 2048, 8, {"DOT": False, "BLOCK_N": 2})["BLOCK_N"] == 2
    assert dg.launch_tiles(64, 40, 1)["BLOCK_K"] == 64 and linear_mod.DENSE_GEMV_MAX_TOKENS == dg.MAX_TOKENS


# ---- the layers: decode-size calls of eligible plain linears go through dense_gemv when fused --------------------
@pytest.fixture
def gemv_calls(monkeypatch):
    """Puts the CPU among the GEMV devices (the interpreter stands in for the GPU) and records dense_gemv's calls."""
    if not CUDA:
        monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])
    calls, real = [], dg.dense_gemv
    monkeypatch.setattr(dg, "dense_gemv", lambda x, w, b=None: calls.append((tuple(x.shape), tuple(w.shape)))
                        or real(x, w, b))
    return calls


def _linear(dtype, n=48, k=96, bias=True, seed=0):
    op = Linear()
    op.weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    op.bias = torch.randn(n) if bias else None
    op.prepare("l", None, dtype, torch.device(DEV))
    return op


def test_linear_routes_decode_rows_through_the_gemv(gemv_calls):
    op = _linear(torch.bfloat16)
    assert op._gemv and not _linear(torch.float32)._gemv        # fp32 stays on cuBLAS
    x = _randn(2, 3, 96, seed=4, dtype=torch.bfloat16)          # 6 rows
    want = op(x)                                                # not fused: F.linear
    assert gemv_calls == []
    op._fused = True
    got = op(x)
    assert gemv_calls == [((6, 96), (48, 96))] and got.shape == (2, 3, 48)
    _check(got.reshape(6, 48), x.reshape(6, 96), op.weight, op.bias)
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    op(_randn(dg.MAX_TOKENS + 1, 96, seed=5, dtype=torch.bfloat16))   # prefill rows: F.linear
    assert len(gemv_calls) == 1


def test_linear_off_gemv_devices_keeps_f_linear(monkeypatch):
    monkeypatch.setattr(linear_mod, "GEMV_DEVICES", [])
    op = _linear(torch.bfloat16)
    op._fused = True
    assert not op._gemv
    x = _randn(3, 96, seed=6, dtype=torch.bfloat16)
    assert torch.equal(op(x), F.linear(x, op.weight, op.bias))


def test_stacked_linears_take_the_gemv(gemv_calls):
    a, b = _linear(torch.bfloat16, 40, 64, bias=False, seed=1), _linear(torch.bfloat16, 24, 64, bias=False, seed=2)
    stacked = stack_rows([a, b])
    assert stacked is not None and gemv_eligible(stacked) and a._gemv and b._gemv   # contiguous row views
    x = _randn(4, 64, seed=7, dtype=torch.bfloat16)
    _check(linear(x, stacked, gemv=True), x, stacked)
    a._fused = b._fused = True
    _check(torch.cat([a(x), b(x)], -1), x, stacked)
    assert [c[1] for c in gemv_calls] == [(64, 64), (40, 64), (24, 64)]


def test_deltanet_stacked_projection_takes_the_gemv(gemv_calls):
    from ft.runtime.layers.deltanet import GatedDeltaNet

    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    layer = GatedDeltaNet(cfg, layer=0)
    g = torch.Generator().manual_seed(3)
    for name, (n, k) in {"in_proj_qkvz": (48 + 16, 32), "in_proj_ba": (4, 32), "out_proj": (32, 16)}.items():
        op = getattr(layer, name)
        op.weight = torch.randn(n, k, generator=g) * 0.3
        op.prepare(name, None, torch.bfloat16, torch.device(DEV))
    layer.conv1d.weight = (torch.randn(48, 4, generator=g) * 0.5).to(DEV, torch.bfloat16)
    layer.dt_bias, layer.A_log = torch.randn(2).to(DEV), torch.rand(2).add(0.1).log().to(DEV)
    layer.norm.weight = torch.ones(8, device=DEV, dtype=torch.bfloat16)
    layer.stack_linears()
    assert layer._qkvzba_gemv
    x = _randn(3, 32, seed=8, dtype=torch.bfloat16)

    def run():   # three one-token segments without tables: the per-segment (recurrent) path
        states = [SimpleNamespace(conv={0: torch.zeros(48, 3, device=DEV, dtype=torch.bfloat16)},
                                  recurrent={0: torch.zeros(2, 8, 8, device=DEV)}) for _ in range(3)]
        return layer(x, ForwardBatch([SegmentRows(i, 1, 0, s) for i, s in enumerate(states)], torch.zeros(3)))

    want = run()
    assert gemv_calls == []
    layer._fused = True                                        # the layer only: its child linears stay on F.linear
    got = run()
    assert gemv_calls == [((3, 32), (68, 32))]
    assert (got.float() - want.float()).abs().max() <= 2e-2 * (1 + want.float().abs().max())


def test_a_failing_dense_gemv_falls_back_to_f_linear(monkeypatch, caplog):
    monkeypatch.setattr(linear_mod, "GEMV_DEVICES", ["cuda", "cpu"])
    op = _linear(torch.bfloat16)
    op._fused = True

    def broken(*a):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(dg, "dense_gemv", broken)
    x = _randn(2, 96, seed=9, dtype=torch.bfloat16)
    assert torch.equal(op(x), F.linear(x, op.weight, op.bias)) and linear_mod.GEMV_DEVICES == []
    assert "dense GEMV failed (RuntimeError: no kernel for this GPU)" in caplog.text


# ---- CUDA: the target models' shapes, and a CUDA-graph replay -----------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 4, 8, 16])
@pytest.mark.parametrize("N,K", [(2048, 2048), (1024, 2048), (2048, 512), (256, 2048), (64, 2048), (12352, 2048),
                                 (5120, 2048), (2048, 4096)])
def test_cuda_model_shapes(T, N, K):
    x = _randn(T, K, seed=T, dtype=torch.bfloat16)
    w = _randn(N, K, seed=N + K, dtype=torch.bfloat16, scale=0.02)
    b = _randn(N, seed=1, dtype=torch.bfloat16, scale=0.1)
    _check(dg.dense_gemv(x, w), x, w)
    _check(dg.dense_gemv(x, w, b), x, w, b)
    for dot in (False, True):                                  # the other inner product compiles and agrees too
        _check(dg.dense_gemv(x, w, tiles={"DOT": dot}), x, w)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_replay():
    w = _randn(2048, 512, seed=1, dtype=torch.bfloat16, scale=0.05)
    x = torch.zeros(8, 512, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        dg.dense_gemv(x, w)                                     # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dg.dense_gemv(x, w)
    for seed in (2, 3):
        x.copy_(_randn(8, 512, seed=seed, dtype=torch.bfloat16))
        graph.replay()
        _check(out.clone(), x, w)


def test_benchmark_sweep_rows(monkeypatch):
    import bench_dense  # tools/bench_dense.py (conftest puts tools/ on the path)

    monkeypatch.setattr(bench_dense, "graph_us", lambda fns, reps: 2.0)
    monkeypatch.setattr(bench_dense, "SWEEP", bench_dense.SWEEP[:2] + bench_dense.SWEEP[-2:])
    x, ws = _randn(1, 64, seed=1, dtype=torch.bfloat16), [_randn(32, 64, seed=2, dtype=torch.bfloat16)]
    rows = bench_dense.sweep("s", 32, 64, 1, x, ws, F.linear(x, ws[0]).float(), hbm=1.0)
    assert len(rows) == 3 and [r["tiles"]["DOT"] for r in rows] == [False, True, True]   # SWEEP[:2] launch alike
    assert all(r["us"] == 2.0 and r["hbm_frac"] == round(32 * 64 * 2 / 2.0 / 1e3, 3) and r["max_abs_diff"] < 1e-2
               for r in rows)
