"""OpenAI-compatible endpoints: POST /v1/chat/completions and POST /v1/completions (JSON or SSE).

Streams end with `data: [DONE]`; with stream_options.include_usage a last chunk with `choices: []` carries the usage
(OpenAI semantics: no usage otherwise). Chat output is parsed into reasoning_content / content / tool_calls
(parsers.py); finish_reason is "tool_calls" when the model called a tool, else "stop" / "length".
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from ft.runtime.server.convert import openai_messages, openai_tools, tool_choice
from ft.runtime.server.errors import ApiError, invalid, sse_error
from ft.runtime.server.generation import (ChatRun, Job, JobStreamingResponse, collect, render_chat,
                                          sampling_params, sse, submit, token_entry)
from ft.runtime.server.loop import EngineFailure
from ft.runtime.server.parsers import ParseEvent
from ft.runtime.server.schemas import ChatCompletionRequest, CompletionRequest
from ft.runtime.server.state import check_api_key, server_state

router = APIRouter(dependencies=[Depends(check_api_key)])

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "ignore_eos")


def sampling_fields(body: Any) -> dict:
    return {k: getattr(body, k) for k in _SAMPLING}


def usage(job: Job) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
            "total_tokens": job.prompt_tokens + job.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}


# ---- chat ----------------------------------------------------------------------------------------------------

@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = server_state(request)
    state.check_model(body.model)
    if body.n != 1:
        raise invalid("n must be 1: this server generates one choice per request", "n")
    engine = state.engine
    if body.response_format is not None:  # accepted and counted; output is not constrained to JSON
        state.metrics.response_format(body.response_format.type)
    tools = openai_tools(body.tools)
    choice = tool_choice(body.tool_choice, tools)
    if choice not in (None, "auto", "none") and not tools:
        raise invalid("tool_choice requires tools", "tool_choice")
    thinking = False if body.reasoning_effort == "none" else None
    prompt = await asyncio.to_thread(render_chat, engine.tokenizer, openai_messages(body.messages), tools,
                                     choice=choice, enable_thinking=thinking,
                                     template_kwargs=body.chat_template_kwargs)
    one_call = ("</tool_call>",) if prompt.tools and body.parallel_tool_calls is False else ()
    params = sampling_params(state, max_tokens=body.max_completion_tokens or body.max_tokens, stop=body.stop,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None, extra_stop=one_call,
                             **sampling_fields(body))
    job = await submit(state, "chat", prompt.ids, params, snapshot_at=prompt.header_start)
    run = ChatRun(prompt)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return JobStreamingResponse(_chat_stream(job, run, meta, include_usage, body.logprobs, engine.tokenizer,
                                                 state.settings.keepalive_s), job)
    await collect(job, request, run.push)
    parsed = run.parsed
    message = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.tool_calls else None,
               "reasoning_content": parsed.reasoning or None}
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    logprobs = {"content": _chat_logprobs(engine.tokenizer, job.logprobs)} if body.logprobs else None
    return {**meta, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": _finish_reason(job, bool(parsed.tool_calls))}],
            "usage": usage(job)}


def _finish_reason(job: Job, called_tools: bool) -> str:
    if job.finish_reason == "length":
        return "length"
    return "tool_calls" if called_tools else "stop"


def _chat_logprobs(tokenizer: Any, entries: list) -> list[dict]:
    return [{**token_entry(tokenizer, tid, lp), "top_logprobs": [token_entry(tokenizer, t, v) for t, v in top]}
            for tid, lp, top in entries]


def chat_deltas(events: list[ParseEvent]) -> list[dict]:
    """ParseEvents -> chunk deltas; consecutive text of one kind, and argument fragments of one call, merge."""
    deltas: list[dict] = []
    for ev in events:
        last = deltas[-1] if deltas else None
        if ev.kind in ("reasoning", "content"):
            key = "reasoning_content" if ev.kind == "reasoning" else "content"
            if last is not None and list(last) == [key]:
                last[key] += ev.text
            else:
                deltas.append({key: ev.text})
        elif ev.kind == "tool_start":
            deltas.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                           "function": {"name": ev.name, "arguments": ""}}]})
        elif ev.kind == "tool_args":
            if last is not None and "tool_calls" in last and last["tool_calls"][0]["index"] == ev.index:
                last["tool_calls"][0]["function"]["arguments"] += ev.text
            else:
                deltas.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
    return deltas


async def _chat_stream(job: Job, run: ChatRun, meta: dict, include_usage: bool, want_logprobs: bool,
                       tokenizer: Any, keepalive_s: float) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None = None, logprobs: Any = None) -> str:
        return sse({**meta, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    try:
        yield chunk({"role": "assistant", "content": ""})
        seen = 0
        async for batch in job.batches(keepalive_s=keepalive_s):
            if batch is None:
                yield ": keep-alive\n\n"
                continue
            deltas = chat_deltas(run.push(batch))
            logprobs = None
            if want_logprobs and len(job.logprobs) > seen:
                logprobs = {"content": _chat_logprobs(tokenizer, job.logprobs[seen:])}
                seen = len(job.logprobs)
                deltas = deltas or [{}]
            for i, delta in enumerate(deltas):
                yield chunk(delta, logprobs=logprobs if i == 0 else None)
        yield chunk({}, _finish_reason(job, bool(run.parsed.tool_calls)))
        if include_usage:
            yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage(job)})
        yield "data: [DONE]\n\n"
    except EngineFailure as e:
        job.state.metrics.error()  # an error answer inside a 200 stream
        yield sse_error(ApiError("server", str(e)), anthropic=False)


# ---- legacy completions --------------------------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = server_state(request)
    state.check_model(body.model)
    if body.n != 1 or (body.best_of or 1) != 1:
        raise invalid("n and best_of must be 1: this server generates one choice per request", "n")
    if body.suffix:
        raise invalid("suffix (fill-in-the-middle) is not supported", "suffix")
    if body.echo and body.logprobs is not None:
        raise invalid("echo together with logprobs needs prompt logprobs, which this server does not compute; "
                      "drop one of them", "logprobs")
    tokenizer = state.engine.tokenizer
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(f"send one prompt per request (got {len(prompt)})", "prompt")
        prompt = prompt[0]
    ids = await asyncio.to_thread(tokenizer.encode, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise invalid("the prompt is empty", "prompt")
    echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else ""
    params = sampling_params(state, max_tokens=body.max_tokens, stop=body.stop, logprobs=body.logprobs,
                             **sampling_fields(body))
    job = await submit(state, "completions", ids, params)
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return JobStreamingResponse(_completion_stream(job, meta, echo, include_usage, body.logprobs is not None,
                                                       tokenizer, state.settings.keepalive_s), job)
    pieces: list[str] = []
    await collect(job, request, lambda batch: pieces.extend(ev.text for ev in batch))
    logprobs = _legacy_logprobs(tokenizer, job.logprobs, 0) if body.logprobs is not None else None
    return {**meta, "object": "text_completion",
            "choices": [{"index": 0, "text": echo + "".join(pieces), "logprobs": logprobs,
                         "finish_reason": _finish_reason(job, False)}],
            "usage": usage(job)}


def _legacy_logprobs(tokenizer: Any, entries: list, offset: int) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top in entries:
        entry = token_entry(tokenizer, tid, lp)
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        out["top_logprobs"].append({token_entry(tokenizer, t, v)["token"]: max(v, -9999.0) for t, v in top})
        out["text_offset"].append(offset)
        offset += len(entry["token"])
    return out


async def _completion_stream(job: Job, meta: dict, echo: str, include_usage: bool, want_logprobs: bool,
                             tokenizer: Any, keepalive_s: float) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> str:
        return sse({**meta, "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]})

    try:
        if echo:
            yield chunk(echo)
        seen, offset = 0, len(echo)
        async for batch in job.batches(keepalive_s=keepalive_s):
            if batch is None:
                yield ": keep-alive\n\n"
                continue
            text = "".join(ev.text for ev in batch)
            logprobs = None
            if want_logprobs and len(job.logprobs) > seen:
                logprobs = _legacy_logprobs(tokenizer, job.logprobs[seen:], offset)
                seen = len(job.logprobs)
            offset += len(text)
            if text or logprobs:
                yield chunk(text, logprobs=logprobs)
        yield chunk("", _finish_reason(job, False))
        if include_usage:
            yield sse({**meta, "object": "text_completion", "choices": [], "usage": usage(job)})
        yield "data: [DONE]\n\n"
    except EngineFailure as e:
        job.state.metrics.error()  # an error answer inside a 200 stream
        yield sse_error(ApiError("server", str(e)), anthropic=False)
