"""OpenAI endpoints through the unmodified openai SDK against a live server (greedy decoding on a tiny model)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest

from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.server.parsers import ParserSpec, parse_all

MODEL = "tiny-qwen3"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine(qwen3_ftw):
    """A second engine on the same FTW: the reference the server must reproduce."""
    return Engine(qwen3_ftw, EngineSettings(kv_reserve_tokens=4096))


def _reference_chat(engine, messages, max_tokens, tools=None):
    tok = engine.tokenizer
    prompt = tok.apply_chat_template(messages, tools=tools)
    result = generate(engine, tok.encode(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))
    return prompt, result, parse_all(result.text, ParserSpec.detect(tok.chat_template, prompt, tools=bool(tools)),
                                     tools)


def _stream_chat(client, **kwargs):
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    return chunks, content, reasoning


def test_models(openai_client, server):
    models = openai_client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = openai_client.models.retrieve(MODEL)
    assert card.max_model_len == server.state.loop.engine.max_context
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("nope")


def test_chat_matches_engine_and_stream_matches_non_stream(openai_client, engine):
    _, ref, parsed = _reference_chat(engine, MESSAGES, 16)
    full = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    choice = full.choices[0]
    assert (choice.message.content or "") == parsed.content
    assert (choice.message.reasoning_content or "") == parsed.reasoning
    assert full.usage.completion_tokens == len(ref.token_ids)
    assert full.usage.prompt_tokens == ref.prompt_tokens
    assert choice.finish_reason == {"length": "length", "stop": "stop"}[ref.finish_reason]

    chunks, content, reasoning = _stream_chat(openai_client, model=MODEL, messages=MESSAGES, max_tokens=16,
                                              temperature=0, stream_options={"include_usage": True})
    assert (content, reasoning) == (parsed.content, parsed.reasoning)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    chunks, _, _ = _stream_chat(openai_client, model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason is not None


def test_chat_logprobs(openai_client, engine):
    _, ref, _ = _reference_chat(engine, MESSAGES, 6)
    out = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    tok = engine.tokenizer
    assert [bytes(e.bytes) for e in entries] == [tok.token_bytes(t) for t in ref.token_ids]
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-5)  # greedy: the best token
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                        logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_tools_and_tool_results_reach_the_template(openai_client, server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    out = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=2,
                                                temperature=0)
    tok = server.tokenizer
    expected = [dict(messages[0]), {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        dict(messages[2])]
    prompt = tok.apply_chat_template(expected, tools=[WEATHER])
    assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\n18 C, sunny" in prompt
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    none = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                                 max_tokens=1, temperature=0)
    assert none.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(expected)))


def test_named_tool_choice_forces_a_call(openai_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=8, temperature=0)
    out = openai_client.chat.completions.create(**kwargs)
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].id.startswith("call_")
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments


def test_response_format_is_accepted_and_counted(openai_client, server):
    before = server.state.stats()["response_format"].get("json_object", 0)
    openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                          response_format={"type": "json_object"})
    assert server.state.stats()["response_format"]["json_object"] == before + 1


def test_completions_token_ids_match_generate(openai_client, engine):
    ids = [(13 * i + 5) % 400 + 20 for i in range(30)]
    ref = generate(engine, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    out = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                           extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == ref.text and out.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(choice.logprobs.token_logprobs, ref.logprobs))
    streamed = list(openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
    echo = openai_client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Once upon")


def test_completions_stop_string(openai_client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    text = openai_client.completions.create(**kwargs).choices[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and text[i:i + 2] not in
                text[:i + 1])
    out = openai_client.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"


def test_parallel_streams_match_solo_runs(server, openai_client):
    prompts = [[(7 * i + 31 * k) % 300 + 40 for i in range(12 + 3 * k)] for k in range(8)]
    solo = [openai_client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == solo
    server.wait_idle()


def test_disconnect_mid_stream_frees_the_slot(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before = server.state.loop.engine_stats["requests_aborted"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        busy = httpx.get(server.url + "/v1/stats").json()
        assert busy["scheduler"]["running"] == 1 and busy["kv"]["used_tokens"] > 0
    t0 = time.monotonic()
    stats = server.wait_idle()
    assert time.monotonic() - t0 < 5
    assert stats["engine"]["requests_aborted"] == before + 1 and stats["requests"]["disconnected"] >= 1

    # non-streaming: the client gives up (timeout) and closes the connection; the server notices within ~1 s
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 10
    while server.state.loop.engine_stats["requests_aborted"] < before + 2:
        assert time.monotonic() < deadline, "the abandoned non-streaming request was not aborted"
        time.sleep(0.05)
    server.wait_idle()


def test_a_follow_up_turn_reports_the_reused_prefix(openai_client, engine):
    """The second turn resends the first: its prompt tokens come from the server's prefix cache (usage says how
    many), and its reply is the one the reference engine gives without any cache."""
    first = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And three animals?"}]
    second = openai_client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    plain = Engine(engine._reader, EngineSettings(kv_reserve_tokens=4096, prefix_cache_entries=0))
    _, _, parsed = _reference_chat(plain, turn, 8)
    assert (second.choices[0].message.content or "") == parsed.content
