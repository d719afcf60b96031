"""Sampler: exact masks on hand-made logits, penalties, distributions, seeds and raw logprobs."""

from __future__ import annotations

import math
import re

import pytest
import torch

from ft.runtime.sampling import (RequestSampler, SamplingParams, mask_logits, params_from_generation_config,
                                 sample)

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
