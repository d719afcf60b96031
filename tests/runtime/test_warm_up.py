"""Engine.warm_up, which `ft serve` runs before it says ready: afterwards the engine is as a fresh one (no counters,
no KV held, nothing kept for prefix reuse; its start-up phases reported) and serves the same tokens; attention-only
and hybrid families."""

from __future__ import annotations

import time

import pytest

from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate

PROMPT = [(11 * i + 5) % 180 + 10 for i in range(19)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_warm_up_leaves_no_trace(ftw_for, arch):
    ftw = ftw_for(arch, "none")
    settings = EngineSettings(kv_reserve_tokens=256, max_prefill_length=8)
    want = generate(Engine(ftw, settings), PROMPT, GREEDY).token_ids
    t = time.perf_counter()
    eng = Engine(ftw, settings)
    loaded = time.perf_counter()
    eng.warm_up()
    warm = time.perf_counter() - loaded
    s = eng.stats()
    assert s["requests_total"] == 0 and s["prompt_tokens_total"] == 0 and s["steps"] == 0
    # ... but its start-up is reported: the load phases, and a step time per warm-up step (16 prompt tokens in
    # chunks of 8, then decode steps to its 2 output tokens)
    up = s["startup"]
    assert 0 <= up["load_s"] + up["tokenizer_s"] <= loaded - t + 1e-3
    assert len(up["warm_up_steps_s"]) >= 3 and 0 <= sum(up["warm_up_steps_s"]) <= warm + 1e-3
    assert s["kv_tokens_used"] == 0 and s["kv_tokens_cached"] == 0 and eng.kv.used == 0
    assert s["prefix_cache"]["entries"] == 0 and not eng.has_unfinished()
    assert generate(eng, PROMPT, GREEDY).token_ids == want
    eng.close()


def test_the_server_warms_the_engine_up_before_it_is_ready(ftw_for, monkeypatch):
    from ft.runtime.server import app as server_app
    from ft.runtime.server.state import ServeSettings

    calls = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self))
    engine = server_app.load_engine(ServeSettings(ftw=ftw_for("qwen3_moe", "none"), engine=EngineSettings()))
    assert calls == [engine]
    engine.close()


def test_the_tokenizer_is_parsed_while_the_weights_load_and_its_errors_still_surface(ftw_for, monkeypatch):
    import threading

    import ft.runtime.engine as engine_mod
    from ft.runtime.tokenizer import Tokenizer

    ftw = ftw_for("qwen3_moe", "none")
    both = threading.Barrier(2, timeout=10)  # passes only if the two loads are under way at the same time
    real_load, real_tok = engine_mod.load_for_engine, Tokenizer.from_reader

    def load(*a, **k):
        both.wait()
        return real_load(*a, **k)

    def tokenizer(reader):
        both.wait()
        return real_tok(reader)

    monkeypatch.setattr(engine_mod, "load_for_engine", load)
    monkeypatch.setattr(Tokenizer, "from_reader", staticmethod(tokenizer))
    eng = Engine(ftw, EngineSettings(kv_reserve_tokens=256))
    assert eng.tokenizer.encode("hello") and generate(eng, PROMPT, GREEDY).token_ids
    eng.close()

    def broken(reader):
        raise ValueError("FTW manifest.tokenizer has no 'file'")

    monkeypatch.setattr(engine_mod, "load_for_engine", real_load)
    monkeypatch.setattr(Tokenizer, "from_reader", staticmethod(broken))
    with pytest.raises(ValueError, match="tokenizer has no 'file'"):
        Engine(ftw, EngineSettings(kv_reserve_tokens=256))


def test_the_warm_up_waits_for_the_page_locking_before_its_request(ftw_for, monkeypatch):
    """At a VRAM budget the steady state's decode path (mapped reads, CUDA graphs) starts once the banks are
    page-locked: the warm-up waits for that first, so the request it runs (and the graphs it captures) is that path."""
    from ft.runtime.gpu.offload_config import OffloadConfig

    eng = Engine(ftw_for("qwen3_moe", "nvfp4"), EngineSettings(kv_reserve_tokens=256),
                 offload=OffloadConfig(num_slots=1))
    order = []
    real_step = eng.step
    monkeypatch.setattr(type(eng._experts), "wait_pinned", lambda self, timeout=None: order.append("pinned") or {})
    monkeypatch.setattr(eng, "step", lambda: order.append("step") or real_step())
    eng.warm_up()
    assert order[0] == "pinned" and order.count("pinned") == 1 and order.count("step") >= 2
    assert eng.startup["pin_wait_s"] >= 0
    eng.close()
