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
The cache gives way to running requests: `evict` (least recently used first) frees an entry's reservation, and the
engine calls it whenever an admission or a request's growth does not fit. With a host tier (`host_bytes` > 0: the
entry's rows copied to host memory, its device state freed) the entry stays and still matches prompts; a hit on it
is copied back to the device by `restore` once the request's own KV is reserved (a host-to-device copy instead of a
prefill: an agent switching between conversations that do not all fit in the KV budget resumes each of them). The
host tier drops its least recently used entries when it is full; without one, `evict` drops the entry. Entries on
the device park their recurrent states and rings in host memory (`SequenceState.park`), so they hold device memory
only for the rows the budget counts; an entry's state is never run again, only copied.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ft.runtime.kv import KvBudget
from ft.runtime.state import SequenceState


MAX_SNAPSHOTS = 32  # per kept state: the latest chunk and prompt ends of its conversation (host memory each)
HOST_TIER_MAX = 16 << 30  # the host tier's default size on CUDA: an eighth of MemAvailable, at most this


def prefix_host_bytes(settings) -> int:
    """The host tier's size for `settings` (an EngineSettings): `prefix_cache_host_memory`, else on CUDA an eighth
    of the memory available at start (at most HOST_TIER_MAX), on the CPU 0."""
    if settings.prefix_cache_host_memory is not None:
        return settings.prefix_cache_host_memory
    if not settings.cuda:
        return 0
    from ft.runtime.gpu.pinning import mem_available

    return min(HOST_TIER_MAX, mem_available() // 8)


@dataclass
class PrefixHit:
    state: SequenceState | None  # None: a host-tier entry's, made by `PrefixCache.restore` (its KV reserved first)
    length: int  # tokens of the prompt the state already holds
    snapshots: dict[int, dict]  # the entry's snapshots at lengths <= length, still valid for the prompt
    source: str | None  # the entry copied (`put(..., replaces=source)`); None: the entry's own state, removed
    image: _Image | None = None  # a host-tier entry's parts, for `restore`


@dataclass
class _Image:
    """A state's parts in host memory: `rows` (`SequenceState.rows` at its length) and `windows`."""
    rows: dict[str, torch.Tensor]
    windows: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.rows.values(), *self.windows.values()))


@dataclass
class _Entry:
    key: str
    tokens: np.ndarray  # int64 [state.length]: matched against every prompt in one vectorized pass
    state: SequenceState | None  # None in the host tier: `image` holds it, and no KV reservation
    snapshots: dict[int, dict]  # length -> `SequenceState.snapshot` taken there
    used: int
    rewinds: bool  # `SequenceState.rewinds_from_snapshots`
    image: _Image | None = None

    def parts(self) -> dict[str, torch.Tensor]:
        """Its rows at its length and its windows, on the device or in host memory."""
        if self.state is None:
            return self.image.rows | self.image.windows
        return self.state.rows(len(self.tokens)) | self.state.windows()


@dataclass
class PrefixCache:
    kv: KvBudget
    max_entries: int = 8  # entries on the device (holding KV)
    host_bytes: int = 0  # the host tier's size; 0: evicted entries are dropped
    new_state: Callable[..., SequenceState] | None = None  # `CausalLM.new_state`, for `restore` (host tier only)
    entries: list[_Entry] = field(default_factory=list)
    counters: dict = field(default_factory=lambda: dict.fromkeys(("hits", "shared", "hit_tokens", "misses", "stored",
                                                                    "superseded", "evicted", "spilled", "restored"), 0))

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
        while sum(e.state is not None for e in self.entries) >= self.max_entries and self.evict():
            pass
        key = f"prefix:{next(self._ids)}"
        while not self.kv.try_reserve(key, state.capacity):
            if not self.evict():
                state.free()
                return False
        state.park()
        self.entries.append(_Entry(key, ids, state, snaps, next(self._clock), state.rewinds_from_snapshots))
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
        at = best.snapshots.get(best_len) if best_len != len(best.tokens) else None
        snaps = {n: v for n, v in best.snapshots.items() if n <= best_len}
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += best_len
        best.used = next(self._clock)
        if best.state is None:  # host tier: copied to the device by `restore`, the entry stays where it is
            if best.rewinds and best_len == len(best.tokens):
                snaps[best_len] = best.image.windows  # host tensors that are never written (`restore` copies)
            return PrefixHit(None, best_len, snaps, best.key, _Image(best.image.rows, at or best.image.windows))
        src = best.state
        if not share:
            self.entries.remove(best)
            self.kv.release(best.key)
            src.unpark()
            src.rewind(best_len, at)
            return PrefixHit(src, best_len, snaps, None)
        state = src.clone(best_len, at, capacity=capacity)
        if src.rewinds_from_snapshots and best_len == src.length:  # the entry's own end, resumable later too (its
            snaps[best_len] = src.windows()  # parked parts are host tensors that are never written: `unpark` copies)
        self.counters["shared"] += 1
        return PrefixHit(state, best_len, snaps, best.key)

    def restore(self, hit: PrefixHit, capacity: int) -> SequenceState:
        """A host-tier hit's state on the device: KV buffers of `capacity` rows (at least `hit.length`), its first
        `hit.length` tokens copied from host memory."""
        n = hit.length
        state = self.new_state(max(capacity, n), capacity=max(capacity, n))
        for name, dst in state.rows(n).items():  # each part's first rows hold the first n tokens (causal)
            dst.copy_(hit.image.rows[name][: dst.shape[0]])
        state.restore(hit.image.windows)
        state.length = n
        self.counters["restored"] += 1
        return state

    def evict(self) -> bool:
        """Free the reservation of the least recently used entry on the device: into the host tier if it has room
        (its least recently used entries give way), else dropped. False if no entry holds KV."""
        on_device = [e for e in self.entries if e.state is not None]
        if not on_device:
            return False
        entry = min(on_device, key=lambda e: e.used)
        if not self._spill(entry):
            self._drop(entry)
            self.counters["evicted"] += 1
        return True

    def _spill(self, entry: _Entry) -> bool:
        rows, windows = entry.state.rows(len(entry.tokens)), entry.state.windows()
        size = _Image(rows, windows).nbytes
        if self.new_state is None or size > self.host_bytes:
            return False
        for old in sorted((e for e in self.entries if e.state is None), key=lambda e: e.used):
            if self.host_used() + size <= self.host_bytes:
                break
            self._drop(old)
            self.counters["evicted"] += 1
        entry.image = _Image(*({k: t.to("cpu", copy=True) for k, t in d.items()} for d in (rows, windows)))
        entry.state.free()
        entry.state = None
        self.kv.release(entry.key)
        self.counters["spilled"] += 1
        return True

    def _drop(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        self.kv.release(entry.key)
        if entry.state is not None:
            entry.state.free()

    def clear(self) -> None:
        for entry in list(self.entries):
            self._drop(entry)
            self.counters["evicted"] += 1

    def held(self) -> int:
        """KV tokens the entries hold in the budget."""
        return sum(self.kv.reserved(e.key) for e in self.entries)

    def host_used(self) -> int:
        """Bytes of host memory the host tier's entries hold."""
        return sum(e.image.nbytes for e in self.entries if e.state is None)

    def stats(self) -> dict:
        host = [e for e in self.entries if e.state is None]
        return {**self.counters, "entries": len(self.entries), "tokens": sum(len(e.tokens) for e in self.entries),
                "kv_tokens_held": self.held(), "snapshots": sum(len(e.snapshots) for e in self.entries),
                "host_entries": len(host), "host_bytes": self.host_used()}


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
    if not entry.rewinds:
        return common
    exact = [n for n in (len(entry.tokens), *entry.snapshots) if n <= common]
    return max(exact, default=0)
