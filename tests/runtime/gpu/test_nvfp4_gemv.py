"""The decode GEMV tiles (`nvfp4_gemv.rows_dot`) and the device-planned decode kernels built on them
(`nvfp4_decode.moe_nvfp4_device`): bit-exact decoding of every code and scale, chunked and padded K, top-8 at T = 1..8,
both combines, dead pairs, tile overrides, and the sm_90 build of the benchmark's configs (no GPU needed).
Without CUDA the kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET before triton loads)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ft.formats.quant import nvfp4  # noqa: E402
from ft.runtime.gpu.kernels.moe_reference import moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode import DECODE_BLOCKS, decode_blocks, moe_nvfp4_device  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_gemv import rows_dot  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402

from .gpu_fixtures import random_records, rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
TOL = 2e-3 if CUDA else 1e-5  # as in test_gpu_moe_device_plan.py
TOOL = Path(__file__).resolve().parents[3] / "tools" / "bench_moe_decode.py"


@triton.jit
def _probe_kernel(buf, OFF_S, x, out, K, KB: tl.constexpr, R: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr):
    # out[c, r] = W[r] . x[c] * 2^-22 for one record at buf (codes at 0, scales at OFF_S)
    c = tl.program_id(0)
    r = tl.arange(0, R)
    x_mask = tl.arange(0, 1)[None, :, None] < 1
    v = rows_dot(buf, 0, OFF_S, r[:, None, None], (r < R)[:, None, None], x + c * K, x_mask, KB, R, 1, BKB, ASM)
    tl.store(out + c * R + r[:, None], v)


def _weights(R, K, seed):
    """codes u8 [R, K/2] with every nibble value in every position mod 16; e4m3 scales [R, K/16] drawn from all
    non-NaN encodings (subnormals and the extremes included)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (R, K // 2), dtype=torch.uint8, generator=g)
    codes[:, :8] = (torch.arange(16, dtype=torch.uint8) * 17)[None, :8] + torch.arange(R, dtype=torch.uint8)[:, None]
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    scales = finite[torch.randint(0, finite.numel(), (R, K // 16), generator=g)]
    scales[0, :4] = torch.tensor([0x01, 0x7E, 0x81, 0xFE], dtype=torch.uint8)[: min(4, K // 16)]
    return codes, scales


def _probe(codes, scales, x, bkb):
    R, K = codes.shape[0], codes.shape[1] * 2
    off_s = (codes.numel() + 15) // 16 * 16
    buf = torch.zeros(off_s + scales.numel(), dtype=torch.uint8)
    buf[: codes.numel()] = codes.reshape(-1)
    buf[off_s:] = scales.reshape(-1)
    out = torch.empty(x.shape[0], R, dtype=torch.float32, device=DEV)
    _probe_kernel[(x.shape[0],)](buf.to(DEV), off_s, x.to(DEV), out, K, KB=K // 16, R=R, BKB=bkb, ASM=CUDA)
    return out.cpu() * 2.0**22


@pytest.mark.parametrize("K,bkb", [(64, 4), (96, 8), (96, 4)])  # whole K, padded K, chunked with a padded chunk
def test_rows_dot_decodes_every_code_and_scale_exactly(K, bkb):
    codes, scales = _weights(16, K, seed=K + bkb)
    w = nvfp4.dequantize(codes, scales.view(torch.float8_e4m3fn), torch.ones(16)).float()  # exact [R, K]
    got = _probe(codes, scales, torch.eye(K, dtype=torch.bfloat16), bkb)  # x = e_c picks column c
    assert torch.equal(got.t(), w)


@pytest.mark.parametrize("bkb", [2, 8])
def test_rows_dot_random_activations(bkb):
    codes, scales = _weights(16, 96, seed=bkb)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(bkb)).to(torch.bfloat16)
    w = nvfp4.dequantize(codes, scales.view(torch.float8_e4m3fn), torch.ones(16)).double()
    assert rel_err(_probe(codes, scales, x, bkb), x.double() @ w.t()) < 1e-6


def _case(H, I, T, k, seed, *, E=12, dead=False):
    """E experts in E + 2 slots (random expert -> slot table); tokens share experts (the last repeats the first)."""
    layout = RecordLayout.packed(H, I)
    recs = random_records(layout, E + 2, seed)
    g = torch.Generator().manual_seed(300 + seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 1:
        ids[-1] = ids[0]
    table = torch.randperm(E + 2, generator=g)[:E].to(torch.int32)
    if dead:  # routed experts without a slot: never read, contribute nothing
        table[ids[0, :2]] = -1
    w = torch.rand(T, k, generator=g) + 0.1
    return layout, recs, x, ids, table, w


# T, k, H, I, combine, blocks: whole and chunked K (padded: H or I = 96 is 6 words), partial N tiles, legacy keys
CASES = [
    (1, 8, 64, 32, "tokens", None),
    (3, 2, 96, 96, "tokens", {"BLOCK_N_GU": 32, "BLOCK_K_GU": 64, "WARPS_GU": 2, "BLOCK_N_D": 32, "BLOCK_K_D": 32}),
    (8, 2, 64, 32, "tokens", {"BLOCK_N_GU": 16, "BLOCK_N_D": 16, "WARPS_D": 8}),
    (4, 8, 32, 32, "tokens", {"BLOCK_N_GU": 32, "BLOCK_N_D": 32}),
    (5, 3, 96, 32, "pairs", {"BLOCK_K": 32, "num_warps": 2, "BLOCK_N_GU": 32, "BLOCK_N_D": 32}),
    (2, 8, 64, 32, "pairs", {"BLOCK_N_GU": 64, "BLOCK_N_D": 128}),
]


@pytest.mark.parametrize("T,k,H,I,combine,blocks", CASES)
def test_decode_kernels_match_reference(T, k, H, I, combine, blocks):
    layout, recs, x, ids, table, w = _case(H, I, T, k, seed=T * 10 + k, dead=(T == 3))
    ref = moe_ref(recs, layout, x, table.long()[ids], w)
    args = (recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV))
    got = moe_nvfp4_device(*args, w.to(DEV), blocks=blocks, combine=combine).cpu()
    assert got.dtype == torch.float32 and got.shape == (T, H) and torch.isfinite(got).all()
    assert rel_err(got, ref) < TOL
    other = "pairs" if combine == "tokens" else "tokens"  # same pairs, another summation order
    assert rel_err(moe_nvfp4_device(*args, w.to(DEV), blocks=blocks, combine=other).cpu(), got) < 1e-6
    if T == 1:  # bf16 routing weights are read as they are (no cast kernel)
        wb = w.to(torch.bfloat16)
        got_b = moe_nvfp4_device(*args, wb.to(DEV), blocks=blocks, combine=combine).cpu()
        assert rel_err(got_b, moe_ref(recs, layout, x, table.long()[ids], wb.float())) < TOL


def test_unaligned_activations_and_int64_ids():
    layout, recs, x, ids, table, w = _case(64, 32, 2, 4, seed=9)
    big = torch.zeros(2 * 64 + 1, dtype=torch.bfloat16)
    big[1:] = x.reshape(-1)
    xv = big.to(DEV)[1:].view(2, 64)  # data_ptr 2 bytes past an aligned one
    got = moe_nvfp4_device(recs.to(DEV), layout, xv, ids.long().to(DEV), table.to(DEV), w.to(DEV)).cpu()
    assert rel_err(got, moe_ref(recs, layout, x, table.long()[ids], w)) < TOL


def test_decode_blocks_overrides():
    assert decode_blocks() == DECODE_BLOCKS and decode_blocks() is not DECODE_BLOCKS
    b = decode_blocks({"BLOCK_K": 256, "num_warps": 2, "BLOCK_N_D": 4})
    assert (b["BLOCK_K_GU"], b["BLOCK_K_D"], b["WARPS_GU"], b["WARPS_D"], b["BLOCK_N_D"]) == (256, 256, 2, 2, 4)
    with pytest.raises(ValueError, match="unknown decode block keys"):
        decode_blocks({"BLOCK_M": 16})


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_moe_decode", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_bench_rows_check_out():
    bench = _bench_module()
    gu = {"gu-a": {"BLOCK_N_GU": 32, "BLOCK_K_GU": 32, "WARPS_GU": 4}}
    dn = {"d-a": {"BLOCK_N_D": 32, "BLOCK_K_D": 32, "WARPS_D": 4}}
    rows = bench.bench_rows(hidden=32, inter=32, num_experts=6, top_k=2, tokens=(1, 2), layers=2, gu_configs=gu,
                            down_configs=dn, device="cpu", time_us=lambda fn, calls: 1.0, hbm_gbs=1000.0,
                            log=lambda s: None)
    kinds = {(r["kernel"], r.get("tokens")) for r in rows}
    assert {("gate_up", 1), ("down", 1), ("call", 1), ("gate_up", 2), ("down", 2), ("call", 2)} <= kinds
    assert all("error" not in r for r in rows)
    assert all(r["rel_err"] < TOL for r in rows if "rel_err" in r) and all(r["us"] == 1.0 for r in rows[1:])
    assert all(r["deterministic"] for r in rows if r["kernel"] == "call")
    assert {r["config"] for r in rows if r["kernel"] == "call"} == {"default", "pairs", "best"}
    assert bench.suggest(rows) == {**gu["gu-a"], **dn["d-a"]}


def test_kernels_build_for_sm90_without_a_gpu():
    """The interpreter runs Python, not the compiler: build the default decode configs for sm_90 (Triton's CUDA
    backend and ptxas) in a process without TRITON_INTERPRET; no spills, no tile through shared memory."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(TOOL), "--compile-only", "--configs", "default"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("kernel=")]
    assert len(rows) == 2 and all("stack=0" in line for line in rows), res.stdout
    assert all(int(line.split("sts=")[1].split()[0]) <= 16 for line in rows), res.stdout


@pytest.mark.skipif(not CUDA, reason="the interpreter's bf16 store truncates; on CUDA it rounds to nearest even")
@pytest.mark.parametrize("combine", ["tokens", "pairs"])
def test_cuda_compute_dtype_output_is_the_rounded_fp32_sum(combine):
    layout, recs, x, ids, table, w = _case(64, 32, 4, 8, seed=5)
    args = (recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV))
    want = moe_nvfp4_device(*args, combine=combine)
    got = moe_nvfp4_device(*args, combine=combine, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
