"""Closing a JSON object cut anywhere (a tool call's arguments when max_tokens ends the output mid-call)."""

from __future__ import annotations

import json


def json_closer(partial: str) -> str:
    """What to append to `partial`, the start of a JSON object cut anywhere, to make it valid JSON (only appends:
    its start was streamed already): the open string closed (a dangling escape completed), a key without its value
    given `null`, open arrays and objects closed. "" if `partial` is not the start of a JSON object."""
    stack: list[str] = []  # "{" / "[" open
    expect = "value"  # in an object: "key" | "colon" | "value" | "comma"; in an array: "value" | "comma"
    in_str = escape = False
    key = False  # the open string is a key
    hexes = 0  # hex digits still due in a \\uXXXX escape
    i, n = 0, len(partial)
    while i < n:
        c = partial[i]
        if in_str:
            if hexes:
                hexes -= 1
            elif escape:
                escape = False
                hexes = 4 if c == "u" else 0
            elif c == "\\":
                escape = True
            elif c == '"':
                in_str = False
                expect = "colon" if key else "comma"
        elif c in " \t\r\n":
            pass
        elif c == '"':
            in_str, key = True, bool(stack) and stack[-1] == "{" and expect == "key"
        elif c in "{[":
            stack.append(c)
            expect = "key" if c == "{" else "value"
        elif c in "}]":
            if not stack:
                return ""
            stack.pop()
            expect = "comma"
        elif c == ":":
            expect = "value"
        elif c == ",":
            expect = "key" if stack and stack[-1] == "{" else "value"
        else:  # a number, true, false, null: read to its end
            j = i
            while j < n and partial[j] not in ",}] \t\r\n":
                j += 1
            token = partial[i:j]
            if j == n:  # cut inside it: complete a literal, or a number cut at "-", "1.", "1e" with a 0
                for lit in ("true", "false", "null"):
                    if lit.startswith(token):
                        return _close(lit[len(token):], stack)
                for tail in ("", "0"):
                    try:
                        json.loads(token + tail)
                    except ValueError:
                        continue
                    return _close(tail, stack)
                return ""
            expect = "comma"
            i = j
            continue
        i += 1
    if not partial.strip().startswith("{"):
        return ""
    out = ""
    if in_str:
        out += ("\\" if escape else "") + "0" * hexes + '"'
        expect = "colon" if key else "comma"
    if stack and stack[-1] == "{" and expect == "colon":
        out += ": null"
    elif expect == "value" and stack and partial.rstrip()[-1:] in (":", "["):
        out += "null" if partial.rstrip()[-1:] == ":" else ""
    elif expect == "key" and partial.rstrip()[-1:] == ",":
        out += '"": null'
    elif expect == "value" and partial.rstrip()[-1:] == ",":
        out += "null"
    return _close(out, stack)


def _close(out: str, stack: list[str]) -> str:
    return out + "".join("}" if c == "{" else "]" for c in reversed(stack))
