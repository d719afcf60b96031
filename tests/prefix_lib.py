"""What the prefix-cache tests share: a tiny engine with the cache on or off, a greedy turn through it, and the
comparison of two engines' last logprobs."""

from __future__ import annotations

import pytest

from ft.runtime.engine import Engine, EngineSettings, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
FIRST = [(11 * i + 5) % 180 + 12 for i in range(30)]
ARCHS = ["qwen3_moe", "qwen3_5_moe", "glm_moe_dsa", "deepseek_v4"]  # attention; DeltaNet + attention; MLA + DSA; CSA
SNAPSHOTTED = ("qwen3_5_moe", "deepseek_v4")  # states that go back to an earlier length only from a snapshot


def engine(ftw, entries: int, **kw) -> Engine:
    return Engine(ftw, EngineSettings(prefix_cache_entries=entries, max_prefill_length=16, **kw))


def turn(engine: Engine, prompt: list[int], rid: str, snapshot_at: int | None = None) -> tuple[list[int], int]:
    """Greedy output ids and the prompt tokens the engine took from the cache; the chosen tokens' logprobs in
    `engine.last_logprobs` (compared too: tiny random models often pick the same tokens from different states)."""
    engine.add_request(rid, prompt, GREEDY, snapshot_at=snapshot_at)
    out, cached, engine.last_logprobs = [], None, []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out.append(ev.token_id)
                engine.last_logprobs.append(ev.logprob)
            cached = ev.num_cached_tokens
    return out, cached


def same(a: Engine, b: Engine) -> bool:
    return a.last_logprobs == pytest.approx(b.last_logprobs, abs=1e-4)
