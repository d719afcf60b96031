"""Sampler: exact masks on hand-made logits, penalties, distributions, seeds and raw logprobs."""

from __future__ import annotations

import math
import re

import pytest
import torch

from torch.overrides import TorchFunctionMode

import ft.runtime.sampling as sampling
from ft.runtime.sampling import (RequestSampler, SamplingParams, draw, mask_logits, params_from_generation_config,
                                 sample, top_p_drop)

INF = float("inf")


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def _kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in masked]


def _mask(logits, top_k=0, top_p=1.0, min_p=0.0):
    b = logits.shape[0]
    return mask_logits(logits, torch.full((b,), top_k, dtype=torch.long), torch.full((b,), top_p),
                       torch.full((b,), min_p))


def test_top_k_mask_is_exact_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 5.0, 1.0, 1.0, 0.0]])
    masked = mask_logits(logits, torch.tensor([2, 0, 3]), torch.ones(3), torch.zeros(3))
    assert _kept(masked) == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 2, 3]]  # ties at the threshold stay (row 3)
    assert torch.equal(masked[0, :2], logits[0, :2])  # kept logits are untouched


@pytest.mark.parametrize("top_p, kept", [(0.45, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_mask_keeps_smallest_prefix_reaching_p(top_p, kept):
    assert _kept(_mask(_logits([0.5, 0.3, 0.15, 0.05]), top_p=top_p)) == [kept]


def test_top_p_order_does_not_depend_on_token_position():
    assert _kept(_mask(_logits([0.05, 0.3, 0.15, 0.5]), top_p=0.75)) == [[1, 3]]


@pytest.mark.parametrize("min_p, kept", [(0.35, [0, 1]), (0.2, [0, 1, 2]), (0.05, [0, 1, 2, 3]), (1.0, [0])])
def test_min_p_mask_relative_to_top_prob(min_p, kept):
    assert _kept(_mask(_logits([0.5, 0.3, 0.15, 0.05]), min_p=min_p)) == [kept]


def test_top_p_applies_after_top_k_renormalisation():
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    # Alone, top-p 0.75 keeps 3 tokens (mass above token 2 is 0.7); after top-k 3 the renormalised mass above
    # token 2 is 0.7 / 0.9 = 0.78 >= 0.75, so it goes.
    assert _kept(_mask(logits, top_p=0.75)) == [[0, 1, 2]]
    assert _kept(_mask(logits, top_k=3, top_p=0.75)) == [[0, 1]]


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    logits = logits_row.expand(n, -1).contiguous()
    samplers = [RequestSampler(SamplingParams(**{**params.__dict__, "seed": i}), [], logits.shape[1])
                for i in range(n)]
    ids = torch.tensor(sample(logits, samplers).token_ids)
    return torch.bincount(ids, minlength=logits.shape[1]).float() / n


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_temperature_sampling_matches_softmax(temperature):
    row = torch.tensor([0.0, math.log(2), math.log(4)])
    freq = _frequencies(row, SamplingParams(temperature=temperature))
    expected = torch.softmax(row / temperature, dim=0)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_masked_tokens_are_never_sampled_and_the_rest_renormalise():
    row = _logits([0.4, 0.3, 0.2, 0.1])[0]
    freq = _frequencies(row, SamplingParams(top_k=2))
    assert freq[2] == 0 and freq[3] == 0
    assert abs(float(freq[0]) - 4 / 7) < 0.03
    freq = _frequencies(row, SamplingParams(min_p=0.6))  # floor 0.24: keeps 0.4 and 0.3
    assert freq[2] == 0 and freq[3] == 0


def test_greedy_rows_take_argmax():
    logits = torch.tensor([[0.0, 3.0, 2.9], [5.0, 0.0, 4.9], [0.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=1.5), SamplingParams(temperature=0)]
    for _ in range(5):
        out = sample(logits, [RequestSampler(p, [], 3) for p in params])
        assert out.token_ids == [1, 0, 2]


def test_seed_reproduces_tokens_and_different_seeds_differ():
    torch.manual_seed(0)
    logits = torch.randn(20, 1000)

    def run(seed):
        s = RequestSampler(SamplingParams(temperature=1.0, seed=seed), [], 1000)
        return [sample(logits[i:i + 1], [s]).token_ids[0] for i in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_row_is_independent_of_batch_neighbours():
    torch.manual_seed(1)
    row = torch.randn(1, 500)
    alone = sample(row, [RequestSampler(SamplingParams(seed=3), [], 500)]).token_ids[0]
    batch = torch.cat([torch.randn(1, 500), row, torch.randn(1, 500)])
    samplers = [RequestSampler(SamplingParams(seed=s), [], 500) for s in (1, 3, 5)]
    assert sample(batch, samplers).token_ids[1] == alone


def test_repetition_penalty_hf_semantics_over_prompt_and_output():
    s = RequestSampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], vocab_size=4)
    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    assert s.apply_penalties(row).tolist() == [1.0, -4.0, 1.0, 0.5]
    s.observe(2)
    s.observe(2)
    assert s.apply_penalties(row).tolist() == [1.0, -4.0, 0.5, 0.5]  # once per token, not per occurrence
    assert row.tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is not modified


def test_presence_and_frequency_penalties_openai_semantics_over_output_only():
    s = RequestSampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[3], vocab_size=4)
    for t in (0, 0, 0, 1):
        s.observe(t)
    out = s.apply_penalties(torch.zeros(4))
    assert out.tolist() == [-(0.5 + 0.75), -(0.5 + 0.25), 0.0, 0.0]  # prompt token 3 is not penalised


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    s = RequestSampler(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[0], vocab_size=3)
    assert sample(logits, [s]).token_ids == [1]  # 3.0 / 2 = 1.5 < 2.0
    assert sample(logits, [s]).token_ids == [0]  # now 1 is seen too: 1.5 > 1.0


def test_logprobs_are_raw_model_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    params = SamplingParams(temperature=0.3, top_k=2, repetition_penalty=1.5, logprobs=3, seed=0)
    out = sample(logits, [RequestSampler(params, [2], 4)])
    raw = torch.log_softmax(logits[0], dim=0)
    tok = out.token_ids[0]
    assert out.logprobs[0] == pytest.approx(float(raw[tok]))
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1, 0]
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(raw[[2, 1, 0]].tolist())
    zero = sample(logits, [RequestSampler(SamplingParams(logprobs=0, temperature=0), [], 4)])
    assert zero.top_logprobs == [[]] and zero.logprobs[0] == pytest.approx(float(raw[2]))
    none = sample(logits, [RequestSampler(SamplingParams(temperature=0), [], 4)])
    assert none.logprobs == [None] and none.top_logprobs == [None]


# ---- fast paths equal the general path --------------------------------------------------------------------------

def _rows(vocab: int = 5000) -> torch.Tensor:
    """Peaked rows (cut within 8 candidates), medium (within 256), flat (needs the full sort), one with -inf."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, vocab, generator=g) * torch.tensor([[12.0], [8.0], [4.0], [2.0], [0.5], [6.0]])
    rows[5, ::3] = -INF  # masked by an earlier top-k
    return rows


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_top_p_candidates_equal_full_sort(top_p):
    rows = _rows()
    tp = [top_p] * 6
    full = top_p_drop(rows, tp)
    for candidates in ((8,), (8, 256), (256, 4096), (64, 100_000)):
        assert torch.equal(top_p_drop(rows, tp, candidates), full), candidates
    # The peaked row's cut lies inside the first 8 candidates: the fast path really decides there.
    assert (~full[0]).sum() <= 8 and (~full[4]).sum() > 256  # and the flat row needs the full sort


def test_top_p_one_drops_nothing_even_next_to_an_active_row():
    rows = _rows()[:2]
    drop = top_p_drop(rows, [1.0, 0.9], (8, 256))
    assert not drop[0].any() and torch.equal(drop[1], top_p_drop(rows[1:], [0.9])[0])


def test_sample_top_p_fast_path_draws_the_same_tokens(monkeypatch):
    rows = _rows(20_000)

    def draw():
        params = [SamplingParams(temperature=t, top_p=p, seed=s) for t, p, s in
                  ((1.0, 0.9, 1), (0.7, 0.95, 2), (1.3, 0.8, 3), (1.0, 0.5, 4), (0.9, 0.99, 5), (1.0, 0.9, 6))]
        samplers = [RequestSampler(p, [], rows.shape[1]) for p in params]
        return [sample(rows, samplers).token_ids for _ in range(5)]

    fast = draw()
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", ())
    assert draw() == fast


def test_draw_is_torch_multinomial_for_the_same_generator():
    probs = torch.softmax(_rows(), dim=-1)
    probs[:, ::5] = 0  # masked tokens
    for seed in range(3):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for row in probs:
            for _ in range(3):
                assert int(draw(row, g1)) == int(torch.multinomial(row, 1, generator=g2)[0])


def test_top_k_one_through_the_sampling_path_is_the_greedy_argmax():
    rows = _rows()
    masked = mask_logits(rows / 0.7, [1] * 6, [1.0] * 6, [0.0] * 6)
    probs = torch.softmax(masked, dim=-1)
    g = torch.Generator().manual_seed(0)
    drawn = [int(torch.multinomial(probs[i], 1, generator=g)) for i in range(6)]
    greedy = sample(rows, [RequestSampler(SamplingParams(temperature=0), [], rows.shape[1]) for _ in range(6)])
    assert drawn == greedy.token_ids == rows.argmax(-1).tolist()


def test_batched_logprobs_equal_each_row_alone():
    rows = _rows(3000)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.8, top_p=0.9, logprobs=0, seed=2), SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=1.0, top_k=20, logprobs=20, seed=3, repetition_penalty=1.2),
              SamplingParams(temperature=0)]
    batch = sample(rows, [RequestSampler(p, [7, 9], rows.shape[1]) for p in params])
    for i, p in enumerate(params):
        alone = sample(rows[i:i + 1], [RequestSampler(p, [7, 9], rows.shape[1])])
        assert (batch.token_ids[i], batch.logprobs[i], batch.top_logprobs[i]) == \
            (alone.token_ids[0], alone.logprobs[0], alone.top_logprobs[0]), p
    assert [len(t) if t is not None else None for t in batch.top_logprobs] == [5, None, 0, 2, 20, None]


class _HostReads(TorchFunctionMode):
    """Counts tensor reads to the host: on a GPU each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__bool__", "__float__", "numpy")
        return func(*args, **(kwargs or {}))


def test_one_host_read_per_sample_call(monkeypatch):
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", ())  # what a GPU runs (the CPU fast path checks on the host)
    rows = _rows(3000)
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.9, seed=1), SamplingParams(top_k=5, seed=2),
              SamplingParams(min_p=0.1, seed=3), SamplingParams(logprobs=3, top_p=0.5, seed=4),
              SamplingParams(temperature=0, presence_penalty=0.5, logprobs=0)]
    samplers = [RequestSampler(p, [1, 2], rows.shape[1]) for p in params]
    for batch in (samplers, samplers[:1], samplers[1:2]):
        with _HostReads() as reads:
            sample(rows[:len(batch)], batch)
        assert reads.n == 1


@pytest.mark.parametrize("kw, msg", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
    ({"logprobs": 21}, "logprobs must be in 0..20"),
    ({"stop": ("",)}, "stop strings must be non-empty"),
])
def test_invalid_params_are_refused(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        SamplingParams(**kw)


def test_params_accept_lists_and_stay_hashable():
    p = SamplingParams(stop=["a"], stop_token_ids=[5])
    assert p.stop == ("a",) and p.stop_token_ids == (5,)
    hash(p)


def test_params_from_generation_config_precedence():
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
           "eos_token_ids": [1]}
    p = params_from_generation_config(gen, max_tokens=9, temperature=None, top_k=5)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (9, 0.6, 0.95, 5, 1.1)
    assert params_from_generation_config({"do_sample": False, "temperature": 0.7}).temperature == 0.0
    assert params_from_generation_config({}, temperature=0.3) == SamplingParams(temperature=0.3)
