"""Shared request plumbing: chat prompt rendering, sampling parameters, submission, consuming events, SSE.

A handler: render_chat (template -> ids + parser spec) -> sampling_params -> `job = await submit(...)` ->
iterate `job.batches()` (TokenEvent batches; a ChatRun turns their text into ParseEvents) -> `job.close()`, which
aborts the request unless it finished (client gone: KV freed at once) and records the metrics exactly once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ft.runtime.engine import ContextOverflowError, QueueFullError, SamplingParams
from ft.runtime.server import shield
from ft.runtime.server.errors import ApiError, invalid
from ft.runtime.server.loop import EngineFailure, RequestStream
from ft.runtime.server.parsers import ParsedOutput, ParseEvent, ParserSpec, make_parser, new_call_id
from ft.runtime.server.state import ServerState

_RESERVED_TEMPLATE_KEYS = {"messages", "tools", "add_generation_prompt", "documents"}
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clamps the same way


@dataclass
class ChatPrompt:
    text: str  # rendered prompt, including `forced`
    ids: list[int]
    spec: ParserSpec
    tools: list[dict]  # tools shown to the model (none when tool_choice is "none")
    forced: str  # assistant text forced after the generation prompt (tool_choice required / named)
    header_start: int | None = None  # ids before the generation prompt (the next turn re-renders what follows)


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict], *, choice: Any = None,
                enable_thinking: bool | None = None, template_kwargs: dict | None = None,
                continue_final: bool = False) -> ChatPrompt:
    """The prompt of a chat request. `continue_final`: the last message is an assistant turn to continue (Anthropic's
    prefill): the conversation is rendered as it stands and cut right after that message's text (as transformers'
    `continue_final_message`), so the model goes on from it instead of starting a new turn."""
    kwargs = dict(template_kwargs or {})
    bad = _RESERVED_TEMPLATE_KEYS & kwargs.keys()
    if bad:
        raise invalid(f"chat_template_kwargs cannot set {sorted(bad)}", "chat_template_kwargs")
    thinking = kwargs.pop("enable_thinking", None)
    if enable_thinking is None:
        enable_thinking = thinking
    shown = tools if tools and choice != "none" else []
    messages, found, nonce = shield.shield(messages, getattr(tokenizer, "special_strings", ()))
    try:
        text = tokenizer.apply_chat_template(messages, tools=shown or None, add_generation_prompt=not continue_final,
                                             enable_thinking=enable_thinking, **kwargs)
    except ValueError as e:  # ChatTemplateError: the template refused this conversation
        raise invalid(str(e), "messages") from None
    if continue_final:
        final = str(messages[-1].get("content") or "").strip()
        at = text.rfind(final) if final else -1
        if at < 0:
            raise invalid("the final assistant message cannot be continued: its text is empty, or the chat template "
                          "does not render it verbatim", "messages")
        text = text[:at + len(final)]
    spec = ParserSpec.detect(getattr(tokenizer, "chat_template", None), text, tools=bool(shown))
    forced = forced_prefix(spec, choice, text) if shown else ""
    try:  # control-token text inside the messages stays plain text (`shield`)
        text, ids = shield.encode(tokenizer, text + forced, found, nonce)
    except shield.NotVerbatim as e:
        raise invalid(str(e), "messages") from None
    return ChatPrompt(text, ids, spec, shown, forced,
                      None if continue_final else header_start(tokenizer, messages, shown, text, ids,
                                                               enable_thinking=enable_thinking, **kwargs))


def header_start(tokenizer: Any, messages: list[dict], tools: list[dict], text: str, ids: list[int],
                 **template_kwargs) -> int | None:
    """How many of the prompt's `ids` come before the generation prompt (the assistant header, and any forced text):
    the conversation rendered without it must be a prefix of `text`, and the rest must tokenize to the ids' tail.
    None when that does not hold (or the template refuses)."""
    try:
        bare = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=False,
                                             **template_kwargs)
    except ValueError:
        return None
    if not text.startswith(bare) or len(text) == len(bare):
        return None
    tail = tokenizer.encode(text[len(bare):])
    return len(ids) - len(tail) if 0 < len(tail) < len(ids) and ids[len(ids) - len(tail):] == tail else None


def forced_prefix(spec: ParserSpec, choice: Any, prompt: str) -> str:
    """tool_choice "required" / named: start the assistant turn inside a tool call (no constrained decoding
    needed). An open or pending reasoning block is closed empty first."""
    if choice != "required" and not isinstance(choice, tuple):
        return ""
    if spec.harmony:  # a commentary message to the function: the model writes the (rest of the) header and args
        name = f"{choice[1]} <|constrain|>json<|message|>" if isinstance(choice, tuple) else ""
        return "<|channel|>commentary to=functions." + name
    think = ""
    if spec.starts_in_reasoning:
        think = "</think>\n\n"
    elif spec.reasoning and not prompt.rstrip().endswith("</think>"):
        think = "<think>\n\n</think>\n\n"
    if spec.tool_format == "glm":  # GLM: `<tool_call>NAME\n<arg_key>…`
        return think + "<tool_call>" + (choice[1] + "\n" if isinstance(choice, tuple) else "")
    call = "<tool_call>\n"
    if isinstance(choice, tuple):
        name = choice[1]
        call += f"<function={name}>\n" if spec.tool_format == "xml" else \
            '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": {'
    return think + call


def sampling_params(state: ServerState, *, max_tokens: int | None, stop: Any = None, logprobs: int | None = None,
                    temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                    min_p: float | None = None, repetition_penalty: float | None = None,
                    presence_penalty: float | None = None, frequency_penalty: float | None = None,
                    seed: int | None = None, ignore_eos: bool = False, extra_stop: tuple[str, ...] = ()
                    ) -> SamplingParams:
    """Request fields over the model's generation_config defaults; max_tokens is clamped to --max-output-tokens
    (a missing max_tokens means "up to --max-output-tokens", within what the context leaves); a max_tokens the
    context cannot hold after the prompt is a 400 (context_length_exceeded), not a shorter output."""
    gen = getattr(state.engine, "generation_config", None) or {}

    def pick(value: Any, key: str, default: Any) -> Any:
        return value if value is not None else (gen[key] if gen.get(key) is not None else default)

    if temperature is None and gen.get("do_sample") is False:
        temperature = 0.0
    limit = state.settings.engine.max_output_tokens
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    try:
        return SamplingParams(
            max_tokens=limit if max_tokens is None else min(max_tokens, limit),
            temperature=pick(temperature, "temperature", 1.0), top_p=pick(top_p, "top_p", 1.0),
            top_k=max(0, pick(top_k, "top_k", 0)), min_p=pick(min_p, "min_p", 0.0),
            repetition_penalty=pick(repetition_penalty, "repetition_penalty", 1.0),
            presence_penalty=presence_penalty or 0.0, frequency_penalty=frequency_penalty or 0.0,
            seed=seed, stop=stops + extra_stop, ignore_eos=ignore_eos, logprobs=logprobs,
            max_tokens_required=max_tokens is not None)
    except ValueError as e:
        raise invalid(str(e)) from None


async def submit(state: ServerState, endpoint: str, prompt_ids: list[int], params: SamplingParams, *,
                 snapshot_at: int | None = None) -> Job:
    try:
        stream = await state.loop.submit(f"{endpoint}-{uuid.uuid4().hex}", prompt_ids, params, snapshot_at)
    except ContextOverflowError as e:
        raise invalid(f"context overflow: {e}", "messages", "context_length_exceeded") from None
    except QueueFullError as e:
        state.metrics.rejected_request()
        raise ApiError("overloaded", f"the server is busy: {e}; retry later", code="queue_full") from None
    except ValueError as e:
        raise invalid(str(e)) from None
    except RuntimeError as e:
        raise ApiError("server", str(e)) from None
    state.metrics.request_started(endpoint)
    return Job(state, stream, len(prompt_ids), params)


class Job:
    """One accepted request: its event stream plus the per-request totals."""

    def __init__(self, state: ServerState, stream: RequestStream, prompt_tokens: int, params: SamplingParams):
        self.state, self.stream, self.params = state, stream, params
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # of the prompt, taken from the engine's prefix cache instead of prefilled
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # (id, logprob, top) per token
        self.started = time.perf_counter()
        self.failed = False  # the engine failed under it (the error answer counts it, not the disconnects)
        self._closed = False

    async def batches(self, *, keepalive_s: float | None = None,
                      request: Request | None = None) -> AsyncIterator[list | None]:
        """TokenEvent batches until the final one. With keepalive_s, None is yielded after that much silence.
        With request (non-streaming), a client that went away ends the iteration (close() then aborts)."""
        checked = time.monotonic()
        while not self.stream.finished:
            try:
                batch = await self.stream.next_batch(keepalive_s or (1.0 if request is not None else None))
            except EngineFailure:
                self.failed = True
                raise
            if request is not None and time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if batch is None:
                if keepalive_s:
                    yield None
                continue
            for ev in batch:
                if ev.token_id is not None:
                    self.token_ids.append(ev.token_id)
                    if ev.logprob is not None:
                        self.logprobs.append((ev.token_id, ev.logprob, ev.top_logprobs or []))
                self.completion_tokens = ev.num_output_tokens
                self.cached_tokens = ev.num_cached_tokens
                self.finish_reason = ev.finish_reason or self.finish_reason
            yield batch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stream.close()
        self.state.metrics.request_ended(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            finish_reason=self.finish_reason, ttft_s=self.stream.ttft_s,
            latency_s=time.perf_counter() - self.started, failed=self.failed)

    def matched_stop(self) -> str | None:
        """The stop string that ended the output (None: an end-of-sequence token, or not stopped)."""
        if self.finish_reason != "stop" or not self.params.stop or not self.token_ids:
            return None
        engine = self.state.engine
        eos = set(getattr(engine, "eos_token_ids", ())) | set(self.params.stop_token_ids)
        if self.token_ids[-1] in eos:
            return None
        raw = engine.tokenizer.decode(self.token_ids)
        hits = [(raw.find(s), s) for s in self.params.stop if s in raw]
        return min(hits)[1] if hits else None


class ChatRun:
    """Engine text -> ParseEvents for one chat request (the forced prefix is parsed first)."""

    def __init__(self, prompt: ChatPrompt, id_prefix: str = "call_") -> None:
        self.parser = make_parser(prompt.spec, prompt.tools, lambda: new_call_id(id_prefix))
        self.parsed = ParsedOutput()
        self._pending = self.parser.feed(prompt.forced)

    def push(self, batch: list) -> list[ParseEvent]:
        out, self._pending = self._pending, []
        for ev in batch:
            out += self.parser.feed(ev.text)
            if ev.finish_reason is not None:
                out += self.parser.finish()
        self.parsed.add(out)
        return out


async def collect(job: Job, request: Request, on_batch: Any = None) -> None:
    """Non-streaming: run the request to the end (on_batch(batch) for each batch)."""
    try:
        async for batch in job.batches(request=request):
            if on_batch is not None:
                on_batch(batch)
    except EngineFailure as e:
        raise ApiError("server", str(e)) from None
    finally:
        job.close()


def token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict:
    data = tokenizer.token_bytes(token_id) if hasattr(tokenizer, "token_bytes") else \
        tokenizer.decode([token_id]).encode("utf-8")
    return {"token": data.decode("utf-8", errors="replace"), "logprob": max(logprob, MIN_LOGPROB),
            "bytes": list(data)}


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class JobStreamingResponse(StreamingResponse):
    """SSE response that always closes its job, even if the body iterator never started (early disconnect)."""

    def __init__(self, content: AsyncIterator[str], job: Job) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()
