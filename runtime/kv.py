"""The KV token budget shared by all sequences (`--kv-reserve-tokens`).

Every admitted request reserves `min(prompt + max_tokens, max_context)` tokens up front, and its model state
(`model.new_state`) is sized to exactly that reservation, so a running request can never run out of KV mid-stream.
A request that does not fit in the free budget waits; finishing or aborting returns its tokens at once.
Invariant: `used == sum(reservations) <= total`.
"""

from __future__ import annotations


class ContextOverflowError(ValueError):
    """The prompt can never be served: it does not leave room for one output token."""


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queued_requests`."""


class KvBudget:
    def __init__(self, total_tokens: int, max_position_embeddings: int) -> None:
        if total_tokens < 2:
            raise ValueError(f"the KV budget must be at least 2 tokens, got {total_tokens}")
        self.total = total_tokens
        self.max_position_embeddings = max_position_embeddings
        self._reservations: dict[str, int] = {}

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) one request can have."""
        return min(self.total, self.max_position_embeddings)

    @property
    def used(self) -> int:
        return sum(self._reservations.values())

    @property
    def free(self) -> int:
        return self.total - self.used

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

    def reservation_for(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Tokens a request reserves: its whole sequence, capped by the context (so output may end early)."""
        return min(num_prompt_tokens + max_tokens, self.max_context)

    def try_reserve(self, request_id: str, num_tokens: int) -> bool:
        """Reserve `num_tokens` for `request_id` if they are free now; False (nothing changes) if not."""
        assert request_id not in self._reservations, request_id
        assert num_tokens <= self.total, (num_tokens, self.total)
        if num_tokens > self.free:
            return False
        self._reservations[request_id] = num_tokens
        return True

    def release(self, request_id: str) -> None:
        """Return a request's tokens (no-op if it holds none)."""
        self._reservations.pop(request_id, None)
