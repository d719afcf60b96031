"""Sampling parameters and the batched sampler: logits [B, V] float32 -> one token per row.

Processing order per row (the Hugging Face `generate` order):
  1. repetition penalty (HF semantics): for every token seen in prompt + output, a positive logit is divided by the
     penalty and a negative one multiplied by it;
  2. presence / frequency penalties (OpenAI semantics, over output tokens only):
     logit -= frequency_penalty * count + presence_penalty * (count > 0);
  3. greedy rows (temperature 0 or top_k 1) take the argmax here;
  4. temperature, then top-k, top-p and min-p masks, then a draw from the row's own `torch.Generator`
     (seeded from `SamplingParams.seed`, so a seed reproduces its tokens for the same logits).

Logprobs are the log-softmax of the *raw* model logits (before penalties, temperature and masks), like vLLM's default
`raw_logprobs` mode: they describe the model, not the sampler, and are comparable across sampling settings.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import NamedTuple

import torch

MAX_LOGPROBS = 20  # OpenAI's cap for top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; k >= 0 = chosen token + top-k alternatives

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ValueError("; ".join(problems))
        # Lists from JSON are accepted and stored as tuples (the dataclass stays hashable).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def params_from_generation_config(generation: dict, **overrides) -> SamplingParams:
    """SamplingParams where each override that is not None wins, then the model's generation_config
    (`manifest.generation`), then the dataclass defaults. `do_sample: false` there means greedy (temperature 0)."""
    kw = {k: generation[k] for k in GENERATION_CONFIG_KEYS if generation.get(k) is not None}
    if generation.get("do_sample") is False:
        kw["temperature"] = 0.0
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**kw)


class RequestSampler:
    """Per-request sampling state: the generator and (only when penalties are on) the token statistics."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator.manual_seed(seed)
        self.seen: torch.Tensor | None = None  # [V] bool: token occurs in prompt + output (repetition penalty)
        self.counts: torch.Tensor | None = None  # [V] float32: occurrences in the output (presence/frequency)
        if params.has_penalties:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self.seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def observe(self, token_id: int) -> None:
        """Record one sampled output token."""
        if self.seen is not None:
            self.seen[token_id] = True
            self.counts[token_id] += 1

    def apply_penalties(self, row: torch.Tensor) -> torch.Tensor:
        """row: [V] float32 logits -> penalized copy (or the same tensor when no penalty is on)."""
        p = self.params
        if self.seen is None:
            return row
        row = row.clone()
        if p.repetition_penalty != 1:
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(self.seen, penalized, row)
        if p.frequency_penalty != 0 or p.presence_penalty != 0:
            row -= p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).float()
        return row


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[float | None]  # raw log-probability of the chosen token, None when not requested
    top_logprobs: list[list[tuple[int, float]] | None]  # top-k (token id, raw logprob), best first


def mask_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """Apply top-k, top-p and min-p (in that order) to temperature-scaled logits [B, V] -> masked copy.

    top_k: [B] int64 (0 = off); top_p: [B] float (1 = off); min_p: [B] float (0 = off). Masked entries are -inf.
    Ties at the top-k threshold are kept (HF semantics). top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (a token stays if the mass strictly above it is < top_p).
    min-p keeps tokens with prob >= min_p * max prob of the distribution left after top-k/top-p.
    """
    logits = logits.clone()
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    if bool((top_k > 0).any()):
        k_max = int(top_k.max())
        k_max = min(k_max, logits.shape[-1])
        top_vals = torch.topk(logits, k_max, dim=-1).values  # [B, k_max], descending
        idx = (top_k.clamp(min=1, max=k_max) - 1).unsqueeze(-1)  # [B, 1]
        threshold = top_vals.gather(-1, idx)  # [B, 1]
        threshold = torch.where((top_k > 0).unsqueeze(-1), threshold, neg_inf)
        logits = torch.where(logits < threshold, neg_inf, logits)
    if bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive prefix mass [B, V]
        drop_sorted = mass_above >= top_p.unsqueeze(-1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        floor = min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(logits: torch.Tensor, samplers: list[RequestSampler]) -> SampleOutput:
    """logits: [B, V] float32 raw model logits, one row per request (in `samplers` order) -> one token per row."""
    assert logits.dim() == 2 and logits.shape[0] == len(samplers), (logits.shape, len(samplers))
    logits = logits.float()
    params = [s.params for s in samplers]
    device = logits.device

    raw_logprobs = None
    if any(p.logprobs is not None for p in params):
        raw_logprobs = torch.log_softmax(logits, dim=-1)

    if any(p.has_penalties for p in params):
        processed = torch.stack([s.apply_penalties(logits[i]) for i, s in enumerate(samplers)])
    else:
        processed = logits
    token_ids = processed.argmax(dim=-1)  # greedy rows keep this

    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=device)
        sub = [params[i] for i in random_rows]
        temps = torch.tensor([p.temperature for p in sub], dtype=torch.float32, device=device)
        scaled = processed.index_select(0, rows) / temps.unsqueeze(-1)
        masked = mask_logits(
            scaled,
            torch.tensor([p.top_k for p in sub], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in sub], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in sub], dtype=torch.float32, device=device),
        )
        probs = torch.softmax(masked, dim=-1)
        for j, i in enumerate(random_rows):
            token_ids[i] = torch.multinomial(probs[j], 1, generator=samplers[i].generator)[0]

    ids = token_ids.tolist()
    out_lp: list[float | None] = [None] * len(ids)
    out_top: list[list[tuple[int, float]] | None] = [None] * len(ids)
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        out_lp[i] = float(raw_logprobs[i, ids[i]])
        if p.logprobs > 0:
            vals, idx = torch.topk(raw_logprobs[i], p.logprobs)
            out_top[i] = list(zip(idx.tolist(), vals.tolist()))
        else:
            out_top[i] = []
    for s, t in zip(samplers, ids):
        s.observe(t)
    return SampleOutput(ids, out_lp, out_top)
