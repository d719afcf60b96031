"""Engine: KV reserved on demand, grown in blocks, recompute preemption (tiny real models).

Every multi-request run here checks the engine's invariants after each step (`_checked_run`): KV used within the
budget, each state's KV capacity within its reservation, running + waiting in arrival order, and exactly one event
per output token with the finish reason on the last one only.
"""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.state import SequenceState

PROMPTS = [[(7 * i + 3) % 200 + 10 for i in range(n)] for n in (23, 5, 11, 1)]
GREEDY = dict(temperature=0, ignore_eos=True)



def _settings(**kw) -> EngineSettings:
    """These tests count KV reservations and preemptions exactly: no states kept for prefix reuse between requests
    (tests/runtime/test_prefix_cache.py covers that)."""
    return EngineSettings(prefix_cache_entries=0, **kw)

@pytest.fixture(scope="module")
def ftw(ftw_for):
    return ftw_for("qwen3_moe", "none")


def _checked_step(engine: Engine, order: list[str], events: dict[str, list]) -> None:
    """One step; its events are appended to `events` by request id; `order` is the arrival order of the requests."""
    for ev in engine.step():
        events.setdefault(ev.request_id, []).append(ev)
    kv = engine.kv
    assert 0 <= kv.used <= kv.total
    running = engine._running
    assert kv.used == sum(kv.reserved(r.request_id) for r in running) == engine.stats()["kv_tokens_used"]
    for r in running:
        assert r.state.length <= r.state.capacity <= kv.reserved(r.request_id) <= r.max_length
    for r in engine._waiting:
        assert r.state is None and kv.reserved(r.request_id) == 0
    ids = [r.request_id for r in [*running, *engine._waiting]]
    assert ids == sorted(ids, key=order.index)  # FIFO, preempted requests included


def _checked_run(engine: Engine, order: list[str], events: dict[str, list] | None = None) -> dict[str, list]:
    """Step until idle, then check every request's events. Returns the events by request id."""
    events = {} if events is None else events
    while engine.has_unfinished():
        _checked_step(engine, order, events)
    assert engine.kv.used == 0
    for rid, evs in events.items():
        finished = [ev for ev in evs if ev.finish_reason is not None]
        assert finished == [evs[-1]], rid
        tokens = [ev for ev in evs if ev.token_id is not None]
        assert [ev.num_output_tokens for ev in tokens] == list(range(1, len(tokens) + 1)), rid  # none twice/missing
    return events


def _tokens(evs: list) -> list[int]:
    return [ev.token_id for ev in evs if ev.token_id is not None]


def test_huge_max_tokens_do_not_serialize_requests(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=128, max_prefill_length=64))  # KV block: 16 tokens
    params = SamplingParams(max_tokens=10_000, **GREEDY)  # far above the budget
    alone = {i: generate(eng, PROMPTS[i], params) for i in (0, 2)}
    eng.add_request("a", PROMPTS[0], params)
    eng.add_request("b", PROMPTS[2], params)
    events: dict[str, list] = {}
    _checked_step(eng, ["a", "b"], events)
    s = eng.stats()
    assert (s["running"], s["waiting"], s["kv_tokens_used"]) == (2, 0, 32 + 16)  # prompt + 1, rounded to a block
    _checked_run(eng, ["a", "b"], events)
    for rid, i in (("a", 0), ("b", 2)):
        assert _tokens(events[rid]) == alone[i].token_ids
        assert "".join(ev.text for ev in events[rid]) == alone[i].text
        assert events[rid][-1].finish_reason == "length" == alone[i].finish_reason
        assert len(alone[i].token_ids) == 128 - len(PROMPTS[i])  # capped by the budget, not by max_tokens
    assert eng.stats()["preemptions"] > 0  # together they need more than the budget


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_forced_preemption_gives_the_same_output_as_alone(ftw_for, arch):
    eng = Engine(ftw_for(arch, "none"), _settings(kv_reserve_tokens=64, max_prefill_length=8))  # KV block: 8
    params = [SamplingParams(max_tokens=30, **GREEDY),
              SamplingParams(max_tokens=25, repetition_penalty=1.3, presence_penalty=0.5, **GREEDY),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=1000, **GREEDY)]  # capped at 63 by the budget
    alone = [generate(eng, p, sp) for p, sp in zip(PROMPTS, params)]
    assert eng.stats()["preemptions"] == 0
    order = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, p, sp in zip(order, PROMPTS, params):
        eng.add_request(rid, p, sp)
    events = _checked_run(eng, order)
    for rid, ref in zip(order, alone):
        assert _tokens(events[rid]) == ref.token_ids, rid
        assert "".join(ev.text for ev in events[rid]) == ref.text, rid
        assert events[rid][-1].finish_reason == ref.finish_reason == "length"
    s = eng.stats()
    assert s["preemptions"] > 0 and s["running"] == s["waiting"] == 0
    assert s["output_tokens_total"] == 2 * sum(len(r.token_ids) for r in alone)  # recompute emits nothing


def test_request_alone_over_the_budget_ends_with_length_at_the_cap(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=64))
    res = generate(eng, PROMPTS[0], SamplingParams(max_tokens=10_000, **GREEDY))
    assert res.finish_reason == "length" and len(res.token_ids) == 64 - len(PROMPTS[0])
    assert eng.stats()["preemptions"] == 0 and eng.kv.used == 0


def test_alone_and_unable_to_grow_ends_with_length(ftw):
    # The engine's own requests never hit this (their length is capped by the budget); a budget shared with
    # another holder can.
    eng = Engine(ftw, _settings(kv_reserve_tokens=64))
    eng.add_request("a", PROMPTS[1], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    assert eng.kv.reserved("a") == 8 and eng.kv.try_reserve("other", eng.kv.free)
    events = _events_of(eng, "a")
    assert [ev.token_id is None for ev in events] == [False] * 3 + [True]  # tokens 2..4, then the final event
    assert events[-1].finish_reason == "length" and events[-1].num_output_tokens == 8 - len(PROMPTS[1]) + 1
    assert not eng.has_unfinished() and eng.kv.used == eng.kv.reserved("other")


def _events_of(engine: Engine, rid: str) -> list:
    out = []
    while engine.has_unfinished():
        out += [ev for ev in engine.step() if ev.request_id == rid]
    return out


def test_abort_of_a_preempted_request(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=64, max_prefill_length=8))
    params = SamplingParams(max_tokens=40, **GREEDY)
    alone = generate(eng, PROMPTS[2], params).token_ids
    eng.add_request("a", PROMPTS[2], params)
    eng.add_request("b", PROMPTS[0], params)
    events: dict[str, list] = {}
    while not (eng._waiting and eng._waiting[0].request_id == "b" and events.get("b")):
        _checked_step(eng, ["a", "b"], events)
    assert eng.stats()["preemptions"] == 1 and eng.stats()["running"] == 1
    used, sent = eng.kv.used, len(events["b"])
    eng.abort("b")
    assert eng.kv.used == used and eng.stats()["waiting"] == 0  # b held no KV while waiting
    _checked_run(eng, ["a", "b"], events)
    assert [ev.finish_reason for ev in events["b"][sent:]] == ["abort"]
    assert events["b"][-1].num_output_tokens == sent and events["b"][-1].token_id is None
    assert _tokens(events["a"]) == alone and eng.stats()["preemptions"] == 1
    eng.add_request("b", PROMPTS[0], params)  # the id is free again
    eng.abort("b")
    eng.step()


def test_state_capacity_grows_geometrically_and_keeps_the_filled_rows(ftw):
    cfg = FtwReader(ftw).config
    st = SequenceState(cfg, 100, dtype=torch.float32, device=torch.device("cpu"), capacity=4)
    full = SequenceState(cfg, 100, dtype=torch.float32, device=torch.device("cpu"))
    assert full.capacity == 100 and st.capacity == 4 and st.nbytes < full.nbytes
    layer = next(iter(st.kv))
    st.kv[layer][0][:3] = torch.arange(3.0)[:, None, None]
    st.length = 3
    st.ensure_capacity(4)
    assert st.capacity == 4  # already enough
    st.ensure_capacity(5)
    assert st.capacity == 8 and st.kv[layer][0].shape[0] == 8
    assert torch.equal(st.kv[layer][0][:3, 0, 0], torch.arange(3.0))
    st.ensure_capacity(9, at_most=10)
    assert st.capacity == 10
    st.ensure_capacity(60)
    assert st.capacity == 60
    st.ensure_capacity(61)
    assert st.capacity == 100  # capped at max_tokens
    assert torch.equal(st.kv[layer][0][:3, 0, 0], torch.arange(3.0))
    with pytest.raises(ValueError, match="exceed"):
        SequenceState(cfg, 10, dtype=torch.float32, device=torch.device("cpu"), capacity=1).ensure_capacity(11)
    with pytest.raises(ValueError, match="capacity"):
        SequenceState(cfg, 10, dtype=torch.float32, device=torch.device("cpu"), capacity=11)
