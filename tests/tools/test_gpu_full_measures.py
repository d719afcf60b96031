"""tools/gpu_full_measures.py's host-side prefill report, on CPU with the CUDA calls stubbed: what it counts as a
sync site and what it times."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gpu_full_checks  # noqa: E402
import gpu_full_measures as measures  # noqa: E402


def test_prefill_host_reports_each_sync_site_and_the_host_time(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    freed = []
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100),
                                  new_state=lambda n: types.SimpleNamespace(free=lambda: freed.append(n)))
    seen = []

    def fake_prefill(m, state, toks):
        seen.append(len(toks))
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")  # as torch's sync debug mode does
        sum(i * i for i in range(20000))  # some host time for cProfile

    monkeypatch.setattr(gpu_full_checks, "prefill", fake_prefill)
    res = measures.prefill_host(model, 64)
    assert seen == [64] and freed == [65] and modes == ["warn", "default"]  # debug mode switched off again
    (site, n), = res["syncs"].items()
    assert n == 3 and site.startswith("test_gpu_full_measures.py:")
    assert 0 < res["queued_ms"] <= res["wall_ms"]
    assert any("<genexpr>" in r["fn"] for r in res["host_tottime_us"])


def test_prefill_host_switches_the_debug_mode_off_when_the_forward_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100),
                                  new_state=lambda n: types.SimpleNamespace(free=lambda: None))
    monkeypatch.setattr(gpu_full_checks, "prefill", lambda *a: (_ for _ in ()).throw(RuntimeError("oom")))
    with pytest.raises(RuntimeError, match="oom"):
        measures.prefill_host(model, 8)
    assert modes == ["warn", "default"] and sys.getprofile() is None  # nor is the profiler left on


def test_plan_prediction_is_ft_plans_model_of_the_engines_split_from_the_routing_seen(ftw_for):
    """On the GPU scheduler's CPU emulation: before any routing the uniform prior, after a request the trace's counts;
    the numbers are `make_plan`'s for the split the engine measured (an engine without one predicts nothing)."""
    from ft.formats import FtwReader
    from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
    from ft.runtime.gpu.offload_config import OffloadConfig
    from ft.runtime.plan.build import make_plan
    from ft.runtime.plan.routing import RoutingProfile

    src = ftw_for("qwen3_5_moe", "nvfp4")
    settings = EngineSettings(device="cpu", vram_budget=400 << 20, max_prefill_length=8, kv_reserve_tokens=512)
    eng = Engine(src, settings, offload=OffloadConfig(num_slots=12))  # of 32: misses, so the cache counts routing
    try:
        before = measures.plan_prediction(eng)
        want = make_plan(FtwReader(src), settings, RoutingProfile.uniform("-"), measured=eng._experts.vram_plan)
        assert before["routing_tokens"] == 0 and before["decode_tok_s"] == want.prediction.decode_tok_s
        generate(eng, [5, 17, 3, 99, 42, 7, 11, 2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        eng._experts.settle()
        after = measures.plan_prediction(eng)
        assert after["routing_tokens"] > 0 and after["rates"] == want.machine.rates.source
        assert 0 < after["hit_rate"] <= 1 and after["decode_tok_s"] > 0
    finally:
        eng.close()
    assert measures.plan_prediction(types.SimpleNamespace(_experts=None)) is None
