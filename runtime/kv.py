"""The KV token budget shared by all running sequences (`--kv-reserve-tokens`).

A running request holds a reservation that covers what its KV cache needs now, not its whole possible output:
admission reserves its prefill (prompt, plus the tokens it already generated when it is recomputed after a
preemption) and one decode token, rounded up to a block; while it decodes, the engine grows the reservation a block
at a time before each forward that needs more. Every reservation is capped at the request's own maximum length
`min(prompt + max_tokens, max_context)`. When the free budget cannot cover a growth the engine preempts (see
`ft.runtime.engine`). Waiting requests hold nothing; finishing, aborting or being preempted returns the tokens at once.

`block` = min(block_tokens, total // 8), at least 1: reservations move in steps of a block, and a small budget still
holds several growing requests.
Invariant: `used == sum(reservations) <= total`.
"""

from __future__ import annotations


class ContextOverflowError(ValueError):
    """The prompt can never be served: it does not leave room for one output token."""


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queued_requests`."""


class KvBudget:
    def __init__(self, total_tokens: int, max_position_embeddings: int, block_tokens: int = 256) -> None:
        if total_tokens < 2:
            raise ValueError(f"the KV budget must be at least 2 tokens, got {total_tokens}")
        if block_tokens < 1:
            raise ValueError(f"the KV block must be at least 1 token, got {block_tokens}")
        self.total = total_tokens
        self.max_position_embeddings = max_position_embeddings
        self.block = max(1, min(block_tokens, total_tokens // 8))
        self._reservations: dict[str, int] = {}
        self._used = 0  # == sum(self._reservations.values())

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) one request can have."""
        return min(self.total, self.max_position_embeddings)

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.total - self._used

    def reserved(self, request_id: str) -> int:
        """Tokens `request_id` holds (0 if none)."""
        return self._reservations.get(request_id, 0)

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise ContextOverflowError unless the prompt leaves room for at least one output token."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt must contain at least one token")
        if num_prompt_tokens >= self.total:
            raise ContextOverflowError(
                f"prompt is {num_prompt_tokens} tokens; the KV budget is {self.total}; raise --kv-reserve-tokens"
            )
        if num_prompt_tokens >= self.max_position_embeddings:
            raise ContextOverflowError(
                f"prompt is {num_prompt_tokens} tokens; the model's context is "
                f"{self.max_position_embeddings} tokens"
            )

    def max_length(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """A request's longest sequence: its prompt + max_tokens, capped by the context (output may end early)."""
        return min(num_prompt_tokens + max_tokens, self.max_context)

    def rounded(self, num_tokens: int, max_length: int) -> int:
        """`num_tokens` rounded up to a whole block, capped at the request's `max_length`."""
        assert 0 < num_tokens <= max_length, (num_tokens, max_length)
        return min(-(-num_tokens // self.block) * self.block, max_length)

    def try_reserve(self, request_id: str, num_tokens: int, *, headroom: int = 0) -> bool:
        """Reserve `num_tokens` for `request_id` if they are free now with `headroom` tokens to spare; False (nothing
        changes) if not."""
        assert request_id not in self._reservations, request_id
        assert 0 < num_tokens <= self.total, (num_tokens, self.total)
        if num_tokens + headroom > self.free:
            return False
        self._reservations[request_id] = num_tokens
        self._used += num_tokens
        return True

    def try_grow(self, request_id: str, num_tokens: int, max_length: int) -> bool:
        """Make `request_id`'s reservation cover `num_tokens`: True at once if it does; else grow it to
        `rounded(num_tokens)`, or to everything free when that is less but still enough. False (nothing changes)
        when even `num_tokens` does not fit."""
        held = self._reservations[request_id]
        if num_tokens <= held:
            return True
        want = min(self.rounded(num_tokens, max_length), held + self.free)
        if want < num_tokens:
            return False
        self._reservations[request_id] = want
        self._used += want - held
        return True

    def release(self, request_id: str) -> None:
        """Return a request's tokens (no-op if it holds none)."""
        self._used -= self._reservations.pop(request_id, 0)
