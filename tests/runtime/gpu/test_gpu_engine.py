"""The engine with the GPU expert scheduler (CPU emulation path): its VRAM plan, counters under stats()["moe"], the
CLI's checks; on CUDA, an engine that frees its memory when closed and keeps to its budget (the split's arithmetic:
test_sizing.py)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.gpu import engine_setup
from ft.runtime.gpu.engine_setup import _weight_bytes
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.sizing import KV_TARGET_TOKENS, LATE_OUTSIDE, dense_weight_bytes, device_in_use, state_bytes
from ft.runtime.model import load_model

GIB = 1 << 30


def test_engine_kv_budget_comes_from_the_vram_plan(ftw_for):
    ftw = ftw_for("qwen3_5_moe", "nvfp4")
    sized = Engine(ftw, EngineSettings(device="cpu", vram_budget=64 * GIB),
                   offload=OffloadConfig(mode="resident"))
    plan = sized._experts.vram_plan
    assert sized.kv.total == plan.kv_tokens == min(KV_TARGET_TOKENS, sized.config.max_position_embeddings)
    sized.close()
    given = Engine(ftw, EngineSettings(device="cpu", vram_budget=64 * GIB, kv_reserve_tokens=1000),
                   offload=OffloadConfig(mode="resident"))
    assert given.kv.total == given._experts.vram_plan.kv_tokens == 1000
    given.close()
    assert Engine(ftw, EngineSettings(device="cpu")).kv.total == 8192  # no VRAM plan: the CPU default


def _engine(ftw, offload=None, **kw):
    settings = EngineSettings(device="cpu", kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2, **kw)
    return Engine(ftw, settings, offload=offload)


def test_engine_sizes_slots_from_the_budget_and_reports_counters(ftw_for):
    ftw = ftw_for("qwen3_5_moe", "nvfp4")
    ref = _engine(ftw)
    probe = _engine(ftw, offload=OffloadConfig(num_slots=1, b_pcie=1e9, b_cpu=1e9))
    ex = probe._experts
    stride, E, L = ex.layout.stride, ex.E, len(ex.moe_layers)
    dense = _weight_bytes(probe.model)
    probe.close()
    per_token, per_seq = state_bytes(ref.config, ref.model.dtype)
    kv, fixed = 256 * per_token + 2 * per_seq, 2 * 32 * stride + (1 << 20)
    budget = dense + kv + fixed + 11 * stride + stride // 2  # room for 11 slots (out of L * E)
    eng = _engine(ftw, vram_budget=budget, offload=OffloadConfig(b_pcie=1e9, b_cpu=1e9,
                                                                  reserve_bytes=1 << 20))
    plan = eng._experts.vram_plan
    assert (plan.dense, plan.kv, plan.prefill_buffers) == (dense, kv, 64 * stride)
    assert plan.num_slots == eng._experts.num_slots == 11 < L * E
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4]
    got, exp = generate(eng, prompt, params), generate(ref, prompt, params)
    assert len(got.token_ids) == 6 and got.token_ids[0] == exp.token_ids[0]
    moe = eng.stats()["moe"]
    assert moe["calls"] > 0 and moe["hits"] + moe["misses"] > 0
    assert moe["fetched"] + moe["cpu_experts"] == moe["misses"]
    per = moe["per_layer"]
    assert per["layer"] == eng._experts.moe_layers
    for key in ("hits", "misses", "fetched", "cpu_experts"):
        assert sum(per[key]) == moe[key]
    assert moe["vram"]["num_slots"] == plan.num_slots and moe["mode"] == "mapped"
    assert "moe" not in ref.stats()
    eng.close()


def test_engine_goes_resident_when_everything_fits_and_refuses_too_small(ftw_for):
    ftw = ftw_for("qwen3_5_moe", "nvfp4")
    with pytest.raises(ValueError, match="smaller than the fixed allocations"):
        _engine(ftw, vram_budget=1 << 20, offload=OffloadConfig(vram_budget=1 << 20))
    assert "moe" not in _engine(ftw, vram_budget=64 * GIB).stats()  # CPU without `offload`: plain CPU experts
    eng = Engine(ftw, EngineSettings(device="cpu", vram_budget=64 * GIB, memory_ratio=0.9),
                 offload=OffloadConfig(mode="resident"))
    ex = eng._experts
    assert ex.num_slots == len(ex.moe_layers) * ex.E and ex.vram_plan.cached_fraction == 1.0
    out = generate(eng, [3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 3 and eng.stats()["moe"]["misses"] == 0
    assert np.all(np.asarray(eng.stats()["moe"]["per_layer"]["hits"]) > 0)
    eng.close()


def test_cli_flags_are_checked(ftw_for):
    from typer.testing import CliRunner

    from ft.cli.main import app

    ftw = str(ftw_for("qwen3_5_moe", "nvfp4"))
    res = CliRunner().invoke(app, ["generate", "--ftw", ftw, "--token-ids", "1,2", "--vram-budget", "lots"])
    assert res.exit_code == 1 and "byte count" in res.output
    res = CliRunner().invoke(app, ["generate", "--ftw", ftw, "--token-ids", "1,2", "--memory-ratio", "1.5"])
    assert res.exit_code == 1 and "--memory-ratio" in res.output
    res = CliRunner().invoke(app, ["generate", "--ftw", ftw, "--token-ids", "1,2", "--max-tokens", "1",
                                   "--no-cpu-lane"])  # a CUDA-only setting: accepted, without effect on the CPU
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["generate", "--ftw", ftw, "--token-ids", "1,2", "--dense-weights", "fp4"])
    assert res.exit_code == 1 and "--dense-weights 'fp4'" in res.output
    if not torch.cuda.is_available():
        res = CliRunner().invoke(app, ["generate", "--ftw", ftw, "--token-ids", "1,2", "--device", "cuda"])
        assert res.exit_code == 1 and "no CUDA GPU" in res.output
    pytest.importorskip("fastapi")  # `ft serve` needs the server extras
    res = CliRunner().invoke(app, ["serve", "--ftw", ftw, "--vram-budget", "-3GiB"])
    assert res.exit_code == 2 and "byte count" in res.output
    res = CliRunner().invoke(app, ["serve", "--ftw", ftw, "--dense-weights", "fp4"])
    assert res.exit_code == 2 and "--dense-weights 'fp4'" in res.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_resident_and_mapped(ftw_for, monkeypatch):
    # nothing in use at start: the budgets below are sized to a few 4 KB slots, finer than the context's measure
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)
    ftw = ftw_for("qwen3_5_moe", "nvfp4")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4]
    exp = generate(_engine(ftw), prompt, params)
    kw = dict(device="cuda", kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    eng = Engine(ftw, EngineSettings(memory_ratio=0.5, **kw))  # a tiny model: everything fits -> resident
    plan, ex = eng._experts.vram_plan, eng._experts
    assert ex.opts.mode == "resident" and plan.dense > 0
    got = generate(eng, prompt, params)
    assert got.token_ids[0] == exp.token_ids[0] and eng.stats()["moe"]["misses"] == 0
    resident_tokens = got.token_ids
    eng.close()
    assert not plan.dense_quantized
    budget = LATE_OUTSIDE + plan.dense + plan.kv + plan.prefill_buffers + plan.reserve + 5 * ex.layout.stride + 4096
    del eng, ex
    # the GPU copies every miss; dense weights as the resident engine holds them (auto would keep them quantized
    # at a budget that cannot hold every expert)
    eng = Engine(ftw, EngineSettings(vram_budget=budget, cpu_lane=False, dense_weights="dequantized", **kw))
    ex2 = eng._experts  # allocator rounding moves the measured dense bytes a little between loads
    assert ex2.num_slots == ex2.vram_plan.num_slots and 4 <= ex2.num_slots <= 7
    ex2.wait_pinned()  # then decode reads misses in place (banks pinned and verified)
    got = generate(eng, prompt, params)
    ex2.settle()
    moe = eng.stats()["moe"]
    assert ex2.opts.mode == "mapped" and not ex2.opts.cpu_lane and moe["misses"] > 0 and moe["bytes_mapped"] > 0
    assert got.token_ids == resident_tokens  # the same device kernel whichever memory an expert is read from
    eng.close()
    eng = Engine(ftw, EngineSettings(vram_budget=budget, dense_weights="quantized", **kw))
    ex3 = eng._experts  # the bytes the dense weights no longer take go to the cache
    assert ex3.vram_plan.dense_quantized and ex3.vram_plan.dense < plan.dense and ex3.num_slots > ex2.num_slots
    assert generate(eng, prompt, params).token_ids[0] == exp.token_ids[0]
    eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_close_gives_the_memory_back(ftw_for):
    ftw = ftw_for("qwen3_moe", "nvfp4")
    dev = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    eng = Engine(ftw, EngineSettings(device="cuda", vram_budget=device_in_use(dev) + GIB, kv_reserve_tokens=512,
                                     max_prefill_length=64, max_running_requests=2))
    out = generate(eng, list(range(3, 200)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 8 and torch.cuda.memory_allocated(dev) > base
    refs = [weakref.ref(eng), weakref.ref(eng.model), weakref.ref(eng._experts)]
    eng.close()
    del eng, out
    gc.collect()
    torch.cuda.empty_cache()
    held = [type(r).__name__ for ref in refs if ref() is not None for r in gc.get_referrers(ref())]
    assert all(ref() is None for ref in refs), f"a closed engine is still referenced by {held}"
    # the pool, weights and states are gone; cuBLAS keeps a workspace per stream it ran on for the process lifetime
    assert torch.cuda.memory_allocated(dev) <= base + (128 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_vram_budget_holds_for_the_whole_device(ftw_for):
    """An explicit budget covers what the device held at start (the CUDA context) and everything the engine adds:
    after a prefill and decodes, the device's use stays within it, as nvidia-smi would show it; the allocator cap that
    enforces it is lifted at close."""
    ftw = ftw_for("qwen3_moe", "nvfp4")
    dev = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    start = device_in_use(dev)
    budget = start + GIB  # a small model: the slots get what the fixed parts (reserve 0.5 GiB) leave
    eng = Engine(ftw, EngineSettings(device="cuda", vram_budget=budget, kv_reserve_tokens=512, max_prefill_length=64,
                                     max_running_requests=2))
    out = generate(eng, list(range(3, 300)), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 16
    plan = eng._experts.vram_plan
    assert plan.outside >= start and plan.num_slots > 0
    outside_now = device_in_use(dev) - torch.cuda.memory_reserved(dev)  # context, modules: never the allocator's
    assert torch.cuda.max_memory_reserved(dev) + outside_now <= budget
    with pytest.raises(torch.OutOfMemoryError):  # the cap: nothing more than the budget allows
        torch.empty(budget, dtype=torch.uint8, device=dev)
    eng.close()
    x = torch.empty(budget, dtype=torch.uint8, device=dev)  # lifted
    del x, eng, out
    gc.collect()
    torch.cuda.empty_cache()


def test_dense_weight_bytes_match_what_prepare_puts_on_the_device(ftw_for):
    reader = FtwReader(ftw_for("qwen3_5_moe", "nvfp4"))
    sizes = {}
    for keep in (False, True):
        model = load_model(reader, device="meta", keep_quantized=keep)  # meta stands in for the GPU
        on_device = [0]
        model.map_weights(lambda n, t: on_device.__setitem__(0, on_device[0] + t.nbytes * (t.device.type == "meta"))
                          or t)
        nonlayer, per_layer = dense_weight_bytes(reader, keep_quantized=keep)
        assert set(per_layer) == set(range(reader.config.num_layers))
        assert nonlayer + sum(per_layer.values()) == on_device[0]
        sizes[keep] = on_device[0]
    assert sizes[True] < sizes[False]


def test_dense_placement_is_checked():
    assert OffloadConfig().dense == "dequantized"
    with pytest.raises(ValueError, match="unknown dense placement 'fp4'"):
        OffloadConfig(dense="fp4")


def test_engine_with_quantized_dense_weights_decodes_the_same_tokens(ftw_for):
    ftw = ftw_for("qwen3_5_moe", "nvfp4")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4]
    runs = {}
    for dense in ("dequantized", "quantized"):  # the settings' dense_weights (--dense-weights) apply to `offload`
        eng = _engine(ftw, vram_budget=64 * GIB, offload=OffloadConfig(mode="resident"),
                      dense_weights=dense)
        runs[dense] = (generate(eng, prompt, params).token_ids, eng._experts.vram_plan)
        eng.close()
    (want, plain), (got, kept) = runs["dequantized"], runs["quantized"]
    assert got == want and kept.dense_quantized and not plain.dense_quantized and kept.dense < plain.dense


def test_pinned_memory_and_cpu_lane_settings_reach_the_scheduler(ftw_for):
    """`--pinned-memory` (EngineSettings.pinned_memory) caps what the default scheduler's banks page-lock;
    `--no-cpu-lane` leaves every miss to the GPU."""
    from ft.runtime.gpu.engine_setup import load_offloaded

    s = EngineSettings(device="cpu", vram_budget="64GiB", pinned_memory="0", cpu_lane=False)
    assert s.pinned_memory == 0 and EngineSettings(pinned_memory="2GiB").pinned_memory == 2 << 30
    assert EngineSettings().cpu_lane
    _, ex = load_offloaded(FtwReader(ftw_for("qwen3_5_moe", "nvfp4")), device=s.device, vram_budget=s.vram_budget,
                           memory_ratio=s.memory_ratio, offload=None, kv_reserve_tokens=256, max_running_requests=2,
                           pin_host_bytes=s.pinned_memory, cpu_lane=s.cpu_lane)
    assert ex.opts.pin_host_bytes == 0  # carried into the options (a tiny model fits: it goes resident)
    assert ex.opts.cpu_lane is False
    ex.close()
    with pytest.raises(ValueError, match="--pinned-memory"):
        EngineSettings(pinned_memory="lots")
