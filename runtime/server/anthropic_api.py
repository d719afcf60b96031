"""Anthropic-compatible endpoints: POST /v1/messages (JSON or the native event stream) and
POST /v1/messages/count_tokens.

Content blocks come out in model order: `thinking` (with a signature: an opaque digest of the thinking text that
clients echo back; inbound thinking is used as the turn's reasoning whatever its signature), `text`, `tool_use`
(`toolu_<24 hex>` ids). Stream: message_start, ping, per block content_block_start / _delta (thinking_delta +
signature_delta, text_delta, input_json_delta) / _stop, message_delta (stop_reason, usage), message_stop; a ping
after each keep-alive interval of silence. `thinking.budget_tokens` is accepted but not enforced (max_tokens is).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from ft.runtime.server.convert import (anthropic_messages, anthropic_thinking, anthropic_tool_choice,
                                       anthropic_tools)
from ft.runtime.server.errors import ApiError, sse_error
from ft.runtime.server.generation import (ChatRun, Job, JobStreamingResponse, collect, render_chat,
                                          sampling_params, sse_event, submit)
from ft.runtime.server.loop import EngineFailure
from ft.runtime.server.parsers import ParseEvent
from ft.runtime.server.schemas import CountTokensRequest, MessagesRequest
from ft.runtime.server.state import check_api_key, server_state

log = logging.getLogger("ft.server")
router = APIRouter(dependencies=[Depends(check_api_key)])


def signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(b"ft-thinking\0" + thinking.encode("utf-8")).digest()).decode()


async def _render(state: Any, body: CountTokensRequest | MessagesRequest) -> tuple[Any, bool]:
    tools = anthropic_tools(body.tools)
    choice, parallel = anthropic_tool_choice(body.tool_choice, tools)
    chat = anthropic_messages(body.system, body.messages)
    last = chat[-1]
    prefill = last["role"] == "assistant" and isinstance(last.get("content"), str) and not last.get("tool_calls")
    prompt = await asyncio.to_thread(render_chat, state.engine.tokenizer, chat, tools, choice=choice,
                                     enable_thinking=anthropic_thinking(body.thinking), continue_final=prefill)
    return prompt, parallel


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    state = server_state(request)
    state.check_model(body.model)
    prompt, _ = await _render(state, body)
    return {"input_tokens": len(prompt.ids)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Any:
    state = server_state(request)
    state.check_model(body.model)
    output_format = (getattr(body, "output_config", None) or {}).get("format")
    if isinstance(output_format, dict):  # accepted and counted; output is not constrained to JSON
        state.metrics.response_format(str(output_format.get("type", "json_schema")))
    prompt, parallel = await _render(state, body)
    one_call = ("</tool_call>",) if prompt.tools and not parallel else ()
    params = sampling_params(state, max_tokens=body.max_tokens, stop=body.stop_sequences, extra_stop=one_call,
                             temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    job = await submit(state, "messages", prompt.ids, params, snapshot_at=prompt.header_start)
    run = ChatRun(prompt, id_prefix="toolu_")
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return JobStreamingResponse(_stream(job, run, message_id, state.model_name, state.settings.keepalive_s),
                                    job)
    await collect(job, request, run.push)
    parsed = run.parsed
    content: list[dict] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": signature(parsed.reasoning)})
    if parsed.content or not (parsed.tool_calls or parsed.reasoning):  # as the stream: never zero blocks
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    stop_reason, stop_sequence = _stop(job, bool(parsed.tool_calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(job)}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("tool call arguments are not a JSON object: %.200s", arguments)
        return {}
    return value


def _stop(job: Job, called_tools: bool) -> tuple[str, str | None]:
    if job.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    matched = job.matched_stop()
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


class _Blocks:
    """ParseEvents -> content_block_* events; a new block opens whenever the kind of output changes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # "thinking" | "text" | "tool_use" | None (no open block)
        self.thinking = ""
        self.held_json: str | None = None  # JSON-dialect arguments, sent validated when the call ends

    def feed(self, events: list[ParseEvent]) -> list[str]:
        out: list[str] = []
        for ev in events:
            if ev.kind == "reasoning":
                self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, out)
                self.thinking += ev.text
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
            elif ev.kind == "content":
                self.open("text", {"type": "text", "text": ""}, out)
                out.append(self._delta({"type": "text_delta", "text": ev.text}))
            elif ev.kind == "tool_start":
                self.close(out)
                self.open("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}, out)
                self.held_json = "" if ev.text == "json" else None
            elif ev.kind == "tool_args" and self.kind == "tool_use":
                if self.held_json is None:  # XML-dialect arguments: valid JSON by construction, streamed
                    out.append(self._delta({"type": "input_json_delta", "partial_json": ev.text}))
                else:  # model-written JSON: clients parse partial_json, so only a checked object is sent
                    self.held_json += ev.text
            elif ev.kind == "tool_end":
                self.close(out)
        return out

    def open(self, kind: str, block: dict, out: list[str]) -> None:
        if self.kind == kind and kind != "tool_use":
            return
        self.close(out)
        self.index += 1
        self.kind = kind
        out.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block}))

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self, out: list[str]) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": signature(self.thinking)}))
            self.thinking = ""
        if self.kind == "tool_use" and self.held_json is not None:
            value = json.dumps(_input(self.held_json), ensure_ascii=False)
            out.append(self._delta({"type": "input_json_delta", "partial_json": value}))
            self.held_json = None
        out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = None


def _usage(job: Job) -> dict:
    """Anthropic's split: input_tokens are the prompt tokens not read from the cache."""
    return {"input_tokens": job.prompt_tokens - job.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": job.cached_tokens, "output_tokens": job.completion_tokens}


async def _stream(job: Job, run: ChatRun, message_id: str, model: str, keepalive_s: float) -> AsyncIterator[str]:
    blocks = _Blocks()
    try:
        yield sse_event("message_start", {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": job.prompt_tokens, "cache_read_input_tokens": 0, "output_tokens": 0}}})
        yield sse_event("ping", {"type": "ping"})
        async for batch in job.batches(keepalive_s=keepalive_s):
            if batch is None:
                yield sse_event("ping", {"type": "ping"})
                continue
            for event in blocks.feed(run.push(batch)):
                yield event
        tail: list[str] = []
        if blocks.index < 0:  # nothing was generated: still answer with one (empty) text block
            blocks.open("text", {"type": "text", "text": ""}, tail)
        blocks.close(tail)
        for event in tail:
            yield event
        stop_reason, stop_sequence = _stop(job, bool(run.parsed.tool_calls))
        yield sse_event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                          "usage": _usage(job)})
        yield sse_event("message_stop", {"type": "message_stop"})
    except EngineFailure as e:
        job.state.metrics.error()  # an error answer inside a 200 stream
        yield sse_error(ApiError("server", str(e)), anthropic=True)
