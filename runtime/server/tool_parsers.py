"""Incremental parsers for ONE tool-call block: the text between `<tool_call>` and `</tool_call>`.

Two dialects (checkpoint-formats §9.2, §9.3):
  Hermes JSON  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`            (Qwen2.5, Qwen3 <= 2507)
  XML          `<tool_call>\\n<function=f>\\n<parameter=p>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
               (Qwen3-Coder, Qwen3.5, Qwen3.6; `xml_tool.XmlBlock`)
A block picks its dialect from its first non-blank character ("<" -> XML, otherwise JSON), so a model that mixes
dialects still parses; GLM's `NAME` + `<arg_key>`/`<arg_value>` pairs (`glm_tool.GlmBlock`) when the template is
GLM's. Block parsers are fed text pieces and return `(events, rest)`: events are ParseEvents with kind
"tool_start" (name), "tool_args" (a fragment of the arguments JSON string), "tool_end", or "content" (a block that is
not a tool call after all); `rest` is None while the block is open, else the text after `</tool_call>`.
XML arguments are JSON built by the parser, valid whenever a call is closed; JSON-dialect arguments stream as the model
wrote them (valid only if the model wrote valid JSON), which tool_start's text ("xml" / "json") tells consumers.

Invariant (tested with random chunk splits): the concatenated events do not depend on how the text was split, because
every decision is taken only once the text that decides it is complete; text that may still turn out to be a closing
tag or the outer `}` is held back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ft.runtime.server.json_close import json_closer

END_TAG = "</tool_call>"


@dataclass(frozen=True)
class ParseEvent:
    kind: str  # "reasoning" | "content" | "tool_start" | "tool_args" | "tool_end"
    text: str = ""  # reasoning/content text, an arguments fragment, or (tool_start) the dialect: "json" | "xml"
    index: int = -1  # tool-call index in output order (tool events only)
    id: str = ""  # tool-call id (tool_start only)
    name: str = ""  # function name (tool_start only)


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (text to hold back)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def undecided(text: str, tags: tuple[str, ...]) -> bool:
    """True when `text` could still grow into one of `tags` (empty text included)."""
    return any(tag.startswith(text) for tag in tags)


class ToolBlock:
    """Dispatches a block to the XML or the JSON parser by its first non-blank character (`glm`: always GLM's)."""

    def __init__(self, tools: dict[str, dict], glm: bool = False) -> None:
        self.tools = tools  # function name -> JSON schema of its parameters
        self.buf = ""
        self.impl = None  # XmlBlock | HermesBlock | GlmBlock, once chosen
        if glm:
            from ft.runtime.server.glm_tool import GlmBlock
            self.impl = GlmBlock(tools)

    def run(self, text: str, final: bool) -> tuple[list[ParseEvent], str | None]:
        if self.impl is None:
            self.buf += text
            head = self.buf.lstrip()
            if not head and not final:
                return [], None
            if head.startswith("<"):
                from ft.runtime.server.xml_tool import XmlBlock
                self.impl = XmlBlock(self.tools)
            else:
                self.impl = HermesBlock()
            text, self.buf = self.buf, ""
        return self.impl.run(text, final)


# ---- Hermes JSON ----------------------------------------------------------------------------------------------

# `{"name": "...", "arguments": ` followed by an object: from here on the arguments stream as the model writes them.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_OUTER_CLOSE = re.compile(r"\s*\}?\s*\Z")


class HermesBlock:
    """`{"name": NAME, "arguments": {...}}`. The common key order streams argument fragments as they arrive; any
    other shape is parsed whole at `</tool_call>`; a block that is not a JSON call becomes content."""

    def __init__(self) -> None:
        self.buf = ""
        self.streaming = False
        self.sent = 0  # characters of the arguments already emitted

    def run(self, text: str, final: bool) -> tuple[list[ParseEvent], str | None]:
        self.buf += text
        events: list[ParseEvent] = []
        end = self.buf.find(END_TAG)
        if not self.streaming:
            m = _HERMES_HEAD.match(self.buf)
            if m and (end < 0 or m.end() <= end):
                events.append(ParseEvent("tool_start", "json", name=_json_string(m.group(1))))
                self.buf = self.buf[m.end():]
                self.streaming = True
                end = self.buf.find(END_TAG)
        if self.streaming:
            if end >= 0:
                body = self.buf[:end]
            elif final:
                body = self.buf
            else:
                body = self.buf[: len(self.buf) - partial_suffix(self.buf, (END_TAG,))]
            # The arguments are the body minus the outer object's closing brace (held back until the end).
            args = body[: _OUTER_CLOSE.search(body).start()]
            if end < 0 and final:  # cut by max_tokens: close what is open, so the arguments stay JSON
                args += json_closer(args)
            if len(args) > self.sent:
                events.append(ParseEvent("tool_args", args[self.sent:]))
                self.sent = len(args)
            if end < 0 and not final:
                return events, None
            events.append(ParseEvent("tool_end"))
            return events, self.buf[end + len(END_TAG):] if end >= 0 else ""
        if end < 0 and not final:
            return events, None
        block = self.buf[:end] if end >= 0 else self.buf
        rest = self.buf[end + len(END_TAG):] if end >= 0 else ""
        call = parse_hermes_json(block)
        if call is not None:
            events += [ParseEvent("tool_start", "json", name=call[0]), ParseEvent("tool_args", call[1]),
                       ParseEvent("tool_end")]
        elif block.strip():  # not a tool call: give the text back verbatim
            events.append(ParseEvent("content", "<tool_call>" + block + (END_TAG if end >= 0 else "")))
        return events, rest


def _json_string(raw: str) -> str:
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        return raw


def parse_hermes_json(block: str) -> tuple[str, str] | None:
    """A whole JSON call -> (name, arguments JSON string), or None when it is not one."""
    try:
        obj = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
