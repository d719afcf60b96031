"""Per-request engine state and the stop-string filter that turns decoded text into safe-to-emit deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ft.runtime.sampling import RequestSampler, SamplingParams


@dataclass
class TokenEvent:
    request_id: str
    token_id: int | None
    text: str  # text delta (stop strings trimmed; text that may start a stop string is held back)
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" on the last event
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens taken from a kept prefix instead of prefilled


class StopStringFilter:
    """Finds stop strings in streamed text, across token boundaries.

    Invariant: emitted text never contains the start of a stop-string occurrence. After each push the filter holds
    back the longest suffix of the pending text that is a proper prefix of some stop string; any later match must
    begin inside that held-back suffix, so searching `held + delta` finds every occurrence.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Add decoded text -> (text safe to emit now, whether a stop string ended the output)."""
        if not self.stops:
            return delta, False
        pending = self.held + delta
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return pending[: min(hits)], True  # the stop string and anything after it are dropped
        keep = self._held_suffix_len(pending)
        self.held = pending[len(pending) - keep:]
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """The held-back text, when the output ends for another reason (stop token, length)."""
        out, self.held = self.held, ""
        return out

    def _held_suffix_len(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens clamped by the engine's max_output_tokens
    max_length: int  # longest sequence: min(prompt + max_tokens, the engine's max context)
    stop_token_ids: frozenset[int]
    sampler: RequestSampler
    decoder: Any  # the tokenizer's IncrementalDecoder
    stop_filter: StopStringFilter
    arrival_time: float = field(default_factory=time.perf_counter)
    state: Any = None  # the model's SequenceState while running (None while waiting, also after a preemption)
    num_prefilled: int = 0  # tokens of the prefill (prompt + recomputed output) already in the state
    num_recompute: int = 0  # output tokens to prefill again after the last preemption (they are not re-emitted)
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # prompt tokens the first admission took from the prefix cache
    snapshots: dict = field(default_factory=dict)  # length -> `SequenceState.snapshot` (prefix cache)
    prefix_source: str | None = None  # the kept prefix its state was copied from: its own state replaces it
    snapshot_at: int | None = None  # a prompt position to end a prefill chunk at (`Engine.add_request`)
    first_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def prefill_length(self) -> int:
        """Tokens to prefill: the prompt, plus the output generated before the last preemption (recompute)."""
        return len(self.prompt_ids) + self.num_recompute

    @property
    def prefill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids[:self.num_recompute]

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < self.prefill_length

    @property
    def max_output_tokens(self) -> int:
        """Output tokens this request may produce: max_tokens, capped by the context (`max_length`)."""
        return self.max_length - self.num_prompt_tokens

    def next_prefill_chunk(self, max_len: int) -> list[int]:
        """The next at most `max_len` tokens of prompt + recomputed output that are not in the state yet."""
        start, end = self.num_prefilled, min(self.num_prefilled + max_len, self.prefill_length)
        n = len(self.prompt_ids)
        return self.prompt_ids[start:min(end, n)] + self.output_ids[max(start - n, 0):max(end - n, 0)]

    def preempt(self) -> None:
        """The engine dropped this request's state: on re-admission it prefills prompt + output so far again, then
        samples its next token. Sampler, decoder and stop filter are kept, so nothing already sent is re-emitted and
        penalties and the seeded generator continue where they were."""
        self.state = None
        self.num_prefilled = 0
        self.num_recompute = len(self.output_ids)

    def accept(self, token_id: int, logprob: float | None,
               top_logprobs: list[tuple[int, float]] | None) -> TokenEvent:
        """Record one sampled token and build its event (decides finish_reason)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token_id)
        if token_id in self.stop_token_ids:
            # The stop token's own text is not emitted; text held back so far is.
            text, _ = self._drain()
            self.finish_reason = "stop"
        else:
            text, stopped = self.stop_filter.push(self.decoder.push(token_id))
            if stopped:
                self.finish_reason = "stop"
            elif self.num_output_tokens >= self.max_output_tokens:
                tail, stopped = self._drain()
                text += tail
                self.finish_reason = "stop" if stopped else "length"
        return TokenEvent(self.request_id, token_id, text, logprob, top_logprobs, self.finish_reason,
                          self.num_prompt_tokens, self.num_output_tokens, self.num_cached)

    def _drain(self) -> tuple[str, bool]:
        """At the end of the output: the decoder's held-back bytes and the stop filter's held-back text."""
        text, stopped = self.stop_filter.push(self.decoder.flush())
        return (text, True) if stopped else (text + self.stop_filter.flush(), False)

    def finish_event(self, reason: str) -> TokenEvent:
        """A final event without a token (the output ends for a reason other than a sampled token)."""
        text, stopped = self._drain()
        self.finish_reason = "stop" if stopped else reason
        return TokenEvent(self.request_id, None, text, None, None, self.finish_reason, self.num_prompt_tokens,
                          self.num_output_tokens, self.num_cached)

    def abort_event(self) -> TokenEvent:
        return TokenEvent(self.request_id, None, "", None, None, "abort", self.num_prompt_tokens,
                          self.num_output_tokens)
