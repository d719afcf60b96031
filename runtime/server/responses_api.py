"""OpenAI Responses API, stateless: POST /v1/responses (JSON or SSE events).

Input: a string or items (messages, function_call, function_call_output, reasoning); `instructions` is the system
turn; only function tools. Nothing is stored: `previous_response_id` is refused, `store` is ignored. Output items in
model order: reasoning (`reasoning_text` content), message (`output_text`), function_call. Stream: response.created,
response.in_progress, then per item output_item.added -> content_part.added -> *.delta -> *.done ->
content_part.done -> output_item.done (function calls: function_call_arguments.delta/.done), and finally
response.completed, or response.incomplete (reason max_output_tokens) when the output was cut by the token limit.
Extension: `stop` (string or list) is accepted as in chat completions.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from ft.runtime.server.convert import responses_messages, responses_tools, tool_choice
from ft.runtime.server.errors import ApiError, invalid, sse_error
from ft.runtime.server.generation import (ChatRun, Job, JobStreamingResponse, collect, render_chat,
                                          sampling_params, sse_event, submit)
from ft.runtime.server.loop import EngineFailure
from ft.runtime.server.parsers import THINK_CLOSE, ParsedOutput, ParseEvent
from ft.runtime.server.schemas import ResponsesRequest
from ft.runtime.server.state import check_api_key, server_state

router = APIRouter(dependencies=[Depends(check_api_key)])


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Any:
    state = server_state(request)
    state.check_model(body.model)
    if body.previous_response_id:
        raise invalid("previous_response_id needs stored responses; this server is stateless: send the whole "
                      "conversation as input items", "previous_response_id")
    engine = state.engine
    tools = responses_tools(body.tools)
    choice = tool_choice(body.tool_choice, tools)
    effort = (body.reasoning or {}).get("effort")
    prompt = await asyncio.to_thread(render_chat, engine.tokenizer, responses_messages(body.instructions, body.input),
                                     tools, choice=choice, enable_thinking=False if effort == "none" else None)
    stop = getattr(body, "stop", None)
    if stop is not None and not isinstance(stop, (str, list)):
        raise invalid("stop must be a string or a list of strings", "stop")
    params = sampling_params(state, max_tokens=body.max_output_tokens, stop=stop, temperature=body.temperature,
                             top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
                             repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                             frequency_penalty=body.frequency_penalty)
    job = await submit(state, "responses", prompt.ids, params, snapshot_at=prompt.header_start)
    run = ChatRun(prompt)
    base = {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": state.model_name,
            "instructions": body.instructions, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": True, "temperature": params.temperature, "top_p": params.top_p,
            "max_output_tokens": body.max_output_tokens, "previous_response_id": None, "reasoning": body.reasoning,
            "text": body.text or {"format": {"type": "text"}}, "metadata": getattr(body, "metadata", None) or {},
            "error": None, "incomplete_details": None, "usage": None}
    if body.stream:
        return JobStreamingResponse(_stream(job, run, base, engine.tokenizer, state.settings.keepalive_s), job)
    await collect(job, request, run.push)
    return _final(base, job, _items(run.parsed), run.parsed, engine.tokenizer)


def _final(base: dict, job: Job, items: list[dict], parsed: ParsedOutput, tokenizer: Any) -> dict:
    truncated = job.finish_reason == "length"
    reasoning_tokens = _reasoning_tokens(job, parsed, tokenizer)
    return {**base, "status": "incomplete" if truncated else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "usage": {"input_tokens": job.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": job.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": job.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                      "total_tokens": job.prompt_tokens + job.completion_tokens}}


def _reasoning_tokens(job: Job, parsed: ParsedOutput, tokenizer: Any) -> int:
    """Generated tokens up to and including the one that closes the reasoning block (all of them if it never
    closed), counted in the output itself, not re-tokenized: never more than output_tokens."""
    if not parsed.reasoning:
        return 0
    close = tokenizer.token_to_id(THINK_CLOSE)
    ids = job.token_ids
    end = ids.index(close) + 1 if close is not None and close in ids else len(ids)
    return min(end, job.completion_tokens)


def _reasoning_item(item_id: str, text: str | None) -> dict:
    done = text is not None
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "status": "completed" if done else "in_progress"}


def _message_item(item_id: str, text: str | None) -> dict:
    done = text is not None
    return {"id": item_id, "type": "message", "role": "assistant", "status": "completed" if done else "in_progress",
            "content": [_text_part(text)] if done else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, done: bool) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed" if done else "in_progress"}


def _items(parsed: ParsedOutput) -> list[dict]:
    items = []
    if parsed.reasoning:
        items.append(_reasoning_item(_id("rs"), parsed.reasoning))
    if parsed.content or not (parsed.reasoning or parsed.tool_calls):
        items.append(_message_item(_id("msg"), parsed.content))
    items += [_call_item(_id("fc"), c.id, c.name, c.arguments, True) for c in parsed.tool_calls]
    return items


class _Events:
    """ParseEvents -> Responses stream events; `items` collects the finished output items in order."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []
        self.kind: str | None = None  # open item: "reasoning" | "message" | "function_call" | None
        self.item: dict = {}
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        out = sse_event(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.items)}

    def feed(self, events: list[ParseEvent]) -> list[str]:
        out: list[str] = []
        for ev in events:
            if ev.kind in ("reasoning", "content"):
                kind = "reasoning" if ev.kind == "reasoning" else "message"
                if self.kind != kind:
                    self.close(out)
                    self._open(kind, out)
                self.text += ev.text
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                out.append(self.event(name, **self._where(), content_index=0, delta=ev.text, **extra))
            elif ev.kind == "tool_start":
                self.close(out)
                self.kind, self.text = "function_call", ""
                self.item = _call_item(_id("fc"), ev.id, ev.name, "", False)
                out.append(self.event("response.output_item.added", output_index=len(self.items), item=self.item))
            elif ev.kind == "tool_args" and self.kind == "function_call":
                self.text += ev.text
                out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=ev.text))
            elif ev.kind == "tool_end":
                self.close(out)
        return out

    def _open(self, kind: str, out: list[str]) -> None:
        self.kind, self.text = kind, ""
        if kind == "reasoning":
            self.item, part = _reasoning_item(_id("rs"), None), {"type": "reasoning_text", "text": ""}
        else:
            self.item, part = _message_item(_id("msg"), None), _text_part("")
        out.append(self.event("response.output_item.added", output_index=len(self.items), item=self.item))
        out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))

    def close(self, out: list[str]) -> None:
        if self.kind is None:
            return
        where = self._where()
        if self.kind == "function_call":
            item = {**self.item, "arguments": self.text, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=self.text))
        else:
            if self.kind == "reasoning":
                item, part = _reasoning_item(self.item["id"], self.text), {"type": "reasoning_text", "text": self.text}
                out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
            else:
                item, part = _message_item(self.item["id"], self.text), _text_part(self.text)
                out.append(self.event("response.output_text.done", **where, content_index=0, text=self.text,
                                      logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.items.append(item)
        self.kind = None


async def _stream(job: Job, run: ChatRun, base: dict, tokenizer: Any, keepalive_s: float) -> AsyncIterator[str]:
    events = _Events()
    try:
        yield events.event("response.created", response={**base, "status": "in_progress", "output": []})
        yield events.event("response.in_progress", response={**base, "status": "in_progress", "output": []})
        async for batch in job.batches(keepalive_s=keepalive_s):
            if batch is None:
                yield ": keep-alive\n\n"
                continue
            for event in events.feed(run.push(batch)):
                yield event
        tail: list[str] = []
        if not events.items and events.kind is None:  # nothing generated: one empty message, as non-streaming
            tail += events.feed([ParseEvent("content", "")])
        events.close(tail)
        for event in tail:
            yield event
        final = _final(base, job, events.items, run.parsed, tokenizer)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield events.event(kind, response=final)
    except EngineFailure as e:
        yield sse_error(ApiError("server", str(e)), anthropic=False)
