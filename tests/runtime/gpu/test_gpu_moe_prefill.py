"""Device-planned NVFP4 prefill: the torch-built block plan (every pair once, one expert per block, padding and dead
pairs handled), the tile kernels over it vs the reference and the host-planned call, GpuExperts' resident prefill
path, and the benchmark's own code at a tiny shape. Without CUDA the Triton kernels run under the interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.formats import FtwReader  # noqa: E402
from ft.runtime.gpu.device_path import uses_device_prefill  # noqa: E402
from ft.runtime.gpu.host_plan import moe_nvfp4, plan_blocks  # noqa: E402
from ft.runtime.gpu.kernels.moe_reference import moe_ref  # noqa: E402
from ft.runtime.gpu.kernels.nvfp4_triton import TILE_CONFIGS, moe_blocks, pick_blocks  # noqa: E402
from ft.runtime.gpu.offload_config import OffloadConfig  # noqa: E402
from ft.runtime.gpu.prefill_plan import max_blocks, moe_nvfp4_prefill, plan_blocks_device  # noqa: E402
from ft.runtime.gpu.record_layout import RecordLayout  # noqa: E402
from ft.runtime.gpu.store import GpuExperts  # noqa: E402

from .gpu_fixtures import moe_calls, random_records, rel_err, tiny_moe_ftw  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
TOL = 2e-3 if CUDA else 1e-5  # the interpreter's dots are exact fp32: only the summation order differs
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TINY = {"BLOCK_N_GU": 32, "BLOCK_N_D": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}


def _routing(T, k, E, seed, *, skew=False):
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1).double() ** (1.5 if skew else 0.0)
    return torch.stack([torch.multinomial(p, k, generator=g) for _ in range(T)])


# ---- the plan ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,k,E,bm,dead,skew", [(1, 1, 4, 16, 0, False), (37, 4, 9, 16, 2, False),
                                                (50, 3, 6, 32, 0, True), (64, 8, 16, 64, 3, True),
                                                (5, 2, 40, 16, 0, False)])
def test_device_plan_covers_each_pair_once_in_single_expert_blocks(T, k, E, bm, dead, skew):
    ids = _routing(T, k, E, seed=T + E, skew=skew)
    g = torch.Generator().manual_seed(E)
    row = (torch.randperm(3 * E, generator=g)[:E]).to(torch.int32)  # slots in no particular order
    row[torch.randperm(E, generator=g)[:dead]] = -1
    sp, bs = plan_blocks_device(ids, row, bm)
    P = T * k
    nb = max_blocks(P, E, bm)
    assert sp.dtype == bs.dtype == torch.int32 and sp.shape == (nb * bm,) and bs.shape == (nb,)
    live = sp[sp < P]
    assert sorted(live.tolist()) == list(range(P)) and int((sp > P).sum()) == 0  # each pair once, else sentinel
    flat = ids.reshape(-1)
    for b in range(nb):
        rows = sp[b * bm:(b + 1) * bm]
        n = int((rows < P).sum())
        assert bool((rows[:n] < P).all()) and bool((rows[n:] == P).all())  # live rows first, then padding
        assert rows[:n].tolist() == sorted(rows[:n].tolist())  # stable: a pure function of the routing
        if n == 0:
            assert bs[b] == -1  # an unused block: skipped by both kernels
            continue
        experts = set(flat[rows[:n].long()].tolist())
        assert len(experts) == 1 or bs[b] == -1  # one expert per block, except the block of pairs without a slot
        slots = set(row[flat[rows[:n].long()]].tolist())
        assert slots == {int(bs[b])}  # the block's slot is its pairs' (-1: pairs without a slot)
    used = int((bs >= 0).sum())
    assert used == sum(-(-int((flat == e).sum()) // bm) for e in range(E) if row[e] >= 0)


def test_device_plan_equals_host_plan_when_slots_ascend():
    ids = _routing(30, 4, 7, seed=3, skew=True)
    row = torch.arange(7, dtype=torch.int32) * 2 + 1
    sp, bs = plan_blocks_device(ids, row, 16)
    hsp, hbs = plan_blocks(row.long()[ids].reshape(-1).numpy(), 16)
    n = len(hbs)
    assert bs[:n].tolist() == hbs.tolist() and bool((bs[n:] == -1).all())
    assert sp[:n * 16].tolist() == hsp.tolist() and bool((sp[n * 16:] == ids.numel()).all())


def test_block_bound_is_reached():
    # every expert gets BM + 1 pairs: two blocks each, the second holding one row (the bound's worst case shape)
    E, bm = 5, 4
    ids = torch.arange(E).repeat_interleave(bm + 1).view(-1, 1)
    sp, bs = plan_blocks_device(ids, torch.arange(E, dtype=torch.int32), bm)
    assert int((bs >= 0).sum()) == 2 * E <= max_blocks(ids.numel(), E, bm) == len(bs)


# ---- kernels over the device plan ----------------------------------------------------------------------------------
def _case(H, I, T, k, E, seed, dead=0, skew=False):
    layout = RecordLayout.packed(H, I)
    recs = random_records(layout, E + 2, seed)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = _routing(T, k, E, seed, skew=skew)
    row = torch.randperm(E + 2, generator=g)[:E].to(torch.int32)
    if dead:
        row[ids[0, :dead]] = -1  # routed experts without a slot: they contribute nothing
    w = torch.rand(T, k, generator=g) + 0.1
    return layout, recs, x, ids, row, w


CASES = [  # H, I, T, k, E, dead, skew, blocks
    (64, 32, 24, 2, 6, 0, False, {**TINY, "BLOCK_M": 16}),
    (64, 64, 33, 3, 5, 1, True, {**TINY, "BLOCK_M": 32, "BLOCK_K": 64}),
    (96, 32, 20, 4, 7, 2, False, {**TINY, "BLOCK_M": 16, "SWAP": 1}),
    (64, 32, 40, 2, 4, 0, True, {**TINY, "BLOCK_M": 64, "BLOCK_N_D": 64, "SWAP": 1}),
    (64, 32, 17, 2, 6, 0, False, None),  # pick_blocks' choice
]


@pytest.mark.parametrize("H,I,T,k,E,dead,skew,blocks", CASES)
def test_prefill_kernel_matches_reference_and_host_plan(H, I, T, k, E, dead, skew, blocks):
    layout, recs, x, ids, row, w = _case(H, I, T, k, E, seed=T + H, dead=dead, skew=skew)
    slots = row.long()[ids]
    ref = moe_ref(recs, layout, x, slots, w)
    d = lambda t: t.to(DEV)  # noqa: E731
    got = moe_nvfp4_prefill(d(recs), layout, d(x), d(ids), d(row), d(w), blocks=blocks).cpu()
    assert got.dtype == torch.float32 and got.shape == (T, H) and torch.isfinite(got).all()
    assert rel_err(got, ref) < TOL
    b = blocks or pick_blocks(T * k / E, H, I)
    host = moe_nvfp4(d(recs), layout, d(x), slots.reshape(-1).numpy(), d(w), blocks=b).cpu()
    assert rel_err(got, host) < 1e-6  # the same kernels and tiles: each pair's row computed alike


@pytest.mark.parametrize("swap", [0, 1])
def test_padding_and_dead_pairs_never_read_nor_written(swap):
    """x, weights and out are views into larger buffers whose neighbouring rows are NaN canaries; the slot-(-1) record
    (the pool row before slot 0) has NaN scale_2: a read of padding, of a dead pair's record or a write past the pair
    rows would show as NaN or a changed canary."""
    H, I, T, k, E = 64, 32, 21, 2, 5
    layout, recs, x, ids, row, w = _case(H, I, T, k, E, seed=9, dead=1)
    row[ids[1, 0]] = -1
    poison = torch.full((1, layout.stride), 0xFF, dtype=torch.uint8)  # fp32 scale_2 bytes 0xFFFFFFFF = NaN
    pool = torch.cat([poison, recs]).to(DEV)[1:]
    xs = torch.cat([x, torch.full((1, H), float("nan"))]).to(torch.bfloat16).to(DEV)
    P = T * k
    ws = torch.cat([w.reshape(-1), torch.tensor([float("nan")])]).to(DEV)
    outs = torch.full((P + 3, H), 7.0, device=DEV)
    blocks = {**TINY, "BLOCK_M": 16, "SWAP": swap}
    sp, bs = plan_blocks_device(ids.to(DEV), row.to(DEV), 16)
    moe_blocks(pool, layout, xs[:T], k, sp, bs, ws[:P], outs[:P], blocks)
    got = outs[:P].cpu()
    assert torch.isfinite(got).all() and bool((outs[P:] == 7.0).all())
    dead = (row.long()[ids] < 0).reshape(-1)
    assert dead.sum() >= 2 and got[dead].abs().max() == 0  # dead pairs' rows written as 0, no record read
    ref = moe_ref(recs, layout, x, row.long()[ids], w)
    assert rel_err(got.view(T, k, H).sum(1), ref) < TOL


def test_prefill_refuses_bad_inputs():
    layout, recs, x, ids, row, w = _case(64, 32, 4, 2, 5, seed=1)
    with pytest.raises(ValueError, match="slot_row int32"):
        moe_nvfp4_prefill(recs, layout, x, ids, row.long(), w)
    with pytest.raises(ValueError, match=r"\[T=4, k\]"):
        moe_nvfp4_prefill(recs, layout, x, ids, row, w[:, :1])
    assert moe_nvfp4_prefill(recs, layout, x[:0], ids[:0], row, w[:0]).shape == (0, 64)


def test_tile_configs_are_complete_and_picked_by_rows():
    keys = {"BLOCK_M", "BLOCK_N_GU", "BLOCK_N_D", "BLOCK_K", "SWAP", "num_warps", "num_stages"}
    assert all(set(c) == keys for c in TILE_CONFIGS.values())
    sizes = [pick_blocks(r, 2048, 512)["BLOCK_M"] for r in (1, 16, 30, 64, 128, 4096)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] >= 128
    assert pick_blocks(1, 64, 32) is not pick_blocks(1, 64, 32)  # copies: callers may edit them


# ---- GpuExperts: resident prefill planned on the device ------------------------------------------------------------
E_, K_, H_ = 8, 2, 64


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return FtwReader(tiny_moe_ftw(tmp_path_factory.mktemp("prefill") / "m.ftw", experts=E_, top_k=K_, hidden=H_))


def _calls(tokens, seed):
    return moe_calls(tokens, seed, experts=E_, top_k=K_, hidden=H_)


def _experts(reader, mode, device_plan, **kw):
    return GpuExperts(reader, OffloadConfig(mode=mode, prefill_tokens=40), device="cpu", device_plan=device_plan, **kw)


def test_resident_prefill_planned_on_device_equals_host_path(reader):
    new, old = _experts(reader, "resident", True), _experts(reader, "resident", False)
    tokens = (40, 48, 40, 39, 1)  # 39 < prefill_tokens and 1 (decode) take other paths
    for layer, x, ids, w in _calls(tokens, seed=5):
        T = x.shape[0]
        on = T >= 40
        assert new.uses_device_plan(layer, T) == (T * K_ <= 64)
        assert uses_device_prefill(new, layer, T) == on and not uses_device_prefill(old, layer, T)
        y_new, y_old = new(layer, x, ids, w), old(layer, x, ids, w)
        assert y_new.dtype == x.dtype
        assert rel_err(y_new.float(), y_old.float()) < 1e-6  # the same reference on the same slots
    a, b = new.stats(), old.stats()
    for key in ("calls", "tokens", "pairs"):
        assert a[key] == b[key]
    assert a["prefill_calls"] == 3
    new.close()
    old.close()


@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_resident_prefill_kernels_interpreted(reader):
    new = _experts(reader, "resident", True, interpret=True)
    old = _experts(reader, "resident", False, interpret=True)
    bank = reader.bank("layers.1.mlp.experts")
    recs = torch.stack([bank.record(e) for e in range(E_)])
    layout = RecordLayout.from_bank(bank, H_, 32)
    for _, x, ids, w in _calls((40, 44), seed=6):
        y_new, y_old = new(1, x, ids, w), old(1, x, ids, w)
        assert new._device_prefill_ok  # the first call's check against the host-planned call passed
        assert rel_err(y_new.float(), y_old.float()) < 1e-2  # bf16 outputs
        assert rel_err(y_new.float(), moe_ref(recs, layout, x, ids, w)) < 1e-2
    assert new.stats()["prefill_calls"] == 2
    new.close()
    old.close()


def test_first_prefill_falls_back_when_the_plan_is_wrong(reader):
    from ft.runtime.gpu import device_path

    new, old = _experts(reader, "resident", True), _experts(reader, "resident", False)
    new.allocate()
    layer, x, ids, w = next(_calls((40,), seed=7))
    row = new.cache.device_table(new.device).row(layer)
    y = device_path._first_prefill(new, x, ids, row, w, lambda *a, **kw: torch.zeros(x.shape[0], H_))
    assert new._device_prefill_ok is False and not device_path.uses_device_prefill(new, layer, 40)
    assert new.uses_device_plan(layer, 1)  # decode keeps its own device path
    assert torch.equal(y.to(x.dtype), old(layer, x, ids, w))
    new.close()
    old.close()


# ---- the benchmark's own code path at a tiny shape -----------------------------------------------------------------
@pytest.mark.skipif(not INTERP, reason="needs Triton's interpreter on a machine without CUDA")
def test_bench_rows_check_out():
    path = Path(__file__).resolve().parents[3] / "tools" / "bench_moe_prefill.py"
    spec = importlib.util.spec_from_file_location("bench_moe_prefill", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.bench_rows(hidden=64, inter=32, num_experts=6, top_k=2, tokens=(24,), routings=("uniform", "zipf"),
                            configs={"tiny": {**TINY, "BLOCK_M": 16}, "tiny-swap": {**TINY, "BLOCK_M": 16, "SWAP": 1}},
                            device="cpu", time_ms=lambda fn: 1.0)
    paths = {r["path"] for r in rows}
    assert {"device", "plan", "kernels", "host+sync"} <= paths
    assert all(r["rel_err"] < TOL for r in rows if "rel_err" in r) and all(r["us"] == 1000.0 for r in rows)
    assert all(r["deterministic"] for r in rows if r["path"] == "device")


def test_kernels_build_for_sm90_without_a_gpu():
    """The interpreter runs Python, not the compiler: build the kernels for sm_90 (Triton's CUDA backend and ptxas,
    no GPU needed) in a process without TRITON_INTERPRET, for every TILE_CONFIGS entry (what `pick_blocks` can
    launch) and the swapped-operand configs, with whatever Triton is installed. Triton 3.6 failed here on the wgmma
    configs (medium, large: "Illegal shared layout" in TritonGPUOptimizeDotOperands) while 3.9 built them."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parents[3] / "tools" / "bench_moe_prefill.py"
    names = [*TILE_CONFIGS, "m32-swap", "m128-swap"]
    res = subprocess.run([sys.executable, str(tool), "--compile-only", "--configs", ",".join(names),
                          "--hidden", "256", "--inter", "128"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("config=")]
    assert len(rows) == 2 * len(names) and all("stack=0" in line for line in rows), res.stdout
    built = {line.split()[0].removeprefix("config=") for line in rows}
    assert built == set(names), res.stdout


# ---- CUDA only -----------------------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_prefill_is_sync_free_deterministic_and_matches_host_plan():
    layout, recs, x, ids, row, w = _case(256, 128, 300, 8, 32, seed=3, skew=True)
    args = (recs.cuda(), layout, x.cuda(), ids.cuda(), row.cuda(), w.cuda())
    for name, blocks in TILE_CONFIGS.items():
        a = moe_nvfp4_prefill(*args, blocks=blocks)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            b = moe_nvfp4_prefill(*args, blocks=blocks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(a, b), name
        host = moe_nvfp4(recs.cuda(), layout, x.cuda(), row.long()[ids].reshape(-1).numpy(), w.cuda(), blocks=blocks)
        assert torch.equal(a, host), name  # same kernels and tiles: bit-identical whatever the plan
        ref = moe_ref(recs, layout, x, row.long()[ids], w)
        assert rel_err(a.cpu(), ref) < TOL, name
