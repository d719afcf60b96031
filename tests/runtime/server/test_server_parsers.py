"""Reasoning and tool-call parsers on recorded model outputs: one-shot results, and identical results for any split."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.runtime.server.parsers import OutputParser, ParsedOutput, ParserSpec, parse_all
from ft.runtime.server.param_types import convert_param
from ft.runtime.server.json_close import json_closer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}
TYPED = {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
    "ratio": {"type": "number"}, "count": {"type": "number"}, "verbose": {"type": "boolean"},
    "opts": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
    "note": {"type": ["string", "null"]}, "limit": {"type": "integer", "nullable": True},
    "mode": {"enum": ["fast", "slow"]}}}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}
TOOLS = [WEATHER, TYPED, WRITE]

HERMES = ParserSpec(reasoning=True, starts_in_reasoning=False, tool_format="hermes")  # Qwen3 hybrid
XML = ParserSpec(reasoning=True, starts_in_reasoning=True, tool_format="xml")  # Qwen3.5/3.6, thinking on

# (name, spec, recorded output, expected reasoning, expected content, expected [(name, arguments as dict)])
CASES = [
    ("hermes_think_call", HERMES,
     '<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     "The user wants the weather in Paris. I should call get_weather.", "",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes_parallel_with_content", HERMES,
     "<think>\n\n</think>\n\nI'll check both cities.\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 2}}\n</tool_call>',
     "", "I'll check both cities.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo", "days": 2})]),
    ("hermes_nested_braces", HERMES,
     '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": "def f():\\n    return '
     '{\'a\': [1, 2]}\\n}"}}\n</tool_call>',
     "", "", [("write_file", {"path": "a.py", "content": "def f():\n    return {'a': [1, 2]}\n}"})]),
    ("hermes_arguments_first", HERMES,
     '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
     "", "", [("get_weather", {"city": "Oslo"})]),
    ("hermes_not_json", HERMES,
     "Sure. <tool_call>\n{not json}\n</tool_call> done",
     "", "Sure. <tool_call>\n{not json}\n</tool_call> done", []),
    ("hermes_truncated_call", HERMES,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     "", "", [("get_weather", {"city": "Par"})]),  # cut by max_tokens: closed, still JSON
    ("plain_answer_no_think", HERMES, "Hello! How can I help?", "", "Hello! How can I help?", []),
    ("less_than_signs", HERMES, "if a < b and c <tool", "", "if a < b and c <tool", []),
    ("truncated_reasoning", HERMES, "<think>\nLet me think about <this> carefully", "Let me think about <this> "
     "carefully", "", []),
    ("xml_prompt_opened_think", XML,
     "The user asks for the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "The user asks for the weather.", "", [("get_weather", {"city": "New York", "days": 3})]),
    ("xml_implicit_end_of_reasoning", XML,
     "I must call the tool.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "</function>\n</tool_call>",
     "I must call the tool.", "", [("get_weather", {"city": "Paris"})]),
    ("xml_tool_call_tag_mentioned_in_reasoning", XML,
     "I could use <tool_call> tags later.\n</think>\n\nNo tool needed: it is sunny.",
     "I could use <tool_call> tags later.", "No tool needed: it is sunny.", []),
    ("xml_typed_values", XML,
     "ok\n</think>\n\nConfiguring.\n<tool_call>\n<function=configure>\n<parameter=ratio>\n0.5\n</parameter>\n"
     "<parameter=count>\n4.0\n</parameter>\n<parameter=verbose>\nTrue\n</parameter>\n<parameter=opts>\n"
     '{"depth": 2}\n</parameter>\n<parameter=tags>\n[\'a\', \'b\']\n</parameter>\n<parameter=note>\nnull\n'
     "</parameter>\n<parameter=limit>\nNone\n</parameter>\n<parameter=mode>\nfast\n</parameter>\n"
     "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>",
     "ok", "Configuring.",
     [("configure", {"ratio": 0.5, "count": 4, "verbose": True, "opts": {"depth": 2}, "tags": ["a", "b"],
                     "note": None, "limit": None, "mode": "fast", "extra": "7"})]),
    ("xml_missing_param_close_and_function_in_value", XML,
     "</think>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nnotes.xml\n<parameter=content>\n"
     "<function>\n</function>\nline two\n\n</parameter>\n</function>\n</tool_call>",
     "", "", [("write_file", {"path": "notes.xml", "content": "<function>\n</function>\nline two\n"})]),
    ("xml_function_close_ends_value", XML,
     "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</function>\n</tool_call>",
     "", "", [("get_weather", {"city": "Rome"})]),
    ("xml_two_calls_no_params", XML,
     "</think>\n\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=write_file>\n<parameter=path>\nx\n</parameter>\n</function>\n</tool_call>",
     "", "", [("get_weather", {}), ("write_file", {"path": "x"})]),
    ("xml_truncated_in_string_value", XML,
     "plan\n</think>\n\n<tool_call>\n<function=write_file>\n<parameter=content>\nhello wor",
     "plan", "", [("write_file", {"content": "hello wor"})]),
    ("xml_model_writes_json_call", XML,
     'x</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>',
     "x", "", [("get_weather", {"city": "Lima"})]),
    ("xml_thinking_disabled_content", ParserSpec(True, False, "xml"), "\n\nJust text, no call.", "",
     "Just text, no call.", []),
    ("no_tools_tags_stay_text", ParserSpec(True, False, None),
     "<think>\nhm\n</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "hm",
     '<tool_call>\n{"name": "f"}\n</tool_call>', []),
]


def _fold(parsed: ParsedOutput) -> tuple:
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def _parse_split(text: str, spec: ParserSpec, cuts: list[int]) -> ParsedOutput:
    parser, result, last = OutputParser(spec, TOOLS), ParsedOutput(), 0
    for cut in sorted(set(cuts)) + [len(text)]:
        result.add(parser.feed(text[last:cut]))
        last = cut
    result.add(parser.finish())
    return result


@pytest.mark.parametrize("name,spec,text,reasoning,content,calls", CASES, ids=[c[0] for c in CASES])
def test_one_shot(name, spec, text, reasoning, content, calls):
    parsed = parse_all(text, spec, TOOLS)
    assert parsed.reasoning == reasoning
    assert parsed.content == content
    assert [c.name for c in parsed.tool_calls] == [c[0] for c in calls]
    for call, (_, expected) in zip(parsed.tool_calls, calls):
        assert call.id.startswith("call_") and len(call.id) == 29
        if isinstance(expected, dict):
            assert json.loads(call.arguments) == expected
        else:  # truncated output: the arguments streamed so far
            assert call.arguments == expected


@pytest.mark.parametrize("name,spec,text", [c[:3] for c in CASES], ids=[c[0] for c in CASES])
def test_random_splits_match_one_shot(name, spec, text):
    expected = _fold(parse_all(text, spec, TOOLS))
    rng = random.Random(name)
    for _ in range(150):
        cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 30))]
        assert _fold(_parse_split(text, spec, cuts)) == expected
    assert _fold(_parse_split(text, spec, list(range(len(text))))) == expected  # one character at a time


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_hypothesis_splits(case, cuts):
    _, spec, text = case[:3]
    assert _fold(_parse_split(text, spec, [c % (len(text) + 1) for c in cuts])) == _fold(parse_all(text, spec, TOOLS))


def test_stream_events_are_typed_and_ordered():
    text = CASES[9][2]
    parser = OutputParser(XML, TOOLS, id_factory=lambda: "call_fixed")
    events = [e for i in range(0, len(text), 3) for e in parser.feed(text[i:i + 3])] + parser.finish()
    kinds = [e.kind for e in events]
    assert kinds[0] == "reasoning" and kinds[-1] == "tool_end"
    start = events[kinds.index("tool_start")]
    assert (start.index, start.id, start.name, start.text) == (0, "call_fixed", "get_weather", "xml")
    hermes = OutputParser(HERMES, TOOLS).feed(CASES[0][2])
    assert [e.text for e in hermes if e.kind == "tool_start"] == ["json"]
    # the string parameter streams in pieces; no reasoning text after the call started
    assert sum(k == "tool_args" for k in kinds) > 4
    assert "reasoning" not in kinds[kinds.index("tool_start"):]
    # partial tags are never emitted as reasoning
    assert all("<" not in e.text for e in events if e.kind == "reasoning")


def test_spec_detection():
    xml_template = "{% if enable_thinking %}<think>\n{% endif %}<tool_call>\n<function=..."
    hermes_template = "<tool_call>\n{\"name\": ...} <think>\n\n</think>"
    spec = ParserSpec.detect(xml_template, "<|im_start|>assistant\n<think>\n", tools=True)
    assert spec == ParserSpec(True, True, "xml")
    spec = ParserSpec.detect(hermes_template, "<|im_start|>assistant\n", tools=True)
    assert spec == ParserSpec(True, False, "hermes")
    assert ParserSpec.detect(hermes_template, "<|im_start|>assistant\n<think>\n\n</think>\n\n", tools=False) \
        == ParserSpec(True, False, None)
    assert ParserSpec.detect(None, "x", tools=True) == ParserSpec(False, False, "hermes")


@pytest.mark.parametrize("text,schema,expected", [
    ("42", {"type": "integer"}, 42), ("4x", {"type": "integer"}, "4x"), ("2.50", {"type": "number"}, 2.5),
    ("FALSE", {"type": "boolean"}, False), ("[1, 2]", {"type": "array"}, [1, 2]),
    ("{'a': None}", {"type": "object"}, {"a": None}), ("null", {"type": "string"}, "null"),
    ("null", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None), (" padded ", None, " padded "),
])
def test_convert_param(text, schema, expected):
    assert convert_param(text, schema) == expected


@pytest.mark.parametrize("full", [
    '{"city": "Par\\"is", "days": [1, 2, {"x": true, "y": -1.5e3}], "note": null, "ok": false, "e": {}, "l": []}',
    '{"a": {"b": [[1], {"c": "d,}]"}]}, "u": "\\u00e9", "k\\u00e9y": [0.5, "x"] , "z" : {"q":[]}}',
])
def test_json_closer_makes_every_cut_valid_json(full):
    """A tool call's arguments cut anywhere by max_tokens become JSON by appending only (their start has been
    streamed): strings, escapes, literals and numbers completed, dangling keys given null, brackets closed."""
    for k in range(1, len(full) + 1):
        cut = full[:k]
        json.loads(cut + json_closer(cut))
    assert json_closer("not json") == "" and json_closer('{"a": 1}}') == ""
