"""Anthropic Messages through the unmodified anthropic SDK against live servers (greedy decoding, tiny models)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

MODEL = "tiny-qwen3"
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more: sent as extra fields
USER = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _blocks(message) -> list[tuple]:
    out = []
    for b in message.content:
        if b.type == "text":
            out.append(("text", b.text))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking, b.signature))
        elif b.type == "tool_use":
            out.append(("tool_use", b.name, b.input))
    return out


def test_stream_equals_non_stream_and_count_tokens(anthropic_client):
    kwargs = dict(model=MODEL, max_tokens=14, system="You are terse.", messages=USER, extra_body=GREEDY)
    full = anthropic_client.messages.create(**kwargs)
    assert full.role == "assistant" and full.id.startswith("msg_")
    assert full.stop_reason in ("max_tokens", "end_turn") and full.usage.output_tokens <= 14
    with anthropic_client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(full)
    assert (final.stop_reason, final.usage.output_tokens) == (full.stop_reason, full.usage.output_tokens)
    assert kinds[0] == "message_start" and "content_block_start" in kinds and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    count = anthropic_client.messages.count_tokens(model=MODEL, system="You are terse.", messages=USER)
    assert count.input_tokens == full.usage.input_tokens + full.usage.cache_read_input_tokens  # the prompt, in parts
    blocks = anthropic_client.messages.count_tokens(model=MODEL, messages=USER,
                                                   system=[{"type": "text", "text": "You are terse."}])
    assert blocks.input_tokens == count.input_tokens


def test_raw_event_stream_shape(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": USER, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"]
    assert events[-2:] == ["message_delta", "message_stop"] and "[DONE]" not in events
    starts, stops = events.count("content_block_start"), events.count("content_block_stop")
    assert starts == stops >= 1


def test_stop_sequence(anthropic_client):
    kwargs = dict(model=MODEL, max_tokens=24, messages=USER, extra_body=GREEDY)
    text = anthropic_client.messages.create(**kwargs).content[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if text[i:i + 2].strip() == text[i:i + 2] and text[i:i + 2] not in text[:i + 1])
    out = anthropic_client.messages.create(stop_sequences=[stop], **kwargs)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[:text.index(stop)].strip()


def test_tools_and_tool_results_reach_the_template(anthropic_client, server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
                    "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "18 C, sunny"}]},
                                             {"type": "text", "text": "And tomorrow?"}]}]
    count = anthropic_client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    tok = server.tokenizer
    expected = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
                {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": WEATHER["input_schema"]}}]
    prompt = tok.apply_chat_template(expected, tools=tools)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert count.input_tokens == len(tok.encode(prompt))
    out = anthropic_client.messages.create(model=MODEL, max_tokens=2, messages=messages, tools=[WEATHER],
                                           extra_body=GREEDY)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == count.input_tokens


def test_thinking_blocks_and_forced_tool_use(think_server):
    client = anthropic.Anthropic(base_url=think_server.url, api_key="x", max_retries=0, timeout=120)
    kwargs = dict(model="tiny-qwen35", max_tokens=3, messages=USER, extra_body=GREEDY)
    full = client.messages.create(**kwargs)  # the qwen3.5 template opens <think>: the output is reasoning
    assert full.content[0].type == "thinking" and full.content[0].signature
    with client.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(full)
    assert "thinking_delta" in deltas and deltas[-1] == "signature_delta"
    off = client.messages.count_tokens(model="tiny-qwen35", messages=USER, thinking={"type": "disabled"})
    on = client.messages.count_tokens(model="tiny-qwen35", messages=USER)
    assert off.input_tokens > on.input_tokens  # `<think>\n\n</think>\n\n` closes reasoning in the prompt

    forced = dict(model="tiny-qwen35", max_tokens=2, messages=USER, tools=[WEATHER], extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"})
    out = client.messages.create(**forced)
    uses = [b for b in out.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"] and uses[0].id.startswith("toolu_")
    assert isinstance(uses[0].input, dict) and out.stop_reason in ("tool_use", "max_tokens")
    with client.messages.stream(**forced) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(out)


def test_forced_json_tool_use_streams_a_checked_object(anthropic_client):
    # Hermes (JSON) dialect: the random model writes arbitrary argument text; the stream must still be one the SDK
    # can accumulate, and equal to the non-streaming answer.
    kwargs = dict(model=MODEL, max_tokens=6, messages=USER, tools=[WEATHER], extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"})
    full = anthropic_client.messages.create(**kwargs)
    assert [b.name for b in full.content if b.type == "tool_use"] == ["get_weather"]
    with anthropic_client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(full)


def test_unknown_block_type_is_a_400(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]


@pytest.mark.parametrize("fixture", ["server", "think_server"])
def test_assistant_prefill_is_continued_not_closed(fixture, request):
    """A trailing assistant message is the start of the reply: the prompt ends with its text (no end of turn, no
    new assistant header), as transformers' continue_final_message renders it."""
    live = request.getfixturevalue(fixture)
    tok = live.tokenizer
    chat = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    full = tok.apply_chat_template(chat, add_generation_prompt=False)
    want = tok.encode(full[:full.rindex("My favourite color is") + len("My favourite color is")])
    body = {"model": live.state.model_name, "messages": chat}
    counted = httpx.post(live.url + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert counted == len(want)
    reply = httpx.post(live.url + "/v1/messages", json={**body, "max_tokens": 3, "temperature": 0}).json()
    assert reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == len(want)
    empty = httpx.post(live.url + "/v1/messages/count_tokens",
                       json={**body, "messages": [chat[0], {"role": "assistant", "content": " "}]})
    assert empty.status_code == 400 and "cannot be continued" in empty.json()["error"]["message"]
