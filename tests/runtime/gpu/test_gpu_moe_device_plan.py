"""Device-planned NVFP4 MoE (routing and expert -> slot lookup on the device): the kernels vs the reference and the
host-planned kernel, the device slot table vs the host one, and GpuExperts' sync-free path vs its host-planned path.
Without CUDA the Triton kernels run under the interpreter (conftest.py sets TRITON_INTERPRET before triton loads)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from ft.formats import FtwReader  # noqa: E402
from ft.runtime.gpu.device_path import MAX_DEVICE_PAIRS, moe_device_ref  # noqa: E402
from ft.runtime.gpu.expert_cache import ExpertCache  # noqa: E402
from ft.runtime.gpu.graphs import graph_ready  # noqa: E402
from ft.runtime.gpu.host_plan import moe_nvfp4  # noqa: E402
from ft.runtime.gpu.kernels.moe_reference import moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_decode import check_resident, moe_nvfp4_device  # noqa: E402
from ft.runtime.gpu.offload_config import OffloadConfig  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402
from ft.runtime.gpu.store import GpuExperts  # noqa: E402

from .gpu_fixtures import moe_calls, random_records, rel_err, still_pinning, tiny_moe_ftw  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
TOL = 2e-3 if CUDA else 1e-5  # as in test_gpu_moe_kernel.py: exact up to fp32 summation order on the interpreter
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _case(H, I, T, k, seed, *, E=9, dead=False):
    """Records in S = E + 2 slots, a random expert -> slot table; tokens share experts (the last repeats the first)."""
    layout = RecordLayout.packed(H, I)
    S = E + 2
    recs = random_records(layout, S, seed)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 1:
        ids[-1] = ids[0]
    table = torch.randperm(S, generator=g)[:E].to(torch.int32)
    if dead:  # a routed expert without a slot (must contribute nothing and never be read)
        table[ids[0, 0]] = -1
    w = torch.rand(T, k, generator=g) + 0.1
    return layout, recs, x, ids, table, w


# T, k, H, I, combine, blocks: odd tile counts (96 = 3 x 32) and partial N tiles (96 rows in tiles of 64)
CASES = [
    (1, 8, 64, 32, "pairs", None),
    (1, 2, 96, 96, "tokens", None),
    (2, 5, 96, 64, "pairs", {"BLOCK_N_GU": 64, "BLOCK_N_D": 64}),
    (4, 3, 64, 96, "tokens", {"BLOCK_N_GU": 64, "BLOCK_N_D": 64, "BLOCK_K": 64}),
    (4, 2, 96, 96, "pairs", None),
]


@pytest.mark.parametrize("T,k,H,I,combine,blocks", CASES)
def test_device_kernel_matches_reference_and_host_kernel(T, k, H, I, combine, blocks):
    seed = T * 10 + k
    layout, recs, x, ids, table, w = _case(H, I, T, k, seed, dead=(T == 2))
    slots = table.long()[ids]
    ref = moe_ref(recs, layout, x, slots, w)
    host = moe_nvfp4(recs.to(DEV), layout, x.to(DEV), slots.reshape(-1).numpy(), w.to(DEV)).cpu()
    got = moe_nvfp4_device(recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV),
                           blocks=blocks, combine=combine).cpu()
    assert got.dtype == torch.float32 and got.shape == (T, H) and torch.isfinite(got).all()
    assert rel_err(got, ref) < TOL
    assert rel_err(got, host) < TOL
    assert rel_err(moe_device_ref(recs, layout, x, ids, table, w), ref) == 0.0


def test_dead_pairs_contribute_exactly_zero():
    layout, recs, x, ids, table, w = _case(64, 32, 2, 2, 3)
    table[ids[0]] = -1  # every pair of token 0 is dead; token 1 (same experts) too
    got = moe_nvfp4_device(recs.to(DEV), layout, x.to(DEV), ids.to(DEV), table.to(DEV), w.to(DEV)).cpu()
    assert got.abs().max() == 0


def test_bad_inputs_refused():
    layout, recs, x, ids, table, w = _case(64, 32, 1, 2, 4)
    with pytest.raises(ValueError, match="slot_row int32"):
        moe_nvfp4_device(recs, layout, x, ids, table.long(), w)
    with pytest.raises(ValueError, match=r"\[T=1, k\]"):
        moe_nvfp4_device(recs, layout, x, ids, table, w[:, :1])
    with pytest.raises(ValueError, match="unknown combine"):
        moe_nvfp4_device(recs, layout, x, ids, table, w, combine="atomic")
    check_resident(ids, table)  # all routed experts have slots
    table[ids[0, 1]] = -1
    with pytest.raises(ValueError, match="not resident"):
        check_resident(ids, table)


# ---- the device slot table ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_device_table_mirrors_host_after_random_admit_evict(device):
    rng = np.random.default_rng(0)
    c = ExpertCache(3, 6, 7, policy="lru-freq")
    dt = c.device_table(device)
    assert c.device_table(device) is dt
    ptr, syncs = dt.tensor.data_ptr(), 0
    for step in range(300):
        op = rng.integers(4)
        if op == 0:
            c.tick()
        elif op == 1:
            layer, e = int(rng.integers(3)), int(rng.integers(6))
            if c.slot_of[layer, e] < 0:
                c.admit(layer, e)
        elif op == 2:
            c.evict(int(rng.integers(7)))
        else:
            c.touch(rng.integers(0, 7, 2))
        if step % 7 == 0:
            was_dirty = dt.dirty
            syncs += was_dirty
            t = dt.sync()
            assert dt.uploads == syncs and not dt.dirty
            assert t.dtype == torch.int32 and t.data_ptr() == ptr  # same storage: CUDA graphs may hold it
            assert np.array_equal(t.cpu().numpy(), c.slot_of)
            assert torch.equal(dt.row(1).cpu(), torch.from_numpy(c.slot_of[1]).to(torch.int32))
            dt.sync()
            assert dt.uploads == syncs  # nothing changed: no upload
    assert 0 < syncs < 300 // 7 + 1
    c.tick()
    s, _ = c.admit(*map(int, np.argwhere(c.slot_of < 0)[0]))
    assert dt.dirty
    dt.sync()
    c.evict(s)
    assert dt.dirty and dt.sync()[c.slot_of == s].numel() == 0
    c.evict(s)  # evicting an empty slot changes nothing
    assert not dt.dirty


# ---- GpuExperts: the sync-free path vs the host-planned one ---------------------------------------------------
E, K, H = 8, 2, 64


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return FtwReader(tiny_moe_ftw(tmp_path_factory.mktemp("devplan") / "m.ftw", experts=E, top_k=K, hidden=H))


def _calls(tokens, seed):
    return moe_calls(tokens, seed, experts=E, top_k=K, hidden=H)


def _pair(reader, **kw):
    opts = OffloadConfig(mode="resident")
    new = GpuExperts(reader, opts, device="cpu", device_plan=True, **kw)
    old = GpuExperts(reader, opts, device="cpu", device_plan=False, **kw)
    return new, old


def test_resident_device_path_equals_host_path(reader):
    new, old = _pair(reader)
    tokens = (1, 2, 4, 3, 1, 2, 1, MAX_DEVICE_PAIRS // K + 1)  # the last (layer 1) is past the device path's bound
    for layer, x, ids, w in _calls(tokens, seed=7):
        planned = new.uses_device_plan(layer, x.shape[0])
        assert planned == (x.shape[0] * K <= MAX_DEVICE_PAIRS)
        assert not old.uses_device_plan(layer, x.shape[0])
        y_new, y_old = new(layer, x, ids, w), old(layer, x, ids, w)
        assert y_new.dtype == x.dtype
        if planned:  # the same reference on the same slots, gathered on the device vs looked up on the host
            assert torch.equal(y_new, y_old)
        else:  # both took the host-planned path
            assert rel_err(y_new.float(), y_old.float()) < 1e-6
    a, b = new.stats(), old.stats()
    for key in ("calls", "tokens", "pairs"):
        assert a[key] == b[key]
    assert b["hits"] > a["hits"] > 0  # the device path counts no hits; the big call did
    assert new.cache.device_table(new.device).uploads == 1  # uploaded once at allocate, never dirty after
    new.close()
    old.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_resident_device_kernel_equals_host_kernel_interpreted(reader):
    new, old = _pair(reader, interpret=True)
    bank = reader.bank("layers.0.mlp.experts")
    layout = RecordLayout.from_bank(bank, H, 32)
    for layer, x, ids, w in _calls((1, 2, 4), seed=8):
        assert new.uses_device_plan(layer, x.shape[0])
        recs = torch.stack([reader.bank(f"layers.{layer}.mlp.experts").record(e) for e in range(E)])
        ref = moe_ref(recs, layout, x, ids, w)
        y_new, y_old = new(layer, x, ids, w), old(layer, x, ids, w)
        assert rel_err(y_new.float(), y_old.float()) < 1e-2  # bf16 outputs
        assert rel_err(y_new.float(), ref) < 1e-2
    new.close()
    old.close()


@pytest.mark.parametrize("b_cpu", [1e7, 1.0])  # the CPU takes a share / only what finds no free slot
def test_host_planned_decode_uses_the_device_kernel_through_the_updated_table(reader, b_cpu):
    # 3 slots for 3 layers x 8 experts: most calls miss, fetch and evict, so the table changes between calls; some
    # misses go to the CPU (they have no slot: the device kernel must leave them out)
    opts = OffloadConfig(num_slots=3, adapt=False, b_pcie=1e9, b_cpu=b_cpu, cpu_fixed_s=0.0)
    new = GpuExperts(reader, opts, device="cpu", device_plan=True)
    old = GpuExperts(reader, opts, device="cpu", device_plan=False)
    new.allocate()
    still_pinning(new)  # no bank read in place yet: every call brings its routing to the host
    tokens = (1, 2, 1, 4, 1, 3, 1, 2, MAX_DEVICE_PAIRS // K + 1)
    for layer, x, ids, w in _calls(tokens, seed=21):
        assert not new.uses_device_plan(layer, x.shape[0])
        y_new, y_old = new(layer, x, ids, w), old(layer, x, ids, w)
        assert rel_err(y_new.float(), y_old.float()) < 1e-6
    a, b = new.stats(), old.stats()
    for key in ("calls", "hits", "misses", "fetched", "cpu_experts"):
        assert a[key] == b[key]  # same decisions; only the GPU share's kernel differs
    assert a["fetched"] > 0 and a["cpu_experts"] > 0  # b_cpu 1: misses beyond the free slots go to the CPU
    assert new.cache.device_table(new.device).uploads > 3  # re-uploaded after admits
    assert old.cache.device_table(old.device).uploads == 0  # the host-planned kernel never reads it
    new.close()
    old.close()


def test_offloaded_decode_equals_resident_decode_exactly(reader):
    """Host-planned calls with no CPU share and a resident model compute the same pairs with the same kernel and
    summation order, whichever slots the experts occupy: greedy tokens cannot diverge between them."""
    res = GpuExperts(reader, OffloadConfig(mode="resident"), device="cpu", device_plan=True)
    off = GpuExperts(reader, OffloadConfig(num_slots=4, b_cpu=1.0), device="cpu", device_plan=True)
    off.allocate()
    still_pinning(off)
    for layer, x, ids, w in _calls((1, 1, 2, 1, 2, 1, 1, 2), seed=22):  # <= 4 experts per call: all fit the slots
        assert torch.equal(off(layer, x, ids, w), res(layer, x, ids, w))
    assert off.stats()["fetched"] > 0 and off.stats()["cpu_experts"] == 0
    res.close()
    off.close()


@pytest.mark.parametrize("broken", ["wrong", "raises"])
def test_first_call_falls_back_when_the_kernel_is_wrong_or_fails(reader, broken):
    """The first device-planned call checks the kernel against the host-planned path; a bad one turns it off."""
    from ft.runtime.gpu import device_path

    new, old = _pair(reader)
    new.allocate()
    layer, x, ids, w = next(_calls((2,), seed=11))

    def kernel(pool, layout, x, topk_ids, row, weights):
        if broken == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        return torch.zeros(x.shape[0], x.shape[1])

    row = new.cache.device_table(new.device).row(layer)
    y = device_path._first_call(new, x, ids, row, w, kernel)
    assert not new.device_plan and not new.uses_device_plan(layer, 2)
    assert torch.equal(y.to(x.dtype), old(layer, x, ids, w))  # the host-planned result, as the caller casts it
    new.close()
    old.close()


def test_first_call_keeps_a_correct_kernel(reader):
    from ft.runtime.gpu import device_path

    new, _ = _pair(reader)
    new.allocate()
    layer, x, ids, w = next(_calls((2,), seed=12))
    row = new.cache.device_table(new.device).row(layer)
    y = device_path._first_call(new, x, ids, row, w, device_path.moe_device_ref)
    assert new.device_plan and device_path.moe_device_ref in new._checked_kernels
    assert torch.equal(y, device_path.moe_device_ref(new.pool, new.layout, x, ids, row, w))
    new.close()


# ---- CUDA only ---------------------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_device_kernel_deterministic_and_close_to_host_kernel():
    for T, k in [(1, 8), (4, 8), (8, 8), (3, 5)]:
        layout, recs, x, ids, table, w = _case(256, 128, T, k, T + k, E=32)
        slots = table.long()[ids]
        args = (recs.cuda(), layout, x.cuda(), ids.cuda(), table.cuda(), w.cuda())
        a, b = moe_nvfp4_device(*args), moe_nvfp4_device(*args)
        assert torch.equal(a, b)
        host = moe_nvfp4(recs.cuda(), layout, x.cuda(), slots.reshape(-1).numpy(), w.cuda())
        assert rel_err(a.cpu(), host.cpu()) < TOL
        assert rel_err(moe_nvfp4_device(*args, combine="tokens").cpu(), a.cpu()) < 1e-5


@needs_cuda
def test_cuda_resident_call_is_sync_free_and_capturable(reader):
    ex = GpuExperts(reader, OffloadConfig(mode="resident"), device="cuda")
    ex.allocate()
    layer, x, ids, w = next(_calls((2,), seed=9))
    x, ids, w = x.cuda(), ids.cuda(), w.cuda()
    assert graph_ready(ex, 2) and not graph_ready(ex, MAX_DEVICE_PAIRS)
    eager = ex(layer, x, ids, w)  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = ex(layer, x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ex(layer, x, ids, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ex.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_decode_bench_rows_check_out(monkeypatch):
    # the GPU benchmark's own code path at a tiny shape: every row's check must pass (timing stubbed)
    import kernel_bench  # tools/kernel_bench.py (conftest puts tools/ on the path)

    monkeypatch.setattr(kernel_bench, "_time_ms", lambda fn: 1.0)
    rows = kernel_bench.bench_decode_device(hidden=64, inter=32, num_experts=6, top_k=3, tokens=(2,),
                                            configs=({"BLOCK_N_GU": 32, "BLOCK_N_D": 64, "BLOCK_K": 64,
                                                      "num_warps": 4},), device="cpu")
    assert [r["path"] for r in rows] == ["host+sync", "device/pairs", "device/tokens", "device/mapped",
                                         "device/gather+compute", "device/gather"]
    assert all(r["rel_err"] < TOL for r in rows if "rel_err" in r) and all(r["ms"] == 1.0 for r in rows)
