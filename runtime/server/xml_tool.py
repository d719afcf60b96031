"""Qwen3-Coder / Qwen3.5 / Qwen3.6 tool calls, the XML dialect of one `<tool_call>` block (checkpoint-formats §9.3):

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

`tool_parsers.ToolBlock` hands a block here when its first non-blank character is "<"; the events and the split
invariant are those of `tool_parsers.py`.
"""

from __future__ import annotations

import json
from typing import Any

from ft.runtime.server.param_types import convert_param, schema_types
from ft.runtime.server.tool_parsers import END_TAG, HermesBlock, ParseEvent, partial_suffix, undecided

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
        if not final and (undecided(s, (_FUNC_OPEN, END_TAG)) or s.startswith(_FUNC_OPEN)):
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
        if undecided(s, (_PARAM_OPEN, _FUNC_CLOSE, END_TAG)) or s.startswith(_PARAM_OPEN):
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
                    if not final and undecided(after, (END_TAG,)):
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
        elif not final and undecided(s, (END_TAG, _FUNC_OPEN)):
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
