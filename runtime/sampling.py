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
    # the client asked for max_tokens: a prompt that leaves less room in the context is refused (ContextOverflowError
    # naming both numbers), never answered with a silently shorter output; False: max_tokens is an upper bound only
    max_tokens_required: bool = False

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
            device = torch.device(device)
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self.seen[_to_device(prompt_ids, torch.long, device)] = True
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._one = torch.ones(1, dtype=torch.float32, device=device)  # what `observe` adds to a count

    def observe(self, token_id: int | torch.Tensor) -> None:
        """Record one sampled output token: an int, or a one-element int64 tensor on the sampler's device (a token
        sampled there: recorded without reading it back)."""
        if self.seen is not None:
            t = torch.as_tensor(token_id, device=self.seen.device).reshape(1)
            self.seen.index_fill_(0, t, True)
            self.counts.index_add_(0, t, self._one)

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


# top-p looks for its cut among this many largest logits first, then the next size, then sorts the whole row (see
# `top_p_drop`). Only on the CPU, where a full sort of a 248k vocabulary costs ~30 ms and topk ~2 ms; on a GPU the
# sort is cheap and the exactness check would cost a device sync, so the full sort runs directly.
TOP_P_CANDIDATES = (1024, 32768)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a stream sync (`torch.tensor(..., device="cuda")` copies from pageable
    memory and then waits for the stream; a pinned source copied non_blocking does not)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def top_p_drop(logits: torch.Tensor, top_p: list[float], candidates: tuple[int, ...] = ()) -> torch.Tensor:
    """[B, V] bool, True where top-p drops a token of `logits` [B, V] (already scaled and masked; -inf = masked).

    top_p: B host floats. Order: descending logits; prob = exp(logit - logsumexp(row)); a token is dropped when the
    mass strictly before it in that order is >= top_p. Rows with top_p >= 1 drop nothing. Ties: the order among equal
    logits is the sort's (or topk's), so at an exact tie on the cut either of them may be the one kept.

    `candidates`: sizes n tried in turn before the full sort: the same computation over the n largest logits (topk).
    It is exact when the last candidate of every active row is dropped (the mass before any later token is at least
    as large); the sorted values, probabilities and running sums of the candidates are those of the full sort's
    first n entries, so the fast path's mask equals the full sort's bit for bit (CPU cumsum runs in order).
    The check is a host read, so on a GPU pass no candidates (see TOP_P_CANDIDATES).
    """
    B, V = logits.shape
    dev = logits.device
    p = _to_device(top_p, torch.float32, dev).unsqueeze(-1)  # [B, 1]
    active = _to_device([q < 1 for q in top_p], torch.bool, dev).unsqueeze(-1)  # [B, 1]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    for n in (*[c for c in candidates if c < V], V):
        vals, order = torch.topk(logits, n, dim=-1) if n < V else torch.sort(logits, dim=-1, descending=True)
        probs = torch.exp(vals - lse)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs >= p) & active
        if n == V or bool((drop_sorted[:, -1:] | ~active).all()):
            break
    # Active rows drop everything outside the candidates; the scatter writes each candidate's own decision.
    return active.expand(B, V).clone().scatter_(-1, order, drop_sorted)


def _host_list(values) -> list:
    return list(values) if isinstance(values, (list, tuple)) else torch.as_tensor(values).tolist()


def mask_logits(logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """Apply top-k, top-p and min-p (in that order) to temperature-scaled logits [B, V] -> masked tensor (a new
    tensor when any mask applies; the input is never modified).

    top_k: B ints (0 = off); top_p: B floats (1 = off); min_p: B floats (0 = off); lists or host tensors. Which masks
    run is decided on the host, so nothing here waits for the device (on the CPU see TOP_P_CANDIDATES).
    Masked entries are -inf. Ties at the top-k threshold are kept (HF semantics). top-p keeps the smallest prefix of
    the sorted distribution whose mass reaches top_p (a token stays if the mass strictly above it is < top_p;
    `top_p_drop`). min-p keeps tokens with prob >= min_p * max prob of the distribution left after top-k/top-p.
    """
    top_k, top_p, min_p = _host_list(top_k), _host_list(top_p), _host_list(min_p)
    dev, V = logits.device, logits.shape[-1]
    neg_inf = float("-inf")
    if any(k > 0 for k in top_k):
        k_max = min(max(top_k), V)
        top_vals = torch.topk(logits, k_max, dim=-1).values  # [B, k_max], descending
        idx = _to_device([min(max(k, 1), k_max) - 1 for k in top_k], torch.long, dev).unsqueeze(-1)  # [B, 1]
        threshold = top_vals.gather(-1, idx)  # [B, 1]
        threshold = threshold.masked_fill(_to_device([k <= 0 for k in top_k], torch.bool, dev).unsqueeze(-1), neg_inf)
        logits = torch.where(logits < threshold, neg_inf, logits)
    if any(p < 1 for p in top_p):
        candidates = TOP_P_CANDIDATES if dev.type == "cpu" else ()
        logits = logits.masked_fill(top_p_drop(logits, top_p, candidates), neg_inf)
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = _to_device(min_p, torch.float32, dev).unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, neg_inf)
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from probs [V] (0-dim int64 tensor, on probs' device): torch.multinomial(probs, 1)'s own method
    (argmax of probs / Exp(1) noise, the exponential race) without its input checks, which read the device (a sync
    per call on CUDA). Same generator draws, so the same token as torch.multinomial for the same generator state."""
    return (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax(-1)


class PendingSample:
    """Tokens sampled on the device, on their way to the host: `token_ids` [B] int64 on the device (a decode step can
    embed them before the host knows them) and `result()`, the host lists (waits only for this copy)."""

    def __init__(self, token_ids: torch.Tensor, packed: torch.Tensor, params: list[SamplingParams], k: int) -> None:
        self.token_ids = token_ids
        self._params, self._k = params, k
        self._host = packed.to("cpu", non_blocking=True)  # page-locked when packed is on a GPU
        self._copied = None
        if packed.device.type == "cuda":
            # blocking: the host thread sleeps until the copy lands instead of spinning on a core that the CPU expert
            # lane's threads use (`runtime/gpu/cpu/lane.py`); the step after this one is already queued meanwhile
            self._copied = torch.cuda.Event(blocking=True)
            self._copied.record()
        self._result: SampleOutput | None = None

    def result(self) -> SampleOutput:
        if self._result is None:
            if self._copied is not None:
                self._copied.synchronize()
            B, k, rows = len(self._params), self._k, self._host.tolist()
            out_lp: list[float | None] = [None] * B
            out_top: list[list[tuple[int, float]] | None] = [None] * B
            if self._host.dim() == 1:  # token ids only
                ids = rows
            else:  # [token, its logprob, top-k ids, top-k logprobs] per row (`sample_async`)
                ids = [int(r[0]) for r in rows]
                for i, p in enumerate(self._params):
                    if p.logprobs is not None:
                        r, n = rows[i], p.logprobs
                        out_lp[i] = r[1]
                        out_top[i] = [(int(t), v) for t, v in zip(r[2:2 + n], r[2 + k:2 + k + n])]
            self._result = SampleOutput(ids, out_lp, out_top)
        return self._result


def sample(logits: torch.Tensor, samplers: list[RequestSampler]) -> SampleOutput:
    """`sample_async(logits, samplers).result()`: the tokens on the host."""
    return sample_async(logits, samplers).result()


def sample_async(logits: torch.Tensor, samplers: list[RequestSampler]) -> PendingSample:
    """logits: [B, V] float32 raw model logits, one row per request (in `samplers` order) -> one token per row.

    Device work is queued without a sync, the penalties' statistics included (`observe` of the device tokens); the
    results (tokens, and logprobs when any row asks) go to the host in ONE non-blocking copy (`PendingSample`).
    Vocab-sized work per step: greedy rows an argmax; penalties, sampling masks and logprobs only for the rows (and
    settings) that use them.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(samplers), (logits.shape, len(samplers))
    logits = logits.float()
    params = [s.params for s in samplers]
    B, dev = len(params), logits.device

    if any(p.has_penalties for p in params):
        processed = torch.stack([s.apply_penalties(logits[i]) for i, s in enumerate(samplers)])
    else:
        processed = logits
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if len(random_rows) < B:
        token_ids = processed.argmax(dim=-1)  # greedy rows keep this
    else:
        token_ids = torch.zeros(B, dtype=torch.long, device=dev)
    if random_rows:
        sub = [params[i] for i in random_rows]
        rows = processed if len(random_rows) == B else processed.index_select(
            0, _to_device(random_rows, torch.long, dev))
        scaled = rows / _to_device([p.temperature for p in sub], torch.float32, dev).unsqueeze(-1)
        masked = mask_logits(scaled, [p.top_k for p in sub], [p.top_p for p in sub], [p.min_p for p in sub])
        probs = torch.softmax(masked, dim=-1)
        for j, i in enumerate(random_rows):
            token_ids[i] = draw(probs[j], samplers[i].generator)
    for i, s in enumerate(samplers):
        s.observe(token_ids[i:i + 1])

    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not lp_rows:
        return PendingSample(token_ids, token_ids, params, 0)
    # Raw logprobs (module docstring). One float64 row per request: [token, its logprob, top-k ids, top-k logprobs];
    # ids < 2**53 and float32 values are exact in float64.
    raw = torch.log_softmax(logits, dim=-1)
    chosen = token_ids.unsqueeze(-1)
    k = max(params[i].logprobs for i in lp_rows)
    cols = [chosen, raw.gather(-1, chosen)]
    if k:
        vals, idx = torch.topk(raw, k, dim=-1)
        cols += [idx, vals]
    return PendingSample(token_ids, torch.cat([c.double() for c in cols], dim=-1), params, k)
