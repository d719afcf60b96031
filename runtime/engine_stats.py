"""The engine's counters since start, and the `Engine.stats()` snapshot built from them."""

from __future__ import annotations

from collections import deque


class EngineCounters:
    """Requests, tokens, steps and their seconds. decode_tok_s covers decode-only steps; prefill_tok_s the steps with
    a prefill chunk (those may also carry decodes). TTFT is measured from add_request over the last 1024 requests;
    `preemptions`: states dropped for KV (recompute)."""

    def __init__(self) -> None:
        self.c = {"requests_total": 0, "requests_finished": 0, "requests_aborted": 0, "prompt_tokens_total": 0,
                  "output_tokens_total": 0, "decode_tokens": 0, "prefill_tokens": 0, "steps": 0, "preemptions": 0}
        self.decode_s = 0.0  # time of decode-only steps
        self.prefill_s = 0.0  # time of steps that ran a prefill chunk
        self.ttfts: deque[float] = deque(maxlen=1024)

    def add(self, key: str, n: int = 1) -> None:
        self.c[key] += n

    def step(self, seconds: float, sampled: list, num_decodes: int, num_prefill: int) -> None:
        """One step's work: `sampled` requests (their first token gives a TTFT), decode tokens, prefill tokens."""
        c = self.c
        c["steps"] += 1
        c["output_tokens_total"] += len(sampled)
        for req in sampled:
            if req.num_output_tokens == 1:
                self.ttfts.append(req.first_token_time - req.arrival_time)
        if num_prefill:
            c["prefill_tokens"] += num_prefill
            self.prefill_s += seconds
        elif num_decodes:
            c["decode_tokens"] += num_decodes
            self.decode_s += seconds

    def snapshot(self) -> dict:
        c, ttfts = self.c, sorted(self.ttfts)
        return {
            "requests_total": c["requests_total"], "requests_finished": c["requests_finished"],
            "requests_aborted": c["requests_aborted"], "prompt_tokens_total": c["prompt_tokens_total"],
            "output_tokens_total": c["output_tokens_total"], "steps": c["steps"],
            "decode_tok_s": c["decode_tokens"] / self.decode_s if self.decode_s else 0.0,
            "prefill_tok_s": c["prefill_tokens"] / self.prefill_s if self.prefill_s else 0.0,
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None, "preemptions": c["preemptions"],
        }
