"""Conversations of the three APIs -> the chat template's messages and tools (checkpoint-formats §9.4, §9.5).

Template messages are Hugging Face style: {"role": system|user|assistant|tool, "content": str,
"reasoning_content"?: str, "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": dict}}],
"tool_call_id"?: str}. Content parts are flattened to text (the served models are text-only); inbound tool-call
arguments are JSON-decoded into dicts (the XML templates iterate them); leading system turns are merged into one.
Tool choice is normalised to None | "auto" | "none" | "required" | ("function", name).
"""

from __future__ import annotations

import json
from typing import Any

from ft.runtime.server.errors import invalid

_TEXT_PARTS = ("text", "input_text", "output_text")


def content_text(content: Any, where: str) -> str:
    """str | list of text parts | None -> str; anything else is a 400 naming the part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content parts", where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "image", "input_image", "input_audio", "document", "input_file", "file"):
            raise invalid(f"{where}[{i}] is a {kind} part; this server serves text-only models", f"{where}[{i}]")
        else:
            raise invalid(f"{where}[{i}]: unsupported content part type {kind!r} (expected text)", f"{where}[{i}]")
    return "\n".join(texts)


def _arguments(raw: Any, where: str) -> dict:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            raise invalid(f"{where} is not valid JSON: {e}", where) from None
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be a JSON object", where)
    return raw


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _merge_system(messages: list[dict]) -> list[dict]:
    """Leading system turns -> one (templates render only messages[0] as the system block)."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n <= 1:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": text}] + messages[n:]


# ---- OpenAI chat ---------------------------------------------------------------------------------------------

def openai_messages(messages: list) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        msg: dict[str, Any] = {"role": role, "content": content_text(m.content, where + ".content")}
        if role == "assistant":
            reasoning = m.reasoning_content or m.reasoning
            if reasoning:
                msg["reasoning_content"] = reasoning
            calls = []
            for j, c in enumerate(m.tool_calls or []):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise invalid(f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls[{j}]")
                args = _arguments(fn.get("arguments", {}), f"{where}.tool_calls[{j}].function.arguments")
                calls.append(_call(str(c.get("id") or f"call_{i}_{j}"), fn["name"], args))
            if calls:
                msg["tool_calls"] = calls
        elif role == "tool":
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return _merge_system(out)


def openai_tools(tools: list | None) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tools or []]


def tool_choice(choice: Any, tools: list[dict], param: str = "tool_choice") -> Any:
    """OpenAI chat / Responses tool_choice -> normalised form; a named tool must be among the tools."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if "function" in choice else choice.get("name")
        if choice.get("type") == "function" and isinstance(name, str):
            return _named(name, tools, param)
    raise invalid(f"{param} must be 'auto', 'none', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}", param)


def _named(name: str, tools: list[dict], param: str) -> tuple[str, str]:
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"{param} names the tool {name!r}, which is not in tools", param)
    return ("function", name)


# ---- Anthropic Messages --------------------------------------------------------------------------------------

def anthropic_messages(system: Any, messages: list) -> list[dict]:
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": content_text(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out.extend(_anthropic_user(m.content, where))
        else:
            out.append(_anthropic_assistant(m.content, where))
    return _merge_system(out)


def _anthropic_user(blocks: list[dict], where: str) -> list[dict]:
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "tool_result":
            if texts:  # keep the order the client wrote
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = content_text(block.get("content"), f"{where}[{j}].content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result})
        elif kind == "text":
            texts.append(str(block.get("text", "")))
        else:
            raise invalid(f"{where}[{j}]: unsupported user block type {kind!r}; this server serves text-only "
                          "models (text and tool_result blocks)", f"{where}[{j}]")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _anthropic_assistant(blocks: list[dict], where: str) -> dict:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            args = _arguments(block.get("input", {}), f"{where}[{j}].input")
            calls.append(_call(str(block.get("id", "")), str(block.get("name", "")), args))
        else:
            raise invalid(f"{where}[{j}]: unsupported assistant block type {kind!r}", f"{where}[{j}]")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def anthropic_tools(tools: list | None) -> list[dict]:
    return [{"type": "function", "function": {k: v for k, v in (
        ("name", t.name), ("description", t.description),
        ("parameters", t.input_schema or {"type": "object", "properties": {}})) if v is not None}}
        for t in tools or []]


def anthropic_tool_choice(choice: dict | None, tools: list[dict]) -> tuple[Any, bool]:
    """-> (normalised choice, parallel calls allowed)."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return _named(choice["name"], tools, "tool_choice"), parallel
    raise invalid("tool_choice.type must be 'auto', 'any', 'tool' (with a name) or 'none'", "tool_choice")


def anthropic_thinking(thinking: dict | None) -> bool | None:
    if thinking is None:
        return None  # the template's default
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise invalid("thinking.type must be 'enabled', 'disabled', 'adaptive' or 'between_tools'", "thinking.type")
    return kind != "disabled"


# ---- OpenAI Responses ----------------------------------------------------------------------------------------

def responses_messages(instructions: str | None, items: str | list[dict]) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    pending_reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise invalid(f"{where}.role must be system, developer, user or assistant", f"{where}.role")
            msg = {"role": role, "content": content_text(item.get("content"), f"{where}.content")}
            if role == "assistant" and pending_reasoning:
                msg["reasoning_content"], pending_reasoning = "\n".join(pending_reasoning), []
            out.append(msg)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning.extend(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        elif kind == "function_call":
            args = _arguments(item.get("arguments", "{}"), f"{where}.arguments")
            call = _call(str(item.get("call_id", "")), str(item.get("name", "")), args)
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            if pending_reasoning:
                out[-1]["reasoning_content"], pending_reasoning = "\n".join(pending_reasoning), []
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else content_text(output, f"{where}.output")})
        else:
            raise invalid(f"{where}: unsupported input item type {kind!r}", f"{where}.type")
    return _merge_system(out)


def responses_tools(tools: list[dict] | None) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise invalid(f"tools[{i}]: only function tools with a name are supported (got type "
                          f"{t.get('type')!r})", f"tools[{i}]")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out
