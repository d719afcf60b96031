"""GLM-4.5 / 4.6 / 4.7 tool calls: one block between `<tool_call>` and `</tool_call>` (what GLM's chat template asks
for and renders in history):

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

The block is parsed whole once `</tool_call>` arrives (or the text ends), so the events do not depend on how the text
was split. Values are typed by the parameter's schema (`param_types.convert_param`, as XML calls; no schema: the text);
the arguments are one JSON object, valid whenever the call is emitted. A block that is not of this shape (a name with
spaces, stray text between pairs) is given back verbatim as content.
"""

from __future__ import annotations

import json
import re

from ft.runtime.server.param_types import convert_param
from ft.runtime.server.tool_parsers import END_TAG, ParseEvent, partial_suffix

_NAME = re.compile(r"[\w.:\-]+\Z")
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GlmBlock:
    def __init__(self, tools: dict[str, dict]) -> None:
        self.tools = tools  # function name -> JSON schema of its parameters
        self.buf = ""

    def run(self, text: str, final: bool) -> tuple[list[ParseEvent], str | None]:
        self.buf += text
        end = self.buf.find(END_TAG)
        if end < 0 and not final:
            return [], None
        block = self.buf[:end] if end >= 0 else self.buf[: len(self.buf) - partial_suffix(self.buf, (END_TAG,))]
        rest = self.buf[end + len(END_TAG):] if end >= 0 else ""
        call = parse_glm_call(block, self.tools)
        if call is not None:
            return [ParseEvent("tool_start", "glm", name=call[0]), ParseEvent("tool_args", call[1]),
                    ParseEvent("tool_end")], rest
        if block.strip():  # not a tool call: give the text back verbatim
            return [ParseEvent("content", "<tool_call>" + block + (END_TAG if end >= 0 else ""))], rest
        return [], rest


def parse_glm_call(block: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    """Block text (between the tags) -> (name, arguments JSON), or None when it is not a GLM call."""
    head, _, body = block.strip().partition("\n")
    name = head.strip()
    if "<arg_key>" in name:  # `NAME<arg_key>…` on one line
        name, body = name[: name.index("<arg_key>")].strip(), name[name.index("<arg_key>"):] + "\n" + body
    if not _NAME.match(name):
        return None
    props = (tools.get(name) or {}).get("properties") or {}
    args: dict = {}
    pos = 0
    for m in _PAIR.finditer(body):
        if body[pos:m.start()].strip():
            return None
        key, raw = m.group(1).strip(), m.group(2)
        schema = props.get(key) if isinstance(props, dict) else None
        args[key] = raw if schema is None else convert_param(raw, schema)
        pos = m.end()
    if body[pos:].strip():
        return None
    return name, json.dumps(args, ensure_ascii=False)
