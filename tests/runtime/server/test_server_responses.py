"""OpenAI Responses API (stateless) through the unmodified openai SDK against live servers."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-qwen3"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_non_stream_matches_chat_and_stream(openai_client):
    chat = openai_client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], max_tokens=10, temperature=0)
    resp = openai_client.responses.create(model=MODEL, instructions="Be brief.", input="Hello", max_output_tokens=10,
                                          temperature=0)
    assert resp.output_text == (chat.choices[0].message.content or "")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    truncated = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if truncated else "completed")
    if truncated:
        assert resp.incomplete_details.reason == "max_output_tokens"

    events = list(openai_client.responses.create(model=MODEL, instructions="Be brief.", input="Hello",
                                                 max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if truncated else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert events[-1].response.output_text == resp.output_text


def test_stream_helper_final_response(openai_client):
    base = dict(model=MODEL, input="Tell me a story", max_output_tokens=20, temperature=0)
    text = openai_client.responses.create(**base).output_text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if text[i:i + 2].strip() == text[i:i + 2] and text[i:i + 2] not in text[:i + 1])
    with openai_client.responses.stream(**base, extra_body={"stop": [stop]}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text[:text.index(stop)].strip()


def test_function_call_items(openai_client, server):
    kwargs = dict(model=MODEL, input="Weather in Rome?", tools=[TOOL], max_output_tokens=6, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
    resp = openai_client.responses.create(**kwargs)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and calls[0].call_id.startswith("call_")
    events = list(openai_client.responses.create(stream=True, **kwargs))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added and added[0].item.name == "get_weather"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done[0].arguments == deltas == calls[0].arguments

    items = [{"role": "user", "content": "Weather in Rome?"},
             {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_9", "output": "21 C"}]
    follow = openai_client.responses.create(model=MODEL, input=items, tools=[TOOL], max_output_tokens=1,
                                            temperature=0)
    tok = server.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Weather in Rome?"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "call_9", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Rome"}}}]},
         {"role": "tool", "tool_call_id": "call_9", "content": "21 C"}],
        tools=[{"type": "function", "function": {k: TOOL[k] for k in ("name", "parameters", "description")}}])
    assert follow.usage.input_tokens == len(tok.encode(prompt))
    assert calls[0].arguments.startswith("{")  # the forced prefix opened the arguments object


def test_reasoning_item(think_server):
    client = openai.OpenAI(base_url=think_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    resp = client.responses.create(model="tiny-qwen35", input="Hi", max_output_tokens=2, temperature=0)
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text
    events = list(client.responses.create(model="tiny-qwen35", input="Hi", max_output_tokens=2, temperature=0,
                                          stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == resp.output[0].content[0].text


def test_stateless_refuses_previous_response_id(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"


def test_reasoning_tokens_are_counted_in_the_output(think_server):
    """usage.output_tokens_details.reasoning_tokens counts generated tokens (up to the one closing the reasoning),
    never re-tokenized text: all of them while the output is still reasoning, never more than output_tokens."""
    client = openai.OpenAI(base_url=think_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    for n in (2, 9, 24):
        resp = client.responses.create(model="tiny-qwen35", input="Hi", max_output_tokens=n, temperature=0)
        usage = resp.usage
        assert usage.output_tokens == n and usage.output_tokens_details.reasoning_tokens <= n
        if [item.type for item in resp.output] == ["reasoning"]:  # still thinking when the cap hit
            assert usage.output_tokens_details.reasoning_tokens == n
