"""Streaming parser for chat model output: reasoning, content and tool calls (checkpoint-formats §9).

Fed text deltas, `OutputParser` emits typed ParseEvents: "reasoning" / "content" text, and per tool call
"tool_start" {index, id, name} -> "tool_args" fragments -> "tool_end". Partial tags are held back, and the concatenated
result is the same for every way of splitting the text (the one-shot parse is `feed(all) + finish()`).

States: probe (is there a leading `<think>`?) -> reasoning -> content <-> tool block.
  * Reasoning is on when the chat template mentions `<think>`. A prompt that ends with `<think>\\n` (Qwen3.5/3.6,
    Qwen3-Thinking-2507) starts the completion inside reasoning; otherwise a leading `<think>` opens it.
  * Reasoning ends at the first `</think>`; without one, all of it is reasoning (truncated output). With XML tools,
    `<tool_call>` followed by `<function=` also ends it (Qwen3.5 may skip `</think>`).
  * Each text run (reasoning, content before / between tool calls) is stripped of surrounding whitespace, which the
    templates add around tags (`</think>\\n\\n`, `\\n<tool_call>`).
gpt-oss's harmony format (a template with `<|channel|>`) has its own parser, `harmony.HarmonyParser`; `make_parser`
picks the parser a spec calls for.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ft.runtime.server.tool_parsers import ParseEvent, ToolBlock, partial_suffix

__all__ = ["ParseEvent", "ParserSpec", "OutputParser", "ParsedOutput", "ToolCall", "make_parser", "new_call_id",
           "parse_all"]

THINK_OPEN, THINK_CLOSE, CALL_OPEN = "<think>", "</think>", "<tool_call>"
HARMONY_CHANNEL = "<|channel|>"


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)  # `call_<24 hex>` like vLLM / OpenAI


@dataclass(frozen=True)
class ParserSpec:
    reasoning: bool  # the template knows <think> (harmony: an analysis channel)
    starts_in_reasoning: bool  # the rendered prompt opened <think>
    tool_format: str | None  # "xml" | "hermes" | "glm" | "harmony" | None (no tools in this request: tags stay text)
    harmony: bool = False  # gpt-oss channels (`harmony.HarmonyParser`)

    @classmethod
    def detect(cls, chat_template: str | None, prompt: str, *, tools: bool) -> ParserSpec:
        """Harmony if the template contains `<|channel|>`; else GLM tool calls if it contains `<arg_key>`, XML if it
        contains `<function=`, Hermes JSON otherwise; reasoning if it mentions `<think>`; inside reasoning from the
        start when the rendered prompt ends with `<think>\\n`."""
        template = chat_template or ""
        if HARMONY_CHANNEL in template:
            return cls(reasoning=True, starts_in_reasoning=False, tool_format="harmony" if tools else None,
                       harmony=True)
        reasoning = THINK_OPEN in template
        return cls(reasoning=reasoning, starts_in_reasoning=reasoning and prompt.endswith(THINK_OPEN + "\n"),
                   tool_format=_tool_format(template) if tools else None)


class _Run:
    """One channel's text run: leading whitespace dropped, trailing whitespace held until more text follows."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.started = False
        self.pending = ""

    def push(self, text: str, out: list[ParseEvent]) -> None:
        text = self.pending + text
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        body = text.rstrip()
        self.pending = text[len(body):]
        if body:
            out.append(ParseEvent(self.kind, body))

    def close(self) -> None:
        self.started, self.pending = False, ""


class StreamParser(ABC):
    """Text in as it is generated, events out: `feed` each piece, then `finish` once. A subclass keeps `buf` (text
    not consumed yet) and `finished`, and implements `_step(out, final)`: consume what it can of `buf`, appending
    events to `out`, and return whether another step may make progress."""

    buf: str
    finished: bool

    def feed(self, text: str) -> list[ParseEvent]:
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[ParseEvent]:
        """End of output: flush held-back text, close an open tool call (best effort for truncated output)."""
        out = self._run(final=True)
        self.finished = True
        return out

    def _run(self, final: bool) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        while self._step(out, final):
            pass
        return out

    @abstractmethod
    def _step(self, out: list[ParseEvent], final: bool) -> bool:
        """Consume what can be consumed of `buf`, appending events to `out`; whether another step may progress."""


class OutputParser(StreamParser):
    def __init__(self, spec: ParserSpec, tools: Iterable[dict] | None = None,
                 id_factory: Callable[[], str] = new_call_id) -> None:
        self.spec = spec
        self.schemas = _parameter_schemas(tools or ())
        self.id_factory = id_factory
        self.buf = ""
        self.state = "probe" if spec.reasoning else "content"
        self.reasoning = _Run("reasoning")
        self.content = _Run("content")
        self.block: ToolBlock | None = None
        self.num_calls = 0
        self.finished = False

    def _step(self, out: list[ParseEvent], final: bool) -> bool:
        return getattr(self, "_" + self.state)(out, final)

    # Each state handler consumes what it can decide and returns True when another handler should run now.

    def _probe(self, out: list[ParseEvent], final: bool) -> bool:
        head = self.buf.lstrip()
        if head.startswith(THINK_OPEN):
            self.buf, self.state = head[len(THINK_OPEN):], "reasoning"
            return True
        if not final and THINK_OPEN.startswith(head):  # empty or a prefix of <think>
            return False
        self.state = "reasoning" if self.spec.starts_in_reasoning else "content"
        return True

    def _reasoning(self, out: list[ParseEvent], final: bool) -> bool:
        buf, pos = self.buf, 0
        implicit = self.spec.tool_format == "xml"
        while True:
            end = buf.find(THINK_CLOSE, pos)
            call = buf.find(CALL_OPEN, pos) if implicit else -1
            if call >= 0 and (end < 0 or call < end):
                after = buf[call + len(CALL_OPEN):].lstrip()
                if after.startswith("<function="):  # implicit end of reasoning: the call starts here
                    return self._end_reasoning(buf[:call], buf[call:], out)
                if not final and "<function=".startswith(after):  # undecided: hold from the tag on
                    self.reasoning.push(buf[:call], out)
                    self.buf = buf[call:]
                    return False
                pos = call + 1
                continue
            if end >= 0:
                return self._end_reasoning(buf[:end], buf[end + len(THINK_CLOSE):], out)
            break
        keep = 0 if final else partial_suffix(buf, (THINK_CLOSE, CALL_OPEN) if implicit else (THINK_CLOSE,))
        self.reasoning.push(buf[: len(buf) - keep], out)
        self.buf = buf[len(buf) - keep:]
        return False

    def _end_reasoning(self, text: str, rest: str, out: list[ParseEvent]) -> bool:
        self.reasoning.push(text, out)
        self.reasoning.close()
        self.buf, self.state = rest, "content"
        return True

    def _content(self, out: list[ParseEvent], final: bool) -> bool:
        buf = self.buf
        if self.spec.tool_format is not None:
            i = buf.find(CALL_OPEN)
            if i >= 0:  # the run stays open: a block that is not a call continues it as text
                self.content.push(buf[:i], out)
                self.buf, self.state = buf[i + len(CALL_OPEN):], "tool"
                self.block = ToolBlock(self.schemas, glm=self.spec.tool_format == "glm")
                return True
            keep = 0 if final else partial_suffix(buf, (CALL_OPEN,))
        else:
            keep = 0
        self.content.push(buf[: len(buf) - keep], out)
        self.buf = buf[len(buf) - keep:]
        return False

    def _tool(self, out: list[ParseEvent], final: bool) -> bool:
        assert self.block is not None
        events, rest = self.block.run(self.buf, final)
        self.buf = ""
        for ev in events:
            if ev.kind == "content":
                self.content.push(ev.text, out)
            elif ev.kind == "tool_start":
                self.content.close()  # whitespace before a call is template formatting
                out.append(ParseEvent("tool_start", ev.text, index=self.num_calls, id=self.id_factory(), name=ev.name))
                self.num_calls += 1
            else:
                out.append(ParseEvent(ev.kind, ev.text, index=self.num_calls - 1))
        if rest is None:
            return False
        self.block, self.buf, self.state = None, rest, "content"
        return True


def _tool_format(template: str) -> str:
    if "<arg_key>" in template:
        return "glm"
    return "xml" if "<function=" in template else "hermes"


def _parameter_schemas(tools: Iterable[dict]) -> dict[str, dict]:
    """OpenAI-style tool definitions -> {function name: parameters schema}."""
    out: dict[str, dict] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as OpenAI sends it


@dataclass
class ParsedOutput:
    """The events of one output folded into final values (what a non-streaming response returns)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: Iterable[ParseEvent]) -> None:
        for ev in events:
            if ev.kind == "reasoning":
                self.reasoning += ev.text
            elif ev.kind == "content":
                self.content += ev.text
            elif ev.kind == "tool_start":
                self.tool_calls.append(ToolCall(ev.id, ev.name))
            elif ev.kind == "tool_args":
                self.tool_calls[ev.index].arguments += ev.text


def make_parser(spec: ParserSpec, tools: Iterable[dict] | None = None,
                id_factory: Callable[[], str] = new_call_id):
    """The parser `spec` calls for: `OutputParser`, or for harmony `harmony.HarmonyParser` (same interface)."""
    if spec.harmony:
        from ft.runtime.server.harmony import HarmonyParser

        return HarmonyParser(spec.tool_format is not None, id_factory)
    return OutputParser(spec, tools, id_factory)


def parse_all(text: str, spec: ParserSpec, tools: Iterable[dict] | None = None) -> ParsedOutput:
    """One-shot parse of a complete output."""
    parser = make_parser(spec, tools)
    result = ParsedOutput()
    result.add(parser.feed(text))
    result.add(parser.finish())
    return result
