"""Prefix reuse across requests: finished requests' states kept, so that a later prompt that starts with the same
tokens prefills only the rest. Coding agents resend the whole conversation on every turn, most of it unchanged.

    cache = PrefixCache(kv, max_entries=8)
    cache.put(tokens, state, snapshots)       # a finished request: `tokens` are the ones its state consumed
    hit = cache.take(prompt_ids)              # -> PrefixHit(state, length) or None: the state holds prompt[:length]

An entry is a `SequenceState` that consumed `tokens` (prompt + output but the last sampled token), its KV rows still
on the device and held in the KV budget under a reservation of its own ("prefix:N"), plus `snapshots`: host copies of
the recurrent layers' states at chosen lengths (the engine takes one at the end of each prefill chunk, the prompt's
end included). A prompt matches an
entry on their longest common token prefix L, capped at len(prompt) - 1 (one token must be run to get logits):
  * models with full attention only reuse any such length: KV rows past it are simply overwritten;
  * models with recurrent layers (Gated DeltaNet) reuse the largest length <= L at which a state is known exactly:
    the entry's own length (the next turn continues the whole conversation) or a snapshot's (the client re-rendered
    the assistant's reply differently, e.g. without its thinking: the prompt end before it still matches).
The entry with the longest usable prefix wins; taking it removes it (a state serves one request at a time).
The cache gives way to running requests: `evict` (least recently used first) frees an entry and its reservation,
and the engine calls it whenever an admission or a request's growth does not fit. Entries park their recurrent states
in host memory (`SequenceState.park`), so they hold device memory only for the KV rows the budget counts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ft.runtime.kv import KvBudget
from ft.runtime.state import SequenceState


MAX_SNAPSHOTS = 32  # per kept state: the latest chunk and prompt ends of its conversation (host memory each)


@dataclass
class PrefixHit:
    state: SequenceState
    length: int  # tokens of the prompt the state already holds
    snapshots: dict[int, tuple[dict, dict]]  # the entry's snapshots at lengths <= length, still valid for the prompt


@dataclass
class _Entry:
    key: str
    tokens: np.ndarray  # int64 [state.length]: matched against every prompt in one vectorized pass
    state: SequenceState
    snapshots: dict[int, tuple[dict, dict]]
    used: int


@dataclass
class PrefixCache:
    kv: KvBudget
    max_entries: int = 8
    entries: list[_Entry] = field(default_factory=list)
    counters: dict = field(default_factory=lambda: dict.fromkeys(("hits", "hit_tokens", "misses", "stored",
                                                                    "evicted"), 0))

    def __post_init__(self) -> None:
        self._ids = itertools.count()
        self._clock = itertools.count()

    def put(self, tokens: list[int], state: SequenceState, snapshots: dict[int, tuple[dict, dict]]) -> bool:
        """Keep `state` (it consumed exactly `tokens`); False (and the state freed) when the budget has no room for
        its KV rows even after evicting older entries."""
        if state.freed or state.length != len(tokens) or not tokens or self.max_entries < 1:
            state.free()
            return False
        while len(self.entries) >= self.max_entries:
            self.evict()
        key = f"prefix:{next(self._ids)}"
        while not self.kv.try_reserve(key, state.capacity):
            if not self.evict():
                state.free()
                return False
        state.park()
        snaps = {n: snapshots[n] for n in sorted(n for n in snapshots if 0 < n <= len(tokens))[-MAX_SNAPSHOTS:]}
        self.entries.append(_Entry(key, np.asarray(tokens, np.int64), state, snaps, next(self._clock)))
        self.counters["stored"] += 1
        return True

    def take(self, prompt: list[int]) -> PrefixHit | None:
        """The entry holding the longest usable prefix of `prompt` (removed from the cache, its reservation
        released: the caller reserves what the request needs), rewound to that prefix; None if none has one."""
        best, best_len = None, 0
        ids = np.asarray(prompt, np.int64)
        for entry in self.entries:
            n = _usable(entry, ids)
            if n > best_len:
                best, best_len = entry, n
        if best is None:
            self.counters["misses"] += 1
            return None
        self.entries.remove(best)
        self.kv.release(best.key)
        state = best.state
        state.unpark()
        state.rewind(best_len, best.snapshots.get(best_len) if best_len != state.length else None)
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += best_len
        return PrefixHit(state, best_len, {n: v for n, v in best.snapshots.items() if n <= best_len})

    def evict(self) -> bool:
        """Free the least recently stored entry and its reservation; False if there is none."""
        if not self.entries:
            return False
        entry = min(self.entries, key=lambda e: e.used)
        self.entries.remove(entry)
        self.kv.release(entry.key)
        entry.state.free()
        self.counters["evicted"] += 1
        return True

    def clear(self) -> None:
        while self.evict():
            pass

    def held(self) -> int:
        """KV tokens the entries hold in the budget."""
        return sum(self.kv.reserved(e.key) for e in self.entries)

    def stats(self) -> dict:
        return {**self.counters, "entries": len(self.entries), "tokens": sum(len(e.tokens) for e in self.entries),
                "kv_tokens_held": self.held(), "snapshots": sum(len(e.snapshots) for e in self.entries)}


def _usable(entry: _Entry, prompt: np.ndarray) -> int:
    limit = min(len(entry.tokens), len(prompt) - 1)
    differ = np.flatnonzero(entry.tokens[:limit] != prompt[:limit])
    common = int(differ[0]) if len(differ) else limit
    if not entry.state.recurrent:
        return common
    exact = [n for n in (len(entry.tokens), *entry.snapshots) if n <= common]
    return max(exact, default=0)
