"""NVFP4 fused MoE kernel vs the PyTorch reference (Triton interpreter on CPU; real kernels when CUDA exists)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels.moe_reference import dequant_nvfp4, moe_ref  # noqa: E402
from ft.runtime.gpu.host_plan import moe_nvfp4, plan_blocks  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402

from .gpu_fixtures import random_records, rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter path is exact up to fp32 summation order; tensor cores may flip a bf16 rounding of the gated act.
TOL = 2e-3 if DEV == "cuda" else 1e-5


def test_dequant_matches_lut_definition():
    codes = torch.tensor([[0x10, 0xF8, 0x7A, 0x00, 0x21, 0x43, 0x65, 0x87]], dtype=torch.uint8)
    scale = torch.tensor([[0.5]]).to(torch.float8_e4m3fn)
    w = dequant_nvfp4(codes, scale, torch.tensor([2.0]))
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    expect = []
    for b in codes[0].tolist():
        expect += [lut[b & 15], lut[b >> 4]]
    assert w.tolist() == [[v * 1.0 for v in expect]]


def test_plan_blocks_groups_and_pads():
    slots = np.array([3, -1, 3, 0, 3, 0], dtype=np.int64)
    sp, bs = plan_blocks(slots, 2)
    assert bs.tolist() == [0, 3, 3]
    assert sp.tolist() == [3, 5, 0, 2, 4, 6]  # 6 = sentinel (P)


@pytest.mark.parametrize("T,k,seed", [(1, 4, 0), (5, 2, 1), (40, 2, 2)])
def test_kernel_matches_reference(T, k, seed):
    layout = RecordLayout.packed(hidden=64, inter=32)
    S = 6
    recs = random_records(layout, S, seed)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    if T > 1:
        slots[0, 0] = -1  # a pair computed elsewhere (CPU side of the hybrid split)
    w = torch.rand(T, k, generator=g)
    ref = moe_ref(recs, layout, x, slots, w)
    got = moe_nvfp4(recs.to(DEV), layout, x.to(DEV), slots.reshape(-1).numpy(), w.to(DEV)).cpu()
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < TOL
    if T > 1:  # the skipped pair really is absent
        only = torch.full_like(slots, -1)
        only[0, 0] = int(torch.randperm(S, generator=g)[0])
        part = moe_nvfp4(recs.to(DEV), layout, x.to(DEV), only.reshape(-1).numpy(), w.to(DEV)).cpu()
        assert part[1:].abs().max() == 0


def test_kernel_reads_records_at_bank_offsets():
    # a layout whose components are permuted and spaced out, like any bank the compiler may write
    # fields: H, I, stride, gate_up, gate_up_scale, gate_up_scale_2, down, down_scale, down_scale_2
    layout = RecordLayout(64, 32, 8192, 4096, 6144, 6400, 0, 1024, 1280)
    recs = random_records(layout, 3, 7)
    g = torch.Generator().manual_seed(7)  # not the global generator: the case must not depend on earlier tests
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    slots = torch.tensor([[0, 2], [1, 2]])
    w = torch.rand(2, 2, generator=g)
    ref = moe_ref(recs, layout, x, slots, w)
    got = moe_nvfp4(recs.to(DEV), layout, x.to(DEV), slots.reshape(-1).numpy(), w.to(DEV)).cpu()
    assert rel_err(got, ref) < TOL
