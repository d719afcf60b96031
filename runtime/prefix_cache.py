"""Prefix reuse across requests: finished requests' states kept, so that a later prompt that starts with the same
tokens prefills only the rest. Coding agents resend the whole conversation on every turn, most of it unchanged.

    cache = PrefixCache(kv, max_entries=8)
    hit = cache.take(prompt_ids, capacity=n)  # -> PrefixHit(state, length, ...) or None: a copy of prompt[:length]
    cache.put(tokens, state, snapshots, replaces=hit.source)  # a finished request: its state consumed `tokens`

An entry is a `SequenceState` that consumed `tokens` (prompt + output but the last sampled token), its KV rows still
on the device and held in the KV budget under a reservation of its own ("prefix:N"), plus `snapshots`: host copies of
the parts of its state that are valid at one length only (`SequenceState.snapshot`: the recurrent layers' states, the
compressed layers' rings of raw compressor rows) at chosen lengths (the engine takes one at the end of each prefill
chunk, the prompt's end included). A prompt matches an entry on their longest common token prefix L, capped at
len(prompt) - 1 (one token must be run to get logits):
  * models with full attention only reuse any such length: KV rows past it are simply overwritten;
  * models with recurrent layers (Gated DeltaNet) or compressed attention (deepseek_v4) reuse the largest length
    <= L at which the state is known exactly: the entry's own length (the next turn continues the whole
    conversation) or a snapshot's (the client re-rendered the assistant's reply differently, e.g. without its
    thinking: the prompt end before it still matches); the rows are truncated there, the rest restored from the
    snapshot (`SequenceState.rewind` / `clone`).
The entry with the longest usable prefix wins; when the budget has room for the request beside it, the request gets a
copy of its state (`SequenceState.clone`, a device copy of the KV rows) and the entry stays (else the entry's own
state, and the entry goes), so requests that share a prefix at the same time all reuse it (an agent's
parallel calls share their system prompt and tools; a conversation forks). When the request finishes its state
replaces the entry it was copied from (if still kept: the first of several sharers to finish replaces it), so a
conversation holds one entry, as when a state served one request at a time; a stored state also supersedes the
entries whose tokens it extends when it can resume from every length they could (attention only, or it holds a
snapshot at their length).
The cache gives way to running requests: `evict` (least recently used first) frees an entry and its reservation,
and the engine calls it whenever an admission or a request's growth does not fit. Entries park their recurrent states
and rings in host memory (`SequenceState.park`), so they hold device memory only for the rows the budget counts; an
entry's state is never run again, only copied.
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
    snapshots: dict[int, dict]  # the entry's snapshots at lengths <= length, still valid for the prompt
    source: str | None  # the entry copied (`put(..., replaces=source)`); None: the entry's own state, removed


@dataclass
class _Entry:
    key: str
    tokens: np.ndarray  # int64 [state.length]: matched against every prompt in one vectorized pass
    state: SequenceState
    snapshots: dict[int, dict]  # length -> `SequenceState.snapshot` taken there
    used: int


@dataclass
class PrefixCache:
    kv: KvBudget
    max_entries: int = 8
    entries: list[_Entry] = field(default_factory=list)
    counters: dict = field(default_factory=lambda: dict.fromkeys(("hits", "shared", "hit_tokens", "misses",
                                                                    "stored", "superseded", "evicted"), 0))

    def __post_init__(self) -> None:
        self._ids = itertools.count()
        self._clock = itertools.count()

    def put(self, tokens: list[int], state: SequenceState, snapshots: dict[int, dict], *,
            replaces: str | None = None) -> bool:
        """Keep `state` (it consumed exactly `tokens`) in place of the entry `replaces` (the one it was copied from,
        if still kept); False (and the state freed) when the budget has no room for its KV rows even after evicting
        older entries."""
        if state.freed or state.length != len(tokens) or not tokens or self.max_entries < 1:
            state.free()
            return False
        snaps = {n: snapshots[n] for n in sorted(n for n in snapshots if 0 < n <= len(tokens))[-MAX_SNAPSHOTS:]}
        ids = np.asarray(tokens, np.int64)
        for old in [e for e in self.entries if e.key == replaces or _supersedes(ids, snaps, state, e)]:
            self._drop(old)
            self.counters["superseded"] += 1
        while len(self.entries) >= self.max_entries:
            self.evict()
        key = f"prefix:{next(self._ids)}"
        while not self.kv.try_reserve(key, state.capacity):
            if not self.evict():
                state.free()
                return False
        state.park()
        self.entries.append(_Entry(key, ids, state, snaps, next(self._clock)))
        self.counters["stored"] += 1
        return True

    def take(self, prompt: list[int], *, capacity: int | None = None, share: bool = True) -> PrefixHit | None:
        """The state of the entry holding the longest usable prefix of `prompt`, at that prefix; None if no entry has
        one. `share`: a copy with KV buffers of `capacity` rows, the entry kept with its reservation (the caller
        reserves what the request needs: it must have room for that beside the entry, since the copy is allocated
        now); else the entry's own state, the entry removed and its reservation released (the budget is short)."""
        best, best_len = None, 0
        ids = np.asarray(prompt, np.int64)
        for entry in self.entries:
            n = _usable(entry, ids)
            if n > best_len:
                best, best_len = entry, n
        if best is None:
            self.counters["misses"] += 1
            return None
        src, at = best.state, best.snapshots.get(best_len) if best_len != best.state.length else None
        snaps = {n: v for n, v in best.snapshots.items() if n <= best_len}
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += best_len
        if not share:
            self.entries.remove(best)
            self.kv.release(best.key)
            src.unpark()
            src.rewind(best_len, at)
            return PrefixHit(src, best_len, snaps, None)
        state = src.clone(best_len, at, capacity=capacity)
        best.used = next(self._clock)
        if src.rewinds_from_snapshots and best_len == src.length:  # the entry's own end, resumable later too (its
            snaps[best_len] = src.windows()  # parked parts are host tensors that are never written: `unpark` copies)
        self.counters["shared"] += 1
        return PrefixHit(state, best_len, snaps, best.key)

    def evict(self) -> bool:
        """Free the least recently used entry and its reservation; False if there is none."""
        if not self.entries:
            return False
        self._drop(min(self.entries, key=lambda e: e.used))
        self.counters["evicted"] += 1
        return True

    def _drop(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        self.kv.release(entry.key)
        entry.state.free()

    def clear(self) -> None:
        while self.evict():
            pass

    def held(self) -> int:
        """KV tokens the entries hold in the budget."""
        return sum(self.kv.reserved(e.key) for e in self.entries)

    def stats(self) -> dict:
        return {**self.counters, "entries": len(self.entries), "tokens": sum(len(e.tokens) for e in self.entries),
                "kv_tokens_held": self.held(), "snapshots": sum(len(e.snapshots) for e in self.entries)}


def _supersedes(tokens: np.ndarray, snapshots: dict, state: SequenceState, entry: _Entry) -> bool:
    """Whether a state that consumed `tokens` (with `snapshots`) serves every prompt `entry` serves, as far: the
    entry's tokens start `tokens`, and a model that rewinds from snapshots can resume at the entry's length and at
    each of its snapshots' lengths."""
    n = len(entry.tokens)
    if n > len(tokens) or not np.array_equal(entry.tokens, tokens[:n]):
        return False
    if not state.rewinds_from_snapshots:
        return True
    return all(m == len(tokens) or m in snapshots for m in (n, *entry.snapshots))


def _usable(entry: _Entry, prompt: np.ndarray) -> int:
    limit = min(len(entry.tokens), len(prompt) - 1)
    differ = np.flatnonzero(entry.tokens[:limit] != prompt[:limit])
    common = int(differ[0]) if len(differ) else limit
    if not entry.state.rewinds_from_snapshots:
        return common
    exact = [n for n in (len(entry.tokens), *entry.snapshots) if n <= common]
    return max(exact, default=0)
