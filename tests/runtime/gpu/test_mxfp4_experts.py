"""The expert kernels on MXFP4 records with biases and the clamped SwiGLU (gpt-oss): the per-pair GEMV decode kernels
(both combines, mapped reads), the tensor-core decode kernels, the host-planned prefill tiles, against the PyTorch
reference, and the reference against the CPU experts' math (`ft.runtime.experts`) on the same dequantized weights.
Without CUDA the kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET before triton loads)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from ft.formats.quant import mxfp4  # noqa: E402
from ft.runtime.experts import clamped_silu, clamped_swiglu  # noqa: E402
from ft.runtime.gpu.host_plan import moe_nvfp4  # noqa: E402
from ft.runtime.gpu.kernels.moe_reference import expert_forward_ref, moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode_mma import moe_nvfp4_mma  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402

from .gpu_fixtures import random_mxfp4_records, rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 2e-3 if CUDA else 1e-5  # exact up to fp32 summation order on the interpreter; bf16 act rounding flips on GPU
ALPHA, LIMIT = 1.702, 7.0


def _layout(H, I, act="clamped_swiglu"):
    return RecordLayout.packed(H, I, "mxfp4", act=act, alpha=ALPHA, limit=LIMIT)


def _case(H, I, T, k, seed, *, E=7, dead=False, act="clamped_swiglu"):
    layout = _layout(H, I, act)
    S = E + 2
    recs = random_mxfp4_records(layout, S, seed)
    g = torch.Generator().manual_seed(500 + seed)
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16)  # large enough that the clamps bite
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 1:
        ids[-1] = ids[0][torch.randperm(k, generator=g)]
    table = torch.randperm(S, generator=g)[:E].to(torch.int32)
    if dead:
        table[ids[0, 0]] = -1
    w = torch.rand(T, k, generator=g) + 0.1
    return layout, recs, x, ids, table, w


def test_layout_of_an_mxfp4_record():
    lay = _layout(64, 96)
    assert lay.components == ("gate_up", "gate_up_scale", "gate_up_bias", "down", "down_scale", "down_bias")
    assert lay.shape("gate_up_scale") == (192, 2) and lay.shape("down_scale") == (64, 3)
    assert lay.payload_bytes == 192 * 32 + 192 * 2 + 192 * 4 + 64 * 48 + 64 * 3 + 64 * 4
    rec = random_mxfp4_records(lay, 1, 0)[0]
    assert lay.view(rec, "gate_up_scale").dtype == torch.uint8 and lay.view(rec, "down_bias").dtype == torch.float32
    with pytest.raises(KeyError, match="no component"):
        lay.view(rec, "down_scale_2")
    with pytest.raises(ValueError, match="offset must be -1"):
        dataclasses.replace(lay, off_down_scale_2=0)
    with pytest.raises(ValueError, match="unknown expert activation"):
        _layout(64, 96, act="gelu")
    assert lay.kernel_args("gate_up")["SWIGLU"] and not lay.kernel_args("down")["S2"]


def test_reference_is_the_cpu_experts_math():
    """moe_reference on a record = ft.runtime.experts' formula on the exactly dequantized weights (bf16 act)."""
    lay = _layout(64, 32)
    rec = random_mxfp4_records(lay, 1, 4)[0]
    x = (torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    gu_w = mxfp4.dequantize(lay.view(rec, "gate_up"), lay.view(rec, "gate_up_scale"))
    d_w = mxfp4.dequantize(lay.view(rec, "down"), lay.view(rec, "down_scale"))
    gu = F.linear(x.float(), gu_w, lay.view(rec, "gate_up_bias"))
    g, u = gu.chunk(2, dim=-1)
    act = clamped_swiglu(g, u, ALPHA, LIMIT).to(torch.bfloat16).float()
    want = F.linear(act, d_w, lay.view(rec, "down_bias"))
    assert (g > LIMIT).any() and (u.abs() > LIMIT).any()  # the clamps are exercised
    torch.testing.assert_close(expert_forward_ref(rec, lay, x), want, rtol=1e-6, atol=1e-5)


# T, k, H, I: one and two tokens (GEMV), several K chunks (H 160 = 5 words of 32), partial N tiles
GEMV_CASES = [(1, 4, 64, 32, "tokens"), (2, 3, 160, 96, "pairs"), (2, 2, 96, 64, "tokens")]


@pytest.mark.parametrize("act", ["clamped_swiglu", "clamped_silu"])
@pytest.mark.parametrize("T,k,H,I,combine", GEMV_CASES)
def test_gemv_decode_kernel_matches_reference(T, k, H, I, combine, act):
    layout, recs, x, ids, table, w = _case(H, I, T, k, T * 3 + k, dead=(T == 2), act=act)
    ref = moe_ref(recs, layout, x, table.long()[ids], w)
    got = moe_nvfp4_device(recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV), combine=combine,
                           blocks={"BLOCK_K": 32, "BLOCK_N_GU": 16, "BLOCK_N_D": 32}).cpu()
    assert torch.isfinite(got).all() and rel_err(got, ref) < TOL


def test_gemv_decode_kernel_reads_mapped_records():
    """host_base != 0: pairs without a slot read their record from the bank at host_base + e * stride."""
    layout, recs, x, ids, table, w = _case(64, 64, 1, 4, 9)
    bank = recs[:7].clone()
    if DEV == "cuda":  # the GPU reads host memory only when it is page-locked (mapped at the same address under UVA)
        bank = bank.pin_memory()
    table[:] = -1  # nothing resident: every record comes from the bank
    ref = moe_ref(bank, layout, x, ids, w)
    got = moe_nvfp4_device(recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV),
                           host_base=bank.data_ptr(), host_stride=layout.stride).cpu()
    assert rel_err(got, ref) < TOL


MMA_CASES = [(3, 2, 96, 64, {"BN_GU": 16, "BN_D": 32, "BK_GU": 32, "BK_D": 64}),
             (4, 4, 64, 96, {"BN_GU": 32, "BN_D": 16, "BK_GU": 64, "BK_D": 32})]


@pytest.mark.parametrize("T,k,H,I,blocks", MMA_CASES)
def test_mma_decode_kernel_matches_reference(T, k, H, I, blocks):
    layout, recs, x, ids, table, w = _case(H, I, T, k, T * 5 + k, dead=(T == 3))
    ref = moe_ref(recs, layout, x, table.long()[ids], w)
    args = (recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV))
    got = moe_nvfp4_mma(*args, blocks=blocks).cpu()
    assert torch.isfinite(got).all() and rel_err(got, ref) < TOL


def test_reference_clamped_silu_is_deepseek_v4s():
    """deepseek_v4's activation: the reference = ft.runtime.experts.clamped_silu, and the clamp changes the result."""
    lay = _layout(64, 32, act="clamped_silu")
    rec = random_mxfp4_records(lay, 1, 4)[0]
    x = (torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    gu_w = mxfp4.dequantize(lay.view(rec, "gate_up"), lay.view(rec, "gate_up_scale"))
    d_w = mxfp4.dequantize(lay.view(rec, "down"), lay.view(rec, "down_scale"))
    g, u = F.linear(x.float(), gu_w, lay.view(rec, "gate_up_bias")).chunk(2, dim=-1)
    want = F.linear(clamped_silu(g, u, LIMIT).to(torch.bfloat16).float(), d_w, lay.view(rec, "down_bias"))
    torch.testing.assert_close(expert_forward_ref(rec, lay, x), want, rtol=1e-6, atol=1e-5)
    plain = expert_forward_ref(rec, dataclasses.replace(lay, act="silu"), x)
    assert (plain - want).abs().max() > 1e-2 * want.abs().max()
    assert lay.kernel_args("gate_up")["LIMIT"] == LIMIT and not lay.kernel_args("gate_up")["SWIGLU"]


@pytest.mark.parametrize("act", ["clamped_swiglu", "silu", "clamped_silu"])
def test_prefill_tiles_match_reference(act):
    layout, recs, x, ids, table, w = _case(64, 64, 6, 3, 21, act=act)
    slots = table.long()[ids]
    ref = moe_ref(recs, layout, x, slots, w)
    got = moe_nvfp4(recs.to(DEV), layout, x.to(DEV), slots.reshape(-1).numpy(), w.to(DEV)).cpu()
    assert torch.isfinite(got).all() and rel_err(got, ref) < TOL


def test_records_without_biases():
    """DeepSeek-V4's FP4 experts as records: no bias components (offsets -1, BIAS off); the decode kernel and the
    reference agree, and the reference is `silu(g) * u` on the exact weights (the engine itself refuses deepseek_v4:
    its clamped_silu has no kernel)."""
    lay = RecordLayout.packed(64, 32, "mxfp4", act="silu", bias=False)
    assert lay.components == ("gate_up", "gate_up_scale", "down", "down_scale") and not lay.kernel_args("down")["BIAS"]
    assert lay.payload_bytes == 64 * 32 + 64 * 2 + 64 * 16 + 64 * 1
    with pytest.raises(ValueError, match="both expert biases or neither"):
        dataclasses.replace(_layout(64, 32), off_down_bias=-1)
    recs = random_mxfp4_records(lay, 9, 5)
    x = (torch.randn(2, 64, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16)
    gu_w = mxfp4.dequantize(lay.view(recs[0], "gate_up"), lay.view(recs[0], "gate_up_scale"))
    d_w = mxfp4.dequantize(lay.view(recs[0], "down"), lay.view(recs[0], "down_scale"))
    g, u = F.linear(x.float(), gu_w).chunk(2, dim=-1)
    want = F.linear((F.silu(g) * u).to(torch.bfloat16).float(), d_w)
    torch.testing.assert_close(expert_forward_ref(recs[0], lay, x), want, rtol=1e-6, atol=1e-5)
    ids, w = torch.tensor([[0, 3], [3, 5]]), torch.tensor([[0.6, 0.4], [0.3, 0.7]])
    table = torch.arange(9, dtype=torch.int32)
    ref = moe_ref(recs, lay, x, ids, w)
    got = moe_nvfp4_device(recs.to(DEV), lay, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV),
                           blocks={"BLOCK_K": 32, "BLOCK_N_GU": 16, "BLOCK_N_D": 32}).cpu()
    assert torch.isfinite(got).all() and rel_err(got, ref) < TOL
