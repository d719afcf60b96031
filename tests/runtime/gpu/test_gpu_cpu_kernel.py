"""CPU NVFP4 expert kernel (C, AVX-512 and portable builds) vs the PyTorch reference."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from ft.runtime.gpu.cpu.kernel import CpuMoe, parallel_copy
from ft.runtime.gpu.kernels.moe_reference import moe_ref
from ft.runtime.gpu.record_layout import RecordLayout

from .gpu_fixtures import random_records, rel_err

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


def _groups(slots: torch.Tensor):
    """slots [T, k] -> (unique slots, group pair-index lists, pair_tok, pair_w placeholder)"""
    flat = slots.reshape(-1).numpy()
    uniq = np.unique(flat[flat >= 0])
    groups = [np.nonzero(flat == s)[0] for s in uniq]
    pair_tok = np.arange(flat.size) // slots.shape[1]
    return uniq, groups, pair_tok


@needs_cc
@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)])
@pytest.mark.parametrize("T,k,seed", [(1, 4, 0), (3, 2, 1), (9, 3, 2)])
def test_c_kernel_matches_reference(flags, T, k, seed):
    layout = RecordLayout.packed(hidden=64, inter=32)
    recs = random_records(layout, 5, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 64, generator=g)
    slots = torch.stack([torch.randperm(5, generator=g)[:k] for _ in range(T)])
    slots[0, 0] = -1  # computed elsewhere
    w = torch.rand(T, k, generator=g)
    uniq, groups, pair_tok = _groups(slots)
    moe = CpuMoe(layout, threads=2, backend="c", extra_flags=flags)
    assert moe.backend == ("c" if flags else moe.backend)
    got = moe([recs[s] for s in uniq], groups, pair_tok, w.reshape(-1).numpy(), x)
    ref = moe_ref(recs, layout, x.bfloat16(), slots, w)
    assert rel_err(got, ref) < 1e-5
    # thread count does not change the result
    moe1 = CpuMoe(layout, threads=1, backend="c", extra_flags=flags)
    assert torch.equal(moe1([recs[s] for s in uniq], groups, pair_tok, w.reshape(-1).numpy(), x), got)


def test_torch_backend_matches_reference():
    layout = RecordLayout.packed(hidden=64, inter=32)
    recs = random_records(layout, 3, 4)
    x = torch.randn(2, 64)
    slots = torch.tensor([[0, 2], [2, 1]])
    w = torch.rand(2, 2)
    uniq, groups, pair_tok = _groups(slots)
    got = CpuMoe(layout, backend="torch")([recs[s] for s in uniq], groups, pair_tok, w.reshape(-1).numpy(), x)
    assert rel_err(got, moe_ref(recs, layout, x.bfloat16(), slots, w)) < 1e-5


@needs_cc
def test_parallel_copy_is_exact():
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros(4 << 20, dtype=torch.uint8)
    parallel_copy(dst, src, threads=2)
    assert torch.equal(dst[: src.numel()], src) and dst[src.numel():].eq(0).all()


def test_bad_backend_refused():
    with pytest.raises(ValueError, match="supported: auto, c, torch"):
        CpuMoe(RecordLayout.packed(64, 32), backend="gpu")


@needs_cc
def test_submit_runs_the_same_kernel_on_the_native_worker():
    layout = RecordLayout.packed(hidden=64, inter=32)
    recs = random_records(layout, 6, 3)
    g = torch.Generator().manual_seed(3)
    moe = CpuMoe(layout, threads=2, backend="c")
    for T, k in ((1, 3), (4, 2)):
        x = torch.randn(T, 64, generator=g)
        slots = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(T)])
        uniq, groups, pair_tok = _groups(slots)
        w = torch.rand(T, k, generator=g).reshape(-1).numpy()
        args = ([recs[int(s)] for s in uniq], groups, pair_tok, w, x)
        job = moe.submit(*args)
        again = moe.submit(*args)  # one job at a time: this waits for the first, whose result stays as it was
        y, seconds = job.result()
        assert torch.equal(y, moe(*args)) and seconds > 0
        assert torch.equal(again.result()[0], y) and again.result()[0] is not y
        assert job.result()[0] is y  # a second result() does not wait again
    moe.close()
    y, _ = moe.submit(*args).result()  # a new worker after close
    assert torch.equal(y, moe(*args))
    moe.close()
