"""gpt-oss harmony output through the OpenAI and Anthropic APIs: reasoning, content, tool calls, a call cut by
max_tokens, and a forced (named) tool choice, on a live server running the tiny gpt_oss FTW.

A random tiny model never writes harmony on its own, so the engine's model is wrapped to steer greedy decoding along a
given completion (`Steer`: +1e4 on the scripted token's logit after the real forward); everything after the logits
(sampling, stop tokens, detokenization, the harmony parser, both APIs' mapping) is the server's own.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from ft.runtime.server.state import ServeSettings
from ft.runtime.settings import EngineSettings

MODEL = "tiny-gpt-oss"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
ANSWER = ("<|channel|>analysis<|message|>User asks; answer.<|end|><|start|>assistant<|channel|>final<|message|>"
          "It is sunny.<|return|>")


class Steer:
    """Wraps `model.forward`: a prefill (a segment of several tokens) starts the script of its sequence, each decode
    token moves it on; the scripted token gets +1e4 so that greedy sampling picks it."""

    def __init__(self, model) -> None:
        self.forward, self.script, self.step = model.forward, [], {}
        model.forward = self

    def __call__(self, input_ids, segments):
        lengths = [seg.state.length for seg in segments]
        out = self.forward(input_ids, segments)
        for seg, before, logits in zip(segments, lengths, out):
            key = id(seg.state)
            self.step[key] = 0 if seg.num_tokens > 1 or before == 0 else self.step.get(key, 0) + 1
            if self.step[key] < len(self.script):
                logits[-1, self.script[self.step[key]]] += 1e4
        return out


@pytest.fixture
def steered(ftw_for, make_server):
    """`steered(text) -> LiveServer` whose greedy completions follow `text` (one server per test)."""
    holder: dict = {}

    def load():
        from ft.runtime.engine import Engine

        engine = Engine(ftw_for("gpt_oss", "none"), EngineSettings(kv_reserve_tokens=4096, prefix_cache_entries=0))
        holder["steer"] = Steer(engine.model)
        return engine

    def use(text: str):
        if "live" not in holder:
            holder["live"] = make_server(ServeSettings(ftw=ftw_for("gpt_oss", "none"), engine=EngineSettings(),
                                                       port=0, keepalive_s=2.0, served_model_name=MODEL), load)
        holder["steer"].script = holder["live"].tokenizer.encode(text)
        return holder["live"]
    return use


def _openai(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_openai_reasoning_and_tool_call(steered):
    live = steered(CALL)
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=64, temperature=0)
    out = _openai(live).chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(_openai(live).chat.completions.create(stream=True, **kwargs))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                        if c.choices)
    assert reasoning == "Need the weather."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_openai_final_channel_is_content(steered):
    live = steered(ANSWER)
    out = _openai(live).chat.completions.create(model=MODEL, messages=USER, max_tokens=64, temperature=0)
    msg = out.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == ("It is sunny.", "User asks; answer.")
    assert out.choices[0].finish_reason == "stop" and not msg.tool_calls


def test_tool_call_cut_by_max_tokens_stays_json(steered):
    live = steered(CALL)
    tok = live.tokenizer
    cut = len(tok.encode(CALL[:CALL.index('Paris"}')])) + 1  # stops inside the string value
    out = _openai(live).chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=cut,
                                                temperature=0)
    [call] = out.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and list(args) == ["city"] and "Paris".startswith(args["city"][:1])
    assert out.choices[0].finish_reason in ("length", "tool_calls")


def test_anthropic_thinking_text_and_tool_use(steered):
    client = anthropic.Anthropic(base_url=steered(CALL).url, api_key="x", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]
    out = client.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=tools,
                                 extra_body={"temperature": 0})
    assert [b.type for b in out.content] == ["thinking", "tool_use"] and out.stop_reason == "tool_use"
    assert out.content[0].thinking == "Need the weather." and out.content[1].input == {"city": "Paris"}
    client = anthropic.Anthropic(base_url=steered(ANSWER).url, api_key="x", max_retries=0, timeout=120)
    out = client.messages.create(model=MODEL, max_tokens=64, messages=USER, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "text", None)) for b in out.content] == [("thinking", None), ("text", "It is sunny.")]
    assert out.stop_reason == "end_turn"


def test_named_tool_choice_opens_the_commentary_header(steered):
    live = steered('{"city": "Oslo"}<|call|>')  # the forced header ends at <|message|>: the model writes the args
    out = _openai(live).chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=16,
                                                temperature=0,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
