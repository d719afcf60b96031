"""Mapped ("zero-copy") reads in the device-planned NVFP4 decode kernel: a pair whose expert has no slot reads the
record from the layer's bank at host_base + e * host_stride. Without CUDA the kernels run under Triton's interpreter
(conftest.py sets TRITON_INTERPRET before triton loads) and the bank is a plain CPU tensor; with CUDA the bank is
pinned and its mapped device pointer is passed."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels.moe_reference import moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402

from .gpu_fixtures import random_records, rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 2e-3 if CUDA else 1e-5  # as in test_gpu_moe_device_plan.py


def _bank_case(H, I, T, k, seed, *, E=8, resident=3, pad=0):
    """Bank u8 [E, stride + pad] holding every expert; a pool of `resident + 1` slots holding `resident` of them in
    permuted slots (one slot spare, filled with other random bytes); slot_row -1 for the rest. Every token routes to
    at least one expert without a slot."""
    layout = RecordLayout.packed(H, I)
    g = torch.Generator().manual_seed(200 + seed)
    recs = random_records(layout, E, seed)
    bank = torch.zeros(E, layout.stride + pad, dtype=torch.uint8)
    bank[:, : layout.stride] = recs
    if CUDA:
        bank = bank.pin_memory()
    experts = torch.randperm(E, generator=g)[:resident]
    slots = torch.randperm(resident + 1, generator=g)[:resident]
    pool = random_records(layout, resident + 1, seed + 1000)  # the spare slot holds garbage: must never be read
    pool[slots] = recs[experts]
    table = torch.full((E,), -1, dtype=torch.int32)
    table[experts] = slots.to(torch.int32)
    missing = torch.nonzero(table < 0).flatten()
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    rows = []
    for t in range(T):  # k distinct experts, the t-th missing one among them at a random position
        m = missing[t % missing.numel()]
        others = torch.tensor([e for e in torch.randperm(E, generator=g).tolist() if e != m][: k - 1])
        rows.append(torch.cat([m[None], others])[torch.randperm(k, generator=g)])
    ids = torch.stack(rows)
    w = torch.rand(T, k, generator=g) + 0.1
    return layout, recs, bank, pool, table, x, ids, w


def _host_base(bank):
    # CPU: any host address (the interpreter dereferences it). CUDA: pinned memory under UVA is mapped at the same
    # address on the device
    return bank.data_ptr()


def _run(layout, pool, table, x, ids, w, **kw):
    return moe_nvfp4_device(pool.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV), **kw).cpu()


# T, k, H, I, combine, blocks: partial N tiles (96 rows in tiles of 64) and BLOCK_K below the reduction dims
CASES = [
    (1, 4, 64, 32, "pairs", None),
    (2, 3, 96, 64, "tokens", {"BLOCK_N_GU": 64, "BLOCK_N_D": 64}),
    (3, 2, 64, 96, "pairs", {"BLOCK_N_GU": 64, "BLOCK_N_D": 64, "BLOCK_K": 64}),
    (2, 4, 96, 96, "tokens", None),
]


@pytest.mark.parametrize("T,k,H,I,combine,blocks", CASES)
def test_mapped_pairs_equal_a_fully_resident_pool(T, k, H, I, combine, blocks):
    layout, recs, bank, pool, table, x, ids, w = _bank_case(H, I, T, k, T * 10 + k)
    full = torch.arange(recs.shape[0], dtype=torch.int32)  # every expert resident, slot = expert id
    ref = moe_ref(recs, layout, x, ids, w)
    want = _run(layout, recs, full, x, ids, w, blocks=blocks, combine=combine)
    got = _run(layout, pool, table, x, ids, w, blocks=blocks, combine=combine,
               host_base=_host_base(bank), host_stride=bank.stride(0))
    assert got.shape == (T, H) and torch.isfinite(got).all() and got.abs().max() > 0
    assert rel_err(got, ref) < TOL
    if not CUDA:  # same kernel, same pairs, same summation order: only the record addresses differ
        assert torch.equal(got, want)
    else:
        assert rel_err(got, want) < 1e-6
    # unmapped, the pairs without a slot drop out: the partial sum over the resident pairs only, far from the full one
    part = _run(layout, pool, table, x, ids, w, blocks=blocks, combine=combine)
    live = table.long()[ids] >= 0
    assert rel_err(part, moe_ref(recs, layout, x, ids, w * live)) < TOL
    assert rel_err(part, ref) > 0.05


@pytest.mark.parametrize("combine", ["pairs", "tokens"])
def test_mapped_with_padded_bank_stride_and_no_resident_expert(combine):
    # host_stride larger than the pool's record stride; an empty table (all pairs mapped), the pool never read
    layout, recs, bank, pool, table, x, ids, w = _bank_case(64, 32, 2, 3, 5, resident=0, pad=4096)
    assert bank.stride(0) == layout.stride + 4096 and (table < 0).all()
    got = _run(layout, pool, table, x, ids, w, combine=combine, host_base=_host_base(bank), host_stride=bank.stride(0))
    assert rel_err(got, moe_ref(recs, layout, x, ids, w)) < TOL


def test_bad_host_base_or_stride_refused():
    layout, recs, bank, pool, table, x, ids, w = _bank_case(64, 32, 1, 2, 6)
    base = _host_base(bank)
    extent = max(getattr(layout, "off_" + c) + layout.nbytes(c)
                 for c in ("gate_up", "gate_up_scale", "gate_up_scale_2", "down", "down_scale", "down_scale_2"))
    for hb, hs in [(base, 0), (base, extent - 16), (base, -layout.stride), (-base, layout.stride),
                   (base + 8, layout.stride), (base, layout.stride + 8), (0, -1)]:
        with pytest.raises(ValueError, match="host_"):
            _run(layout, pool, table, x, ids, w, host_base=hb, host_stride=hs)
    _run(layout, pool, table, x, ids, w, host_base=base, host_stride=(extent + 15) // 16 * 16)  # the minimum: fine

