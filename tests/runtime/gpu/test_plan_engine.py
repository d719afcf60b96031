"""Placement plans end to end on the GPU scheduler's CPU emulation (and on CUDA where there is one): `ft plan` writes a
plan whose VRAM split is the engine's, the engine picks the plan made for its machine (else plans at start, without
writing, and says so), preloads its experts before the first step, sizes KV from it, and the routing a server saves
at shutdown feeds the next plan."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.formats.plan import model_key, plan_names, read_plan
from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.gpu import engine_setup
from ft.runtime.gpu.engine_setup import _weight_bytes
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.sizing import resolve_reserve, state_bytes
from ft.runtime.plan import build
from ft.runtime.plan.calibrate import calibrate
from ft.runtime.plan.routing import RoutingProfile, load_counts, save_counts

PROMPT = [5, 17, 3, 99, 42, 7, 11, 2]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SLOTS = 12  # of the tiny qwen3_5_moe's 4 x 8 experts
KV = 512
CHUNK = 8  # prefill tokens per forward (it sizes the activation reserve)


@pytest.fixture(scope="module")
def src(ftw_for):
    return ftw_for("qwen3_5_moe", "nvfp4")


@pytest.fixture()
def ftw(src, tmp_path):
    return shutil.copytree(src, tmp_path / "m.ftw")  # plans are written into it


@pytest.fixture(scope="module")
def budget(src) -> int:
    """A VRAM budget that leaves SLOTS expert slots to the CPU emulation with a KV budget of KV tokens."""
    probe = Engine(src, EngineSettings(device="cpu", kv_reserve_tokens=KV),
                   offload=OffloadConfig(num_slots=1))
    ex, dense = probe._experts, _weight_bytes(probe.model)
    per_token, per_seq = state_bytes(probe.config, probe.model.dtype)
    probe.close()
    opts = OffloadConfig()
    reserve = resolve_reserve(None, FtwReader(src), CHUNK, dense_quantized=ex.opts.dense == "quantized")
    fixed = dense + KV * per_token + 4 * per_seq + 2 * opts.prefill_slots * ex.layout.stride + reserve
    return fixed + SLOTS * ex.layout.stride + ex.layout.stride // 2


def _settings(budget: int, **kw) -> EngineSettings:
    return EngineSettings(device="cpu", vram_budget=budget, max_prefill_length=CHUNK, **kw)


def _engine(ftw, budget: int, **kw) -> Engine:
    return Engine(ftw, _settings(budget, **kw), offload=OffloadConfig(b_cpu=1.0))  # every miss fetched while slots last


def _resident(ex) -> set[tuple[int, int]]:
    layers, experts = np.nonzero(ex.cache.slot_of >= 0)
    return set(zip(layers.tolist(), experts.tolist()))


def _first_step_hits(eng) -> int:
    eng.add_request("r", PROMPT, PARAMS)
    eng.step()  # the prompt's forward and its first token
    eng._experts.settle()  # mode mapped counts a call when its routing has come back
    hits = eng.stats()["moe"]["hits"]
    while eng.has_unfinished():
        eng.step()
    return hits


def test_the_written_plan_is_the_engines_split_and_the_engine_starts_from_it(ftw, budget, caplog):
    reader = FtwReader(ftw)
    routing, _ = calibrate(reader, 300, EngineSettings(device="cpu"))
    plan = build.make_plan(reader, _settings(budget, kv_reserve_tokens=KV), routing, name="tiny")
    build.write_plan(ftw, plan)
    assert plan_names(FtwReader(ftw)) == ["tiny"] and FtwReader(ftw).verify() == []
    assert plan.vram.expert_slots == SLOTS and plan.vram.kv_tokens == KV and len(plan.resident) == SLOTS
    assert plan.routing.source == "calibration" and plan.machine.gpu == "cpu" and plan.pinned_banks
    shares = np.asarray(plan.routing.counts, float)
    shares /= shares.sum(1, keepdims=True)
    chosen = [shares[layer, e] for layer, e in plan.resident]
    assert min(chosen) >= max(shares[i, e] for i in range(4) for e in range(8) if (i, e) not in plan.resident)
    with caplog.at_level(logging.INFO, logger="ft.gpu"):
        eng = _engine(ftw, budget)  # no --kv-reserve-tokens: KV comes from the plan
    ex = eng._experts
    assert eng.placement.plan == "tiny" and "placement plan tiny (made for this machine" in caplog.text
    assert eng.kv.total == KV and ex.num_slots == plan.vram.expert_slots
    assert _resident(ex) == set(plan.resident)  # preloaded before the first step
    assert eng.max_prefill_length == 8 and eng.stats()["plan"]["plan"] == "tiny"
    assert _first_step_hits(eng) > 0
    eng.close()
    cold = _engine(ftw, budget, kv_reserve_tokens=KV, plan="none")
    assert cold.placement is None and _resident(cold._experts) == set() and _first_step_hits(cold) == 0
    assert generate(cold, PROMPT, PARAMS).token_ids == generate(_engine(ftw, budget), PROMPT, PARAMS).token_ids
    cold.close()
    given = _engine(ftw, budget, kv_reserve_tokens=300)
    assert given.placement.plan == "tiny" and given.kv.total == 300  # a given KV budget wins; the plan still places
    given.close()


def test_no_matching_plan_plans_at_start_without_writing(ftw, budget, caplog):
    reader = FtwReader(ftw)
    other = build.make_plan(reader, _settings(budget + (1 << 30), kv_reserve_tokens=KV),
                            RoutingProfile("trace", "given", 10, np.tile(np.arange(8), (4, 1))), name="big")
    host = dataclasses.replace(build.make_plan(reader, _settings(budget, kv_reserve_tokens=KV),
                                               RoutingProfile.uniform("none"), name="elsewhere"),
                               machine=dataclasses.replace(other.machine, host_memory=other.machine.host_memory * 2))
    for p in (other, host):
        build.write_plan(ftw, p)
    index = (ftw / "model.ftw").read_bytes()
    with caplog.at_level(logging.INFO, logger="ft.gpu"):
        eng = _engine(ftw, budget, kv_reserve_tokens=KV)
    p = eng.placement
    assert p.plan is None and "no placement plan matches this machine" in caplog.text
    assert "big: VRAM budget" in p.note and "elsewhere: host RAM" in p.note and "not written" in p.note
    assert p.routing.source == "trace"  # the other machine's routing counts, same model
    ex = eng._experts
    assert _resident(ex) == {(i, e) for i in range(4) for e in (7, 6, 5)}  # each layer's top 3
    assert (ftw / "model.ftw").read_bytes() == index and sorted(plan_names(FtwReader(ftw))) == ["big", "elsewhere"]
    eng.close()
    named = _engine(ftw, budget, kv_reserve_tokens=KV, plan="big")  # asked for by name: used, and said
    assert named.placement.plan == "big" and "as asked; made for VRAM budget" in named.placement.note
    named.close()
    with pytest.raises(ValueError, match="no plan named 'nope'"):
        _engine(ftw, budget, plan="nope")


def test_without_any_plan_the_uniform_prior_fills_the_slots(ftw, budget):
    eng = _engine(ftw, budget, kv_reserve_tokens=KV)
    assert eng.placement.routing.source == "uniform" and "the FTW has none" in eng.placement.note
    layers = [layer for layer, _ in _resident(eng._experts)]
    assert len(layers) == SLOTS and max(map(layers.count, set(layers))) == SLOTS // 4  # round-robin over layers
    eng.close()


def test_saved_routing_feeds_the_next_plan(ftw, budget, tmp_path):
    path = tmp_path / "routing.json"
    eng = _engine(ftw, budget, kv_reserve_tokens=KV, plan="none", save_routing=str(path))
    generate(eng, PROMPT, PARAMS)
    pairs = eng.stats()["moe"]["pairs"]
    eng.close()
    reader = FtwReader(ftw)
    key, moe = model_key(reader.records), [0, 1, 2, 3]
    prof = load_counts(path, key=key, moe_layers=moe, num_experts=8)
    assert prof.source == "trace" and prof.counts.sum() == pairs and prof.tokens == len(PROMPT) + 3
    plan = build.make_plan(reader, _settings(budget, kv_reserve_tokens=KV), prof, name="served")
    assert plan.routing.source == "trace" and plan.routing.counts == tuple(map(tuple, prof.counts.tolist()))
    with pytest.raises(ValueError, match="written for another model"):
        load_counts(path, key="0" * 16, moe_layers=moe, num_experts=8)
    with pytest.raises(ValueError, match="differ from the model's"):
        load_counts(path, key=key, moe_layers=[0, 1], num_experts=8)
    save_counts(path, key=key, moe_layers=moe, counts=np.zeros((4, 8)), tokens=np.zeros(4))
    with pytest.raises(ValueError, match="counts no routed pairs"):
        load_counts(path, key=key, moe_layers=moe, num_experts=8)
    path.write_text('{"format": "ft-routing", "version": 1, "model_key": "x", "tokens": []}')
    with pytest.raises(ValueError, match="keys"):
        load_counts(path, key=key, moe_layers=moe, num_experts=8)


def test_save_routing_without_an_expert_cache_writes_nothing(src, tmp_path, caplog):
    eng = Engine(src, EngineSettings(device="cpu", save_routing=str(tmp_path / "r.json")))  # CPU experts
    generate(eng, PROMPT, PARAMS)
    with caplog.at_level(logging.WARNING, logger="ft.plan"):
        eng.close()
    assert not (tmp_path / "r.json").exists() and "no expert cache" in caplog.text


def test_calibration_counts_k_experts_per_token(src):
    reader = FtwReader(src)
    prof, measured = calibrate(reader, 200, EngineSettings(device="cpu"))
    assert measured is None and prof.tokens == 200 and prof.source == "calibration"
    assert prof.counts.shape == (4, 8) and (prof.counts.sum(1) == 200 * reader.config.num_experts_per_tok).all()


def test_a_budget_too_small_and_an_unsupported_model_are_refused(src, ftw_for):
    reader = FtwReader(src)
    with pytest.raises(ValueError, match="smaller than the fixed allocations"):
        build.make_plan(reader, _settings(1 << 20), RoutingProfile.uniform(""))
    with pytest.raises(ValueError, match="--vram-budget is needed"):
        build.make_plan(reader, EngineSettings(device="cpu"), RoutingProfile.uniform(""))
    with pytest.raises(ValueError, match="cannot serve this model"):
        build.make_plan(FtwReader(ftw_for("qwen3_5_moe")), _settings(1 << 30), RoutingProfile.uniform(""))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_preloads_the_plan_before_capturing_graphs(ftw, monkeypatch):
    monkeypatch.setattr(engine_setup, "device_in_use", lambda dev: 0)  # budgets sized to a few 4 KB slots
    kw = dict(device="cuda", kv_reserve_tokens=KV, max_prefill_length=8, max_running_requests=2)
    probe = Engine(ftw, EngineSettings(memory_ratio=0.5, plan="none", **kw))
    v, stride = probe.vram_plan, probe._experts.layout.stride
    probe.close()
    budget = engine_setup.LATE_OUTSIDE + v.dense + v.kv + v.prefill_buffers + v.reserve + SLOTS * stride + 4096
    reader = FtwReader(ftw)
    routing, _ = calibrate(reader, 300, EngineSettings(**kw))
    measured = dataclasses.replace(v, budget=budget, outside=engine_setup.LATE_OUTSIDE)
    plan = build.make_plan(reader, EngineSettings(vram_budget=budget, **kw), routing, name="gpu", measured=measured)
    build.write_plan(ftw, plan)
    eng = Engine(ftw, EngineSettings(vram_budget=budget, **kw))
    ex = eng._experts
    assert eng.placement.plan == "gpu" and ex.opts.mode == "mapped" and eng.model.graphs is not None
    resident = _resident(ex)  # the plan's list, continued if this engine measured room for more slots
    assert set(plan.resident[:ex.num_slots]) <= resident and len(resident) == ex.num_slots
    ex.wait_pinned()
    assert _first_step_hits(eng) > 0
    eng.close()
    assert read_plan(FtwReader(ftw), "gpu").prediction.decode_tok_s > 0
