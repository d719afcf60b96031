"""Engine: KV budget, chunked prefill, continuous batching, stops, limits, abort, stats (tiny real models)."""

from __future__ import annotations

import pytest

from ft.runtime.engine import (ContextOverflowError, Engine, EngineSettings, QueueFullError, SamplingParams,
                               generate)
from ft.runtime.kv import KvBudget
from ft.runtime.request import StopStringFilter

ARCH = "qwen3_moe"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 200 + 10 for i in range(n)] for n in (23, 5, 11, 1)]



def _settings(**kw) -> EngineSettings:
    """These tests count KV reservations and preemptions exactly: no states kept for prefix reuse between requests
    (tests/runtime/test_prefix_cache.py covers that)."""
    return EngineSettings(prefix_cache_entries=0, **kw)

@pytest.fixture(scope="module")
def ftw(ftw_for):
    return ftw_for(ARCH, "none")


@pytest.fixture(scope="module")
def engine(ftw):
    return Engine(ftw, _settings(kv_reserve_tokens=256, max_prefill_length=64))


def _run_all(engine: Engine) -> dict[str, list]:
    events: dict[str, list] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    return events


# ---- pure parts --------------------------------------------------------------------------------------------------

def test_stop_filter_across_token_boundaries_holds_back_and_trims():
    f = StopStringFilter(("END",))
    assert f.push("hello E") == ("hello ", False)  # "E" could start "END": held back
    assert f.push("x") == ("Ex", False)  # not a stop after all: released
    assert f.push("foo EN") == ("foo ", False)
    assert f.push("D and more") == ("", True)  # trimmed at the stop string, the rest dropped


def test_stop_filter_earliest_match_and_flush():
    f = StopStringFilter(("bc", "abcd"))
    assert f.push("xab") == ("x", False)  # "ab" is a prefix of "abcd"
    assert f.push("cd") == ("", True)  # both match; the earlier start ("abcd" at 0) wins
    h = StopStringFilter(("cd", "abcdef"))
    assert h.push("xabcd") == ("xab", True)  # the first complete match ends the output
    g = StopStringFilter(("<|",))
    assert g.push("text<") == ("text", False)
    assert g.flush() == "<"
    assert StopStringFilter(()).push("anything") == ("anything", False)


def test_kv_budget_messages_reservations_and_release():
    kv = KvBudget(8192, max_position_embeddings=40960)
    with pytest.raises(ContextOverflowError) as e:
        kv.check_prompt(13283)
    assert str(e.value) == "prompt is 13283 tokens; the KV budget is 8192; raise --kv-reserve-tokens"
    small_ctx = KvBudget(8192, max_position_embeddings=100)
    with pytest.raises(ContextOverflowError, match="prompt is 100 tokens; the model's context is 100 tokens"):
        small_ctx.check_prompt(100)
    assert kv.max_length(100, 50) == 150
    assert kv.max_length(8000, 1000) == 8192  # capped: output ends early with "length"
    assert small_ctx.max_length(90, 50) == 100
    assert kv.block == 256 and KvBudget(64, 100).block == 8 and KvBudget(4, 100).block == 1
    assert kv.rounded(101, 10_000) == 256 and kv.rounded(256, 10_000) == 256 and kv.rounded(257, 300) == 300
    assert kv.try_reserve("a", 8000) and not kv.try_reserve("b", 200)
    assert kv.used == 8000 and kv.free == 192 and kv.reserved("a") == 8000 and kv.reserved("b") == 0
    kv.release("a")
    assert kv.used == 0 and kv.try_reserve("b", 200)
    assert not kv.try_reserve("c", 7900, headroom=100) and kv.try_reserve("c", 7900, headroom=92)


def test_kv_budget_grows_in_blocks_then_takes_what_is_left():
    kv = KvBudget(1024, max_position_embeddings=4096, block_tokens=100)
    assert kv.try_reserve("a", 100) and kv.try_reserve("b", 850)
    assert kv.try_grow("a", 100, 1000) and kv.reserved("a") == 100  # already covered: nothing changes
    assert kv.try_grow("a", 101, 1000) and kv.reserved("a") == 174  # a whole block does not fit: what is free
    assert not kv.try_grow("a", 175, 1000) and kv.reserved("a") == 174 and kv.used == 1024
    kv.release("b")
    assert kv.try_grow("a", 175, 250) and kv.reserved("a") == 200  # block boundary
    assert kv.try_grow("a", 201, 250) and kv.reserved("a") == 250  # capped by the request's max length
    assert kv.used == 250


# ---- with a model ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", [ARCH, "qwen3_5_moe", "glm_moe_dsa"])
def test_chunked_prefill_gives_identical_greedy_tokens(ftw_for, arch):
    path = ftw_for(arch, "none")
    prompt = PROMPTS[0]
    results = [generate(Engine(path, _settings(kv_reserve_tokens=128, max_prefill_length=n)), prompt,
                        GREEDY).token_ids for n in (64, 7, 3, 1)]
    assert all(r == results[0] for r in results), results
    assert len(results[0]) == GREEDY.max_tokens


def test_batched_decode_equals_each_request_alone(engine):
    alone = [generate(engine, p, GREEDY).token_ids for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    events = _run_all(engine)
    together = [[ev.token_id for ev in events[f"r{i}"]] for i in range(len(PROMPTS))]
    assert together == alone
    for i, p in enumerate(PROMPTS):
        last = events[f"r{i}"][-1]
        assert last.finish_reason == "length" and last.num_prompt_tokens == len(p)
        assert last.num_output_tokens == GREEDY.max_tokens
        assert all(ev.finish_reason is None for ev in events[f"r{i}"][:-1])
    assert engine.stats()["kv_tokens_used"] == 0


def test_long_prompt_prefill_interleaves_with_running_decode(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=256, max_prefill_length=4))
    eng.add_request("short", PROMPTS[3], GREEDY)
    eng.step()  # short: prefilled, first token
    eng.add_request("long", PROMPTS[0], GREEDY)
    per_step = [{ev.request_id for ev in eng.step()} for _ in range(5)]
    # The long prompt needs 6 chunks of 4; the short request keeps decoding meanwhile.
    assert all("short" in ids and "long" not in ids for ids in per_step)


def test_stop_token_ids_and_eos(ftw, engine):
    ref = generate(engine, PROMPTS[0], GREEDY).token_ids
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    res = generate(engine, PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                       stop_token_ids=(stop_tok,)))
    assert res.finish_reason == "stop" and res.token_ids == ref[: first + 1]
    eos_engine = Engine(ftw, _settings(kv_reserve_tokens=256))
    assert eos_engine.eos_token_ids >= set(eos_engine.config.eos_token_ids)
    eos_engine.eos_token_ids = frozenset({stop_tok})  # pretend the model's EOS is that token
    res = generate(eos_engine, PROMPTS[0], SamplingParams(max_tokens=12, temperature=0))
    assert res.finish_reason == "stop" and res.token_ids == ref[: first + 1]
    full_text = eos_engine.tokenizer.decode(ref[:first])
    assert res.text == full_text  # the stop token's own text is not emitted
    res = generate(eos_engine, PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert res.finish_reason == "length" and res.token_ids == ref


def test_stop_string_across_tokens_is_trimmed(engine):
    ref = generate(engine, PROMPTS[0], GREEDY)
    text = engine.tokenizer.decode(ref.token_ids)
    assert ref.text == text
    # A stop string that spans a token boundary: the last char of token 2's text + the first of token 3's.
    upto2 = len(engine.tokenizer.decode(ref.token_ids[:3]))
    stop = text[upto2 - 1: upto2 + 1]
    start = text.find(stop)
    deltas = []
    res = generate(engine, PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)),
                   on_event=lambda ev: deltas.append(ev.text))
    assert res.finish_reason == "stop"
    assert res.text == text[:start] and "".join(deltas) == res.text
    assert res.token_ids == ref.token_ids[: len(res.token_ids)] and len(res.token_ids) < len(ref.token_ids)


def test_max_tokens_length_and_clamp(ftw, engine):
    res = generate(engine, PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert res.finish_reason == "length" and len(res.token_ids) == 3
    clamped = Engine(ftw, _settings(kv_reserve_tokens=256, max_output_tokens=5))
    res = generate(clamped, PROMPTS[1], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert res.finish_reason == "length" and len(res.token_ids) == 5
    # The KV budget caps the sequence too: 60 prompt tokens in a 64-token budget leave room for 4.
    tight = Engine(ftw, _settings(kv_reserve_tokens=64))
    res = generate(tight, [11] * 60, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert res.finish_reason == "length" and len(res.token_ids) == 4


def test_context_overflow_message_is_exact(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=64))
    with pytest.raises(ContextOverflowError) as e:
        eng.add_request("big", [5] * 100, GREEDY)
    assert str(e.value) == "prompt is 100 tokens; the KV budget is 64; raise --kv-reserve-tokens"
    assert not eng.has_unfinished() and eng.stats()["requests_total"] == 0


def test_queue_full_and_fifo_waiting_for_kv(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=64, max_queued_requests=2))  # KV block: 8 tokens
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eng.add_request("a", [9] * 40, params)  # reserves 48 (40 + 1, rounded to a block)
    eng.add_request("b", PROMPTS[0], params)  # needs 24 + 8 of headroom: must wait for "a"
    with pytest.raises(QueueFullError):
        eng.add_request("c", PROMPTS[1], params)
    eng.step()
    s = eng.stats()
    assert (s["running"], s["waiting"], s["kv_tokens_used"], s["kv_tokens_total"]) == (1, 1, 48, 64)
    eng.add_request("c", PROMPTS[1], params)  # the queue has room again; c waits behind b (FIFO)
    events = _run_all(eng)
    assert [ev.finish_reason for ev in events["a"]][-1] == "length"
    alone = generate(Engine(ftw, _settings(kv_reserve_tokens=64)), PROMPTS[0], params).token_ids
    assert [ev.token_id for ev in events["b"]] == alone
    assert eng.stats()["kv_tokens_used"] == 0


def test_abort_frees_kv_at_once_and_emits_final_event(engine):
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("x", PROMPTS[0], params)
    engine.add_request("y", PROMPTS[1], params)
    engine.step()
    engine.step()
    used = engine.stats()["kv_tokens_used"]
    assert used == 32 + 32  # 23 + 1 and 5 + 1 tokens, each rounded to the 32-token block (not prompt + 50)
    engine.abort("x")
    assert engine.stats()["kv_tokens_used"] == 32  # before any further step
    events = engine.step()
    ends = [ev for ev in events if ev.request_id == "x"]
    assert len(ends) == 1 and ends[0].finish_reason == "abort" and ends[0].token_id is None
    engine.abort("y")
    engine.abort("unknown")  # ignored
    engine.step()
    assert not engine.has_unfinished() and engine.stats()["kv_tokens_used"] == 0


def test_seeded_sampling_is_reproducible_through_the_engine(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = generate(engine, PROMPTS[2], params).token_ids
    assert generate(engine, PROMPTS[2], params).token_ids == a
    logprobs = generate(engine, PROMPTS[2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                           logprobs=2)).logprobs
    assert len(logprobs) == 4 and all(lp <= 0 for lp in logprobs)


def test_stats_and_validation(engine):
    generate(engine, PROMPTS[1], GREEDY)
    s = engine.stats()
    for key in ("requests_total", "running", "waiting", "prompt_tokens_total", "output_tokens_total",
                "decode_tok_s", "prefill_tok_s", "ttft_mean_s", "ttft_p50_s", "kv_tokens_used", "kv_tokens_total"):
        assert key in s
    assert s["decode_tok_s"] > 0 and s["ttft_p50_s"] > 0 and s["output_tokens_total"] >= GREEDY.max_tokens
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [engine.config.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("empty", [], GREEDY)
    assert engine.max_context == min(256, engine.config.max_position_embeddings)


def test_custom_experts_are_used_and_their_counters_reach_stats(ftw, engine):
    from ft.formats import FtwReader
    from ft.runtime.experts import CpuExperts

    reader = FtwReader(ftw)

    class CountingExperts(CpuExperts):
        calls = 0

        def __call__(self, layer, x, topk_ids, topk_weights):
            self.calls += 1
            return super().__call__(layer, x, topk_ids, topk_weights)

        def stats(self):
            return {"calls": self.calls}

    experts = CountingExperts(reader, reader.config, dtype=reader.tensor("embed_tokens.weight").dtype)
    eng = Engine(reader, _settings(kv_reserve_tokens=256), experts=experts)
    res = generate(eng, PROMPTS[1], GREEDY)
    assert res.token_ids == generate(engine, PROMPTS[1], GREEDY).token_ids
    assert eng.stats()["moe"]["calls"] == experts.calls > 0
    assert "moe" not in engine.stats()


# ---- decode steps in flight ----------------------------------------------------------------------------------------

def _manual(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens of one request run synchronously at the model level: forward, sample, read back, repeat."""
    import torch

    from ft.runtime.model import Segment
    from ft.runtime.sampling import RequestSampler, sample

    model = engine.model
    st = model.new_state(len(prompt) + params.max_tokens)
    sampler = RequestSampler(params, prompt, model.config.vocab_size)
    out = []
    ids = prompt
    for _ in range(params.max_tokens):
        [logits] = model.forward(torch.tensor(ids), [Segment(st, len(ids))])
        out.append(sample(logits[-1:], [sampler]).token_ids[0])
        ids = out[-1:]
    st.free()
    return out


def test_decode_steps_are_in_flight_and_their_events_come_one_step_later(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=256))
    eng.add_request("a", PROMPTS[0], GREEDY)
    assert [ev.token_id is not None for ev in eng.step()] == [True]  # prefill: its first token at once
    assert eng.step() == [] and eng._inflight is not None  # the 2nd token is sampled on the device, not yet read
    tokens = [ev.token_id for ev in eng.step()]  # launches the 3rd, lands the 2nd
    assert len(tokens) == 1 and eng._inflight is not None
    events = _run_all(eng)["a"]
    assert len(events) == GREEDY.max_tokens - 2 and events[-1].finish_reason == "length"
    # the request's last step was not launched beyond max_tokens: nothing is left in flight for it
    assert eng._inflight is None or all(r.finish_reason is not None for r in eng._inflight.requests)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.8, frequency_penalty=0.7, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, top_k=20, presence_penalty=1.0, seed=7, ignore_eos=True),
], ids=["greedy-penalties", "seeded-penalties"])
def test_in_flight_decode_samples_as_the_synchronous_loop(ftw, params):
    # the penalties' statistics take each token on the device (never read back) before the next step samples
    eng = Engine(ftw, _settings(kv_reserve_tokens=256))
    assert generate(eng, PROMPTS[2], params).token_ids == _manual(eng, PROMPTS[2], params)


def test_a_stop_token_ends_the_request_though_the_next_step_was_already_launched(ftw):
    eng = Engine(ftw, _settings(kv_reserve_tokens=256))
    ref = generate(eng, PROMPTS[1], GREEDY).token_ids
    stop = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(ref[5],))
    res = generate(eng, PROMPTS[1], stop)
    assert res.token_ids == ref[:ref.index(ref[5]) + 1] and res.finish_reason == "stop"
    assert generate(eng, PROMPTS[3], GREEDY).token_ids == generate(eng, PROMPTS[3], GREEDY).token_ids
    assert eng.stats()["kv_tokens_used"] == 0
