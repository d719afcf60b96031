"""Incremental parsers for ONE tool-call block: the text between `<tool_call>` and `</tool_call>`.

Two dialects (checkpoint-formats §9.2, §9.3):
  Hermes JSON  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`            (Qwen2.5, Qwen3 <= 2507)
  XML          `<tool_call>\\n<function=f>\\n<parameter=p>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
               (Qwen3-Coder, Qwen3.5, Qwen3.6)
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
from typing import Any

from ft.runtime.server.json_close import json_closer
from ft.runtime.server.param_types import convert_param, schema_types

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


def _undecided(text: str, tags: tuple[str, ...]) -> bool:
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
            self.impl = XmlBlock(self.tools) if head.startswith("<") else HermesBlock()
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


# ---- XML ------------------------------------------------------------------------------------------------------

_FUNC_OPEN, _FUNC_CLOSE = "<function=", "</function>"
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"


class XmlBlock:
    """`<function=NAME>` + `<parameter=P>VALUE</parameter>`... + `</function>`, possibly several functions per block.

    Arguments are emitted as one JSON object built parameter by parameter (`{"p": v`, `, "q": w`, `}`); values whose
    schema type is exactly "string" stream character by character, other values are emitted once typed.
    Robustness (§9.3): a missing `</parameter>` is ended by the next `<parameter=`; a `</function>` inside a value
    ends it only when followed by `</tool_call>` or the end of the text.
    """

    def __init__(self, tools: dict[str, dict]) -> None:
        self.tools = tools
        self.buf = ""
        self.state = "open"  # open -> body <-> value -> after -> (open | done)
        self.props: dict[str, Any] = {}
        self.num_params = 0
        self.param = ""
        self.schema: dict | None = None
        self.streams = False  # the current value streams as a JSON string
        self.sent = 0  # characters of the current (streaming) value already emitted
        self.rest: str | None = None
        self.fallback: HermesBlock | None = None

    def run(self, text: str, final: bool) -> tuple[list[ParseEvent], str | None]:
        if self.fallback is not None:
            return self.fallback.run(text, final)
        self.buf += text
        events: list[ParseEvent] = []
        while self.rest is None and self.fallback is None:
            if not getattr(self, "_" + self.state)(events, final):
                break
        if self.fallback is not None:
            more, rest = self.fallback.run(self.buf, final)
            return events + more, rest
        return events, self.rest

    def _open(self, ev: list[ParseEvent], final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith(_FUNC_OPEN) and ">" in s:
            k = s.index(">")
            name = s[len(_FUNC_OPEN):k].strip()
            ev.append(ParseEvent("tool_start", "xml", name=name))
            self.props = (self.tools.get(name) or {}).get("properties") or {}
            self.num_params = 0
            self.buf, self.state = s[k + 1:], "body"
            return True
        if s.startswith(END_TAG):
            self.rest = s[len(END_TAG):]
            return False
        if not final and (_undecided(s, (_FUNC_OPEN, END_TAG)) or s.startswith(_FUNC_OPEN)):
            return False
        if not s:  # truncated right after the opening tag
            self.rest = ""
            return False
        self.fallback = HermesBlock()  # not XML: let the JSON parser (and its content fallback) decide
        return False

    def _body(self, ev: list[ParseEvent], final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith(_PARAM_OPEN) and ">" in s:
            k = s.index(">")
            self._start_param(s[len(_PARAM_OPEN):k].strip(), ev)
            self.buf, self.state = s[k + 1:], "value"
            return True
        for tag, state in ((_FUNC_CLOSE, "after"), (END_TAG, "done")):
            if s.startswith(tag):  # `</tool_call>` here means the model forgot `</function>`
                self._close_call(ev)
                self.buf, self.state = s[len(tag):], state
                if state == "done":
                    self.rest = self.buf
                return state != "done"
        if final:
            self._close_call(ev)
            self.rest = ""
            return False
        if _undecided(s, (_PARAM_OPEN, _FUNC_CLOSE, END_TAG)) or s.startswith(_PARAM_OPEN):
            self.buf = s
            return False
        j = s.find("<", 1)  # stray text between parameters is dropped up to the next tag
        self.buf = s[j:] if j >= 0 else ""
        return j >= 0

    def _value(self, ev: list[ParseEvent], final: bool) -> bool:
        buf, pos, hold = self.buf, 0, len(self.buf)
        while True:
            found = [(i, tag) for tag in (_PARAM_CLOSE, _PARAM_OPEN, _FUNC_CLOSE) if (i := buf.find(tag, pos)) >= 0]
            if not found:
                break
            i, tag = min(found)
            if tag == _FUNC_CLOSE:
                after = buf[i + len(_FUNC_CLOSE):].lstrip()
                if not (after.startswith(END_TAG) or (final and not after)):
                    if not final and _undecided(after, (END_TAG,)):
                        hold = i  # wait for the lookahead
                        break
                    pos = i + 1  # a literal `</function>` inside the value
                    continue
            self._end_param(buf[:i], ev)
            self.buf = buf[i + len(_PARAM_CLOSE):] if tag == _PARAM_CLOSE else buf[i:]
            self.state = "body"
            return True
        if final:
            self._end_param(buf, ev)
            self.buf, self.state = "", "body"
            return True
        if self.streams:
            safe = buf[: min(hold, len(buf) - partial_suffix(buf, (_PARAM_CLOSE, _PARAM_OPEN, _FUNC_CLOSE)))]
            self._stream_value(_strip_lead(safe), ev)
        return False

    def _after(self, ev: list[ParseEvent], final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith(END_TAG):
            self.rest = s[len(END_TAG):]
        elif s.startswith(_FUNC_OPEN):
            self.buf, self.state = s, "open"
            return True
        elif not final and _undecided(s, (END_TAG, _FUNC_OPEN)):
            return False
        else:  # `</tool_call>` missing: what follows is ordinary text
            self.rest = self.buf
        return False

    # -- arguments JSON ---------------------------------------------------------------------------------------

    def _start_param(self, name: str, ev: list[ParseEvent]) -> None:
        self.param, self.sent = name, 0
        self.schema = self.props.get(name) if isinstance(self.props, dict) else None
        self.streams = schema_types(self.schema) == {"string"} if self.schema is not None else True
        if self.streams:
            ev.append(ParseEvent("tool_args", self._key() + '"'))

    def _key(self) -> str:
        prefix = "{" if self.num_params == 0 else ", "
        self.num_params += 1
        return prefix + json.dumps(self.param, ensure_ascii=False) + ": "

    def _stream_value(self, text: str, ev: list[ParseEvent]) -> None:
        if len(text) > self.sent:
            ev.append(ParseEvent("tool_args", json.dumps(text[self.sent:], ensure_ascii=False)[1:-1]))
            self.sent = len(text)

    def _end_param(self, raw: str, ev: list[ParseEvent]) -> None:
        text = _strip_lead(raw)
        if self.streams:
            self._stream_value(text, ev)
            ev.append(ParseEvent("tool_args", '"'))
        else:
            value = convert_param(text, self.schema)
            ev.append(ParseEvent("tool_args", self._key() + json.dumps(value, ensure_ascii=False)))

    def _close_call(self, ev: list[ParseEvent]) -> None:
        ev.append(ParseEvent("tool_args", "{}" if self.num_params == 0 else "}"))
        ev.append(ParseEvent("tool_end"))


def _strip_lead(raw: str) -> str:
    """Value text: one leading and one trailing newline removed. Applied to an incomplete value it holds back a
    trailing newline that may turn out to be the last one, so what streams is always a prefix of the final text."""
    text = raw[1:] if raw.startswith("\n") else raw
    return text[:-1] if text.endswith("\n") else text
