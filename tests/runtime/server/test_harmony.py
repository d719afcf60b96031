"""gpt-oss harmony: the parser on recorded-style outputs (one shot and any split), and the synthetic chat template."""

from __future__ import annotations

import json
import random

import pytest

from ft.runtime.server.parsers import ParsedOutput, ParserSpec, make_parser, parse_all

CHAT = "<|start|>system<|message|>You are ChatGPT.<|end|>"
TOOLS_SPEC = ParserSpec.detect(CHAT + "<|channel|>", "", tools=True)
PLAIN_SPEC = ParserSpec.detect(CHAT + "<|channel|>", "", tools=False)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}

# (name, spec, output as the engine returns it (stop tokens <|return|> / <|call|> not included), reasoning, content,
#  tool calls [(name, arguments)])
CASES = [
    ("analysis_then_final", PLAIN_SPEC,
     "<|channel|>analysis<|message|>User greets. Reply briefly.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello! How can I help?", "User greets. Reply briefly.", "Hello! How can I help?", []),
    ("final_only", PLAIN_SPEC, "<|channel|>final<|message|>Just the answer.", "", "Just the answer.", []),
    ("tool_call_recipient_after_channel", TOOLS_SPEC,
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "Need weather.", "",
     [("get_weather", {"city": "Paris"})]),
    ("tool_call_recipient_before_channel", TOOLS_SPEC,
     '<|channel|>analysis<|message|>Two cities.<|end|><|start|>assistant to=functions.get_weather<|channel|>'
     'commentary json<|message|>{"city": "Oslo"}<|call|>', "Two cities.", "", [("get_weather", {"city": "Oslo"})]),
    ("preamble_then_call", TOOLS_SPEC,
     "<|channel|>commentary<|message|>Checking the weather now.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}', "", "Checking the weather now.",
     [("get_weather", {"city": "Rome"})]),
    ("call_cut_by_max_tokens", TOOLS_SPEC,
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par', "", "",
     [("get_weather", {"city": "Par"})]),
    ("reasoning_cut_by_max_tokens", PLAIN_SPEC, "<|channel|>analysis<|message|>Let me think about <this> and",
     "Let me think about <this> and", "", []),
    ("recipient_without_tools_is_content", PLAIN_SPEC,
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Nice"}', "",
     '{"city": "Nice"}', []),
    ("not_harmony_at_all", PLAIN_SPEC, "plain text < with a sign", "", "plain text < with a sign", []),
]


def _check(parsed: ParsedOutput, reasoning: str, content: str, calls: list) -> None:
    assert parsed.reasoning == reasoning
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


@pytest.mark.parametrize("name,spec,text,reasoning,content,calls", CASES, ids=[c[0] for c in CASES])
def test_one_shot(name, spec, text, reasoning, content, calls):
    assert spec.harmony
    _check(parse_all(text, spec, [WEATHER]), reasoning, content, calls)


@pytest.mark.parametrize("name,spec,text,reasoning,content,calls", CASES, ids=[c[0] for c in CASES])
def test_any_split_gives_the_same_result(name, spec, text, reasoning, content, calls):
    rng = random.Random(name)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        parser, parsed = make_parser(spec, [WEATHER]), ParsedOutput()
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            parsed.add(parser.feed(text[a:b]))
        parsed.add(parser.finish())
        _check(parsed, reasoning, content, calls)


def test_events_stream_tool_arguments_in_order():
    parser = make_parser(TOOLS_SPEC, [WEATHER], id_factory=lambda: "call_x")
    events = parser.feed("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"ci")
    events += parser.feed('ty": "Paris"}')
    events += parser.finish()
    assert [(e.kind, e.text, e.name) for e in events] == [
        ("tool_start", "json", "get_weather"), ("tool_args", '{"ci', ""), ("tool_args", 'ty": "Paris"}', ""),
        ("tool_end", "", "")]
    assert {e.index for e in events} == {0}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from ft.compiler.synth.tokenizer import write_tokenizer_files
    from ft.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("harmony-tok")
    write_tokenizer_files(d, "harmony", 512)
    return Tokenizer.from_files(d / "tokenizer.json", d / "chat_template.jinja")


def test_template_renders_a_tool_conversation(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.")
    assert "Reasoning: medium" in text and "Calls to these tools must go to the commentary channel" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n" in text
    assert "type get_weather = (_: {\ncity?: string,\n}) => any;" in text
    assert ("<|start|>user<|message|>Weather in Paris?<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18C, sunny<|end|>"
            "<|start|>assistant") in text
    assert text.endswith("<|start|>assistant")
    ids = tokenizer.encode(text)
    for tag in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>"):  # single special tokens
        assert tokenizer.token_to_id(tag) in ids


def test_template_drops_old_reasoning_and_keeps_answers(tokenizer):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "reasoning_content": "Old thoughts.", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages, reasoning_effort="high")
    assert "Reasoning: high" in text and "Old thoughts." not in text and "<|start|>developer" not in text
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|><|start|>user<|message|>Bye<|end|>" in text
