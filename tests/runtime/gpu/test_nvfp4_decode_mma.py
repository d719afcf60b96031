"""The tensor-core NVFP4 decode MoE (`nvfp4_decode_mma.py`) against the exact reference and the FMA kernels:
shared experts between tokens (one program owns them), dead pairs, mapped reads, odd tile counts. Without CUDA the
kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET before triton loads)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels.moe_reference import moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode_mma import moe_nvfp4_mma  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402

from .gpu_fixtures import random_records, rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 2e-3 if CUDA else 1e-5  # exact up to fp32 summation order on the interpreter; bf16 act rounding flips on GPU


def _case(H, I, T, k, seed, *, E=9, dead=False, shared=True):
    layout = RecordLayout.packed(H, I)
    S = E + 2
    recs = random_records(layout, S, seed)
    g = torch.Generator().manual_seed(300 + seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if shared and T > 1:
        ids[-1] = ids[0][torch.randperm(k, generator=g)]  # the last token routes to the first one's experts
    table = torch.randperm(S, generator=g)[:E].to(torch.int32)
    if dead:
        table[ids[0, 0]] = -1
    w = torch.rand(T, k, generator=g) + 0.1
    return layout, recs, x, ids, table, w


# T, k, H, I, blocks: several K steps (BK 32 over H 96), partial N tiles, one token, T not a power of two
CASES = [
    (1, 8, 64, 32, {"BN_GU": 16, "BN_D": 32, "BK_GU": 32, "BK_D": 32}),
    (3, 2, 96, 64, {"BN_GU": 16, "BN_D": 64, "BK_GU": 32, "BK_D": 64}),
    (4, 3, 64, 96, {"BN_GU": 64, "BN_D": 16, "BK_GU": 64, "BK_D": 32}),
    (8, 4, 64, 64, None),
]


@pytest.mark.parametrize("T,k,H,I,blocks", CASES)
def test_mma_kernel_matches_reference_and_fma_kernel(T, k, H, I, blocks):
    layout, recs, x, ids, table, w = _case(H, I, T, k, T * 7 + k, dead=(T == 3))
    ref = moe_ref(recs, layout, x, table.long()[ids], w)
    args = (recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV))
    got = moe_nvfp4_mma(*args, blocks=blocks).cpu()
    assert got.dtype == torch.float32 and got.shape == (T, H) and torch.isfinite(got).all()
    assert rel_err(got, ref) < TOL
    assert rel_err(got, moe_nvfp4_device(*args).cpu()) < TOL
    assert torch.equal(moe_nvfp4_mma(*args, blocks=blocks).cpu(), got)  # deterministic
    bf = moe_nvfp4_mma(*args, blocks=blocks, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.cpu(), got.to(torch.bfloat16))


def test_every_token_of_a_shared_expert_gets_its_row():
    # all tokens route to the same k experts in different orders: one program per expert serves all of them
    layout, recs, x, ids, table, w = _case(64, 32, 4, 3, 5)
    ids[:] = ids[0]
    ids[1] = ids[1].flip(0)
    ref = moe_ref(recs, layout, x, table.long()[ids], w)
    got = moe_nvfp4_mma(recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV)).cpu()
    assert rel_err(got, ref) < TOL
    assert (got.abs().amax(1) > 0).all()


def test_dead_pairs_contribute_exactly_zero():
    layout, recs, x, ids, table, w = _case(64, 32, 2, 2, 3, shared=True)
    table[ids[0]] = -1  # every expert of token 0 (and of token 1, which shares them) has no slot
    got = moe_nvfp4_mma(recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV)).cpu()
    assert got.abs().max() == 0


def test_mapped_records_are_read_from_the_bank():
    layout, recs, x, ids, table, w = _case(64, 32, 3, 2, 9, E=6)
    bank = recs[:6].clone()
    if CUDA:
        bank = bank.pin_memory()
    table = torch.full((6,), -1, dtype=torch.int32)
    table[ids[0, 0]] = 1  # one expert resident (pool slot 1 holds it), the others read from the bank
    pool = random_records(layout, 2, 99)
    pool[1] = recs[ids[0, 0]]
    ref = moe_ref(recs, layout, x, ids, w)
    got = moe_nvfp4_mma(pool.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV),
                        host_base=bank.data_ptr(), host_stride=layout.stride).cpu()
    assert rel_err(got, ref) < TOL


def test_bad_arguments_are_refused():
    layout, recs, x, ids, table, w = _case(64, 96, 1, 2, 4)
    with pytest.raises(ValueError, match="unknown MMA block keys"):
        moe_nvfp4_mma(recs, layout, x, ids, table, w, blocks={"BLOCK_N": 4})
    with pytest.raises(ValueError, match="BK_D 48 must be a power of two"):
        moe_nvfp4_mma(recs, layout, x, ids, table, w, blocks={"BK_D": 48})
    with pytest.raises(ValueError, match="16-byte aligned"):
        moe_nvfp4_mma(recs, layout, x, ids, table, w, host_base=8, host_stride=layout.stride)
