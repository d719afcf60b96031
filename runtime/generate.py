"""One-shot generation on an idle engine (CLI, benchmarks, tests): drive `step()` until the request finishes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ft.runtime.engine import Engine
    from ft.runtime.request import TokenEvent
    from ft.runtime.sampling import SamplingParams


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    # prefill_s: engine time until the first token (all prompt chunks + first sample);
    # ttft_s: wall time from the call to the first token; decode_s: first token -> last token;
    # prefill_tok_s = prompt_tokens / prefill_s; decode_tok_s = (output tokens - 1) / decode_s.
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: list[float] | None = None  # raw logprob per output token when params.logprobs is set


def generate(engine: "Engine", prompt_ids: list[int], params: "SamplingParams",
             on_event: Callable[["TokenEvent"], None] | None = None) -> GenerationResult:
    """Run one request to completion. The engine must be idle: events of other requests would be lost."""
    if engine.has_unfinished():
        raise RuntimeError("generate() needs an idle engine; drive step() yourself to serve several requests")
    request_id = f"gen-{uuid.uuid4().hex}"
    t_start = time.perf_counter()
    engine.add_request(request_id, prompt_ids, params)
    token_ids: list[int] = []
    logprobs: list[float] = []
    pieces: list[str] = []
    t_first = None
    prefill_s = 0.0
    finish_reason = None
    while finish_reason is None:
        t_step = time.perf_counter()
        events = engine.step()
        if t_first is None:
            prefill_s += time.perf_counter() - t_step
        for ev in events:
            if ev.request_id != request_id:
                continue
            if t_first is None:
                t_first = time.perf_counter()
            if ev.token_id is not None:
                token_ids.append(ev.token_id)
                if ev.logprob is not None:
                    logprobs.append(ev.logprob)
            pieces.append(ev.text)
            finish_reason = ev.finish_reason
            if on_event is not None:
                on_event(ev)
    t_end = time.perf_counter()
    decode_s = t_end - t_first
    timings = {
        "prefill_s": prefill_s,
        "ttft_s": t_first - t_start,
        "decode_s": decode_s,
        "prefill_tok_s": len(prompt_ids) / prefill_s if prefill_s > 0 else 0.0,
        "decode_tok_s": (len(token_ids) - 1) / decode_s if decode_s > 0 and len(token_ids) > 1 else 0.0,
    }
    return GenerationResult(token_ids, "".join(pieces), finish_reason, len(prompt_ids), timings,
                            logprobs if params.logprobs is not None else None)
