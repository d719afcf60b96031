"""GLM-4.5-family output: `<think>` reasoning and `<tool_call>NAME` + `<arg_key>`/`<arg_value>` tool calls, parsed the
same whichever way the text is split; detection from the template; the forced prefix of tool_choice."""

from __future__ import annotations

import json
import random

import pytest

from ft.runtime.server.generation import forced_prefix
from ft.runtime.server.parsers import OutputParser, ParsedOutput, ParserSpec, parse_all

# the parts of GLM-4.5's chat template that detection looks at (its tool instructions and <think> handling)
TEMPLATE = ("[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n...<tool_call>{function-name}\n<arg_key>{arg-key-1}"
            "</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n</tool_call>{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|><think></think>")
SPEC = ParserSpec.detect(TEMPLATE, "[gMASK]<sop><|user|>\nhi<|assistant|>", tools=True)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {}}}]
TEXT = ("<think>The user wants weather.</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>New York, NY</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units"
        "</arg_key>\n<arg_value>[\"C\", \"F\"]</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>")


def _split(text: str, cuts: list[int]) -> ParsedOutput:
    parser, out, pos = OutputParser(SPEC, TOOLS), ParsedOutput(), 0
    for c in sorted(cuts) + [len(text)]:
        out.add(parser.feed(text[pos:c]))
        pos = max(pos, c)
    out.add(parser.finish())
    return out


def _fold(p: ParsedOutput) -> tuple:
    return p.reasoning, p.content, [(c.name, c.arguments) for c in p.tool_calls]


def test_detects_glm_tool_format():
    assert (SPEC.tool_format, SPEC.reasoning, SPEC.starts_in_reasoning) == ("glm", True, False)
    assert ParserSpec.detect(TEMPLATE, "", tools=False).tool_format is None
    assert ParserSpec.detect("<tool_call><function=x>", "", tools=True).tool_format == "xml"


def test_calls_reasoning_and_content():
    out = parse_all(TEXT, SPEC, TOOLS)
    assert (out.reasoning, out.content) == ("The user wants weather.", "Let me check.")
    assert [c.name for c in out.tool_calls] == ["get_weather", "now"]
    assert json.loads(out.tool_calls[0].arguments) == {"city": "New York, NY", "days": 3, "units": ["C", "F"]}
    assert json.loads(out.tool_calls[1].arguments) == {}
    assert len({c.id for c in out.tool_calls}) == 2


def test_random_splits_match_one_shot():
    expected = _fold(parse_all(TEXT, SPEC, TOOLS))
    rng = random.Random(0)
    for _ in range(200):
        assert _fold(_split(TEXT, [rng.randrange(len(TEXT) + 1) for _ in range(rng.randrange(1, 30))])) == expected
    assert _fold(_split(TEXT, list(range(len(TEXT))))) == expected


@pytest.mark.parametrize("block", ["not a call at all", "get_weather\nstray <arg_key>city</arg_key><arg_value>x"
                                                         "</arg_value>"])
def test_a_block_that_is_not_a_call_stays_text(block):
    out = parse_all(f"<think></think>Answer <tool_call>{block}</tool_call> done", SPEC, TOOLS)
    assert out.tool_calls == [] and out.content == f"Answer <tool_call>{block}</tool_call> done"


def test_unknown_function_keeps_string_values_and_one_line_form():
    out = parse_all("<tool_call>lookup<arg_key>q</arg_key><arg_value>42</arg_value></tool_call>", SPEC, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("lookup", {"q": "42"})]


def test_forced_prefix_opens_a_glm_call():
    assert forced_prefix(SPEC, ("function", "get_weather"), "p") == "<think>\n\n</think>\n\n<tool_call>get_weather\n"
    assert forced_prefix(SPEC, "required", "p</think>") == "<tool_call>"
    out = parse_all("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
                    SPEC, TOOLS)
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Oslo"}


def test_synthetic_glm_template_renders_the_glm_format(hf_for):
    """The synthetic checkpoint's template (transformers renders it): GLM's turn markers, tool instructions, calls in
    history as <arg_key>/<arg_value> pairs, tool results as <|observation|>; its parser spec is GLM's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_for("glm4_moe"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
            {"role": "assistant", "content": "<think>ok</think>It is 3 C."}]
    text = tok.apply_chat_template(msgs, tools=TOOLS[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n") and "<arg_key>{arg-key-1}</arg_key>" in text
    assert text.endswith(
        "<|system|>\nBe brief.<|user|>\nWeather in Oslo?<|assistant|>\n<think>Need the tool.</think>\n"
        "<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
        "</tool_call><|observation|>\n<tool_response>\n{\"temp\": 3}\n</tool_response><|assistant|>\n"
        "<think>ok</think>\nIt is 3 C.<|assistant|>")
    older = tok.apply_chat_template(msgs + [{"role": "user", "content": "Thanks"}], tokenize=False)
    assert "<think></think>\n<tool_call>get_weather" in older  # reasoning before the last user turn is dropped
    no_think = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == "[gMASK]<sop><|user|>\nWeather in Oslo?/nothink<|assistant|>\n<think></think>"
    ids = tok.apply_chat_template(msgs[1:2], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == tok.convert_tokens_to_ids(["[gMASK]", "<sop>"]) and ids[-1] == tok.convert_tokens_to_ids(
        "<|assistant|>")
    spec = ParserSpec.detect(tok.chat_template, text, tools=True)
    assert (spec.tool_format, spec.reasoning, spec.starts_in_reasoning) == ("glm", True, False)
