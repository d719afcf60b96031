"""Streaming parser for gpt-oss "harmony" output (checkpoint-formats §9.6): channels -> reasoning, content, tool calls.

The chat template's generation prompt is `<|start|>assistant`, so a completion is a run of messages such as
    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"a": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
A header is the text before `<|message|>`: the role, `<|channel|>NAME`, a recipient `to=...` (before or after the
channel) and a content type (`<|constrain|>json` or `json`). A body runs to `<|end|>`, `<|call|>`, `<|return|>` or a
new `<|start|>`, or to the end of the output (`<|return|>` and `<|call|>` are stop tokens: generation ends on them and
their text is not part of the output).

Mapping (as vLLM's harmony parsing does): analysis -> reasoning; a message with a recipient (`to=functions.NAME`) ->
a tool call NAME whose body is the JSON arguments, streamed as written and, when the output is cut inside them, closed
with `json_closer` so they stay JSON; final, commentary without a recipient (a preamble) and any other channel ->
content. Without tools in the request, a recipient's message is content too. Tags split across deltas are held back,
so the events do not depend on how the text was split (the one-shot parse is `feed(all) + finish()`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ft.runtime.server.json_close import json_closer
from ft.runtime.server.parsers import StreamParser, _Run
from ft.runtime.server.tool_parsers import ParseEvent, partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_TAG = re.compile(r"<\|[a-z_0-9]+\|>")


def parse_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header (either may be None)."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(_TAG.sub(" ", header))
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


class HarmonyParser(StreamParser):
    """Same interface as `parsers.OutputParser`: feed(text) / finish() -> ParseEvents."""

    def __init__(self, tools: bool, id_factory: Callable[[], str]) -> None:
        self.tools, self.id_factory = tools, id_factory
        self.buf = ""
        self.kind: str | None = None  # None: in a header; else the open body's "reasoning" | "content" | "tool"
        self.runs = {"reasoning": _Run("reasoning"), "content": _Run("content")}
        self.args = ""  # the open tool call's arguments so far
        self.num_calls = 0
        self.finished = False

    def _step(self, out: list[ParseEvent], final: bool) -> bool:
        return self._header(out, final) if self.kind is None else self._body(out, final)

    def _header(self, out: list[ParseEvent], final: bool) -> bool:
        at = self.buf.find(MESSAGE)
        if at < 0:
            if final and self.buf.strip() and CHANNEL not in self.buf and START not in self.buf:
                self._push("content", _TAG.sub("", self.buf), out)  # not harmony at all: keep the text
            return False
        channel, recipient = parse_header(self.buf[:at])
        self.buf = self.buf[at + len(MESSAGE):]
        if channel == "analysis" and recipient is None:
            self.kind = "reasoning"
        elif recipient is not None and self.tools:
            self.kind = "tool"
            name = recipient.removeprefix("functions.")
            for run in self.runs.values():  # text around a call is its own run
                run.close()
            out.append(ParseEvent("tool_start", "json", index=self.num_calls, id=self.id_factory(), name=name))
            self.num_calls += 1
            self.args = ""
        else:
            self.kind = "content"
        return True

    def _body(self, out: list[ParseEvent], final: bool) -> bool:
        ends = [i for i in (self.buf.find(tag) for tag in BODY_ENDS) if i >= 0]
        end = min(ends) if ends else -1
        if end >= 0:
            text, rest = self.buf[:end], self.buf[end:]
            rest = rest[len(START):] if rest.startswith(START) else rest[rest.index("|>") + 2:]
        else:
            keep = 0 if final else partial_suffix(self.buf, BODY_ENDS)
            text, rest = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        self._push(self.kind, text, out)
        self.buf = rest
        closed = end >= 0 or final
        if closed and self.kind == "tool":
            if end < 0 and json_closer(self.args):  # cut by max_tokens: close what is open
                self._push("tool", json_closer(self.args), out)
            out.append(ParseEvent("tool_end", index=self.num_calls - 1))
        if closed:
            self.kind = None
        return end >= 0

    def _push(self, kind: str, text: str, out: list[ParseEvent]) -> None:
        if kind == "tool":
            if text:
                self.args += text
                out.append(ParseEvent("tool_args", text, index=self.num_calls - 1))
        else:
            self.runs[kind].push(text, out)
