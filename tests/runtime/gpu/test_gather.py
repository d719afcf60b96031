"""Mode mapped's device-side miss path (`gather.py`): the plan kernel against its PyTorch reference (hits, repeated
experts, staging), the copies byte for byte, and the call's record. Without CUDA the kernels
run under Triton's interpreter (conftest.py sets TRITON_INTERPRET) on CPU tensors, the bank at its host address."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels.gather import gather_missing, plan_reference  # noqa: E402
from ft.runtime.gpu.kernels.moe_reference import moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402

from .gpu_fixtures import random_records, rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 2e-3 if CUDA else 1e-5
E, L, S, H, I = 8, 2, 5, 64, 32


def _case(seed):
    """Bank of layer 1 (E records, page-locked on CUDA); a pool of S slots + 8 staging rows where slots 0..2 hold
    layer-1 experts 4, 5, 6 and slot 3 a layer-0 expert; slot 4 empty."""
    layout = RecordLayout.packed(H, I)
    recs = random_records(layout, E, seed)
    bank = recs.clone().pin_memory() if CUDA else recs.clone()
    pool = torch.zeros(S + 8, layout.stride, dtype=torch.uint8)
    table = torch.full((L, E), -1, dtype=torch.int32)
    for slot, (layer, e) in enumerate([(1, 4), (1, 5), (1, 6), (0, 2)]):
        table[layer, e] = slot
        pool[slot] = recs[e] if layer == 1 else 7
    return layout, recs, bank, pool, table


@pytest.mark.parametrize("ids", [
    [[0, 5, 1], [1, 7, 2]],  # misses 0, 1 (twice), 7, 2 (expert 2 of layer 0 is resident, not layer 1's): staged
    [[4, 5, 6]],             # all hits: nothing copied
])
def test_plan_kernel_matches_reference_and_copies_records(ids):
    layout, recs, bank, pool, table = _case(7)
    ids = torch.tensor(ids)
    T, k = ids.shape
    P = T * k
    want_slot, want_copy = plan_reference(ids, table, 1, S)
    pool_d, table_d = pool.to(DEV), table.to(DEV)
    entry = torch.full((3, 64), -7, dtype=torch.int32, device=DEV)
    slot, copy = gather_missing(pool_d, layout, ids.to(DEV), table_d, 1, bank.data_ptr(), bank.stride(0), S,
                                entry=entry)
    assert torch.equal(slot.cpu(), want_slot) and torch.equal(copy.cpu(), want_copy)
    rec = entry.cpu()  # the call's record: ids, rows, how (what the host reads back), nothing past P written
    assert rec[0, :P].tolist() == ids.reshape(-1).tolist() and (rec[:, P:] == -7).all()
    assert torch.equal(rec[1, :P], want_slot) and torch.equal(rec[2, :P], want_copy)
    assert torch.equal(table_d.cpu(), table)  # the plan never changes the table
    if T == 2:
        assert want_slot.tolist() == [S + 0, 1, S + 2, S + 3, S + 4, S + 5]
        assert want_copy.tolist() == [1, 0, 1, 1, 1, 1]
    after = pool_d.cpu()
    for p, e in enumerate(ids.reshape(-1).tolist()):  # every pair's row now holds its record
        assert torch.equal(after[int(want_slot[p])], recs[e])
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w = torch.rand(T, k, generator=torch.Generator().manual_seed(2))
    got = moe_nvfp4_device(pool_d, layout, x.to(DEV), torch.arange(P, dtype=torch.int32, device=DEV).view(T, k),
                           slot, w.to(DEV)).cpu()
    assert rel_err(got, moe_ref(recs, layout, x, ids, w)) < TOL
    # again with the MoE kernel right behind the copy, told which pairs it copies (as mode mapped runs them: with
    # PDL the programs of the other pairs start during the copy): the same result, bit for bit
    pool_d[S:] = 0
    slot, copy = gather_missing(pool_d, layout, ids.to(DEV), table_d, 1, bank.data_ptr(), bank.stride(0), S,
                                entry=entry)
    early = moe_nvfp4_device(pool_d, layout, x.to(DEV), torch.arange(P, dtype=torch.int32, device=DEV).view(T, k),
                             slot, w.to(DEV), copied=copy).cpu()
    assert torch.equal(early, got)


def test_bad_arguments_are_refused():
    layout, recs, bank, pool, table = _case(3)
    ids = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="staging rows"):
        gather_missing(pool.to(DEV), layout, ids.to(DEV), table.to(DEV), 1, bank.data_ptr(), bank.stride(0), S + 7)
    with pytest.raises(ValueError, match="aligned"):
        gather_missing(pool.to(DEV), layout, ids.to(DEV), table.to(DEV), 1, bank.data_ptr() + 8, bank.stride(0), S)
    with pytest.raises(ValueError, match="a flag per pair"):
        moe_nvfp4_device(pool.to(DEV), layout, torch.zeros(1, H, dtype=torch.bfloat16, device=DEV), ids.to(DEV),
                         torch.zeros(E, dtype=torch.int32, device=DEV), torch.ones(1, 2, device=DEV),
                         copied=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="1..64 pairs"):
        gather_missing(pool.to(DEV), layout, torch.zeros(1, 65, dtype=torch.long).to(DEV), table.to(DEV), 1,
                       bank.data_ptr(), bank.stride(0), 0)

