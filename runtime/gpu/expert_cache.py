"""Which experts live in which VRAM slot: the slot table and its replacement policy (host-side bookkeeping).

One pool of S slots is shared by all MoE layers ("unified" scope): an expert id is (layer, expert). The table
`slot_of[L, E]` maps an expert to its slot (-1 = not resident) and `owner[S]` maps back. The clock advances once per
layer call, so "recency" is measured in layer visits.

Replacement ("lru-freq"): evict the resident expert with the largest age + L / f, where age = clock - last use, L the
number of MoE layers and f the expert's routing frequency (pairs routed to it per token at its layer, so L / f is
the expected number of layer visits until its next use), estimated from compile-time priors plus counts seen while
serving. With uniform routing every f is k/E and this is exactly LRU; with skewed routing hot experts survive a
burst of cold ones. `policy="lru"` ignores frequencies.
Slots handed out during the current call are protected from eviction (they are about to be read).

`version` counts changes of `slot_of` (admit, evict); `device_table(device)` returns the device mirror of `slot_of`
(`slot_table.DeviceSlotTable`), which re-uploads itself only when that count moved.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("lru", "lru-freq")


class ExpertCache:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_slots: int,
        *,
        policy: str = "lru-freq",
        priors: np.ndarray | None = None,
        prior_tokens: float = 64.0,
        moe_layers: list[int] | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; supported: {', '.join(POLICIES)}")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.L, self.E, self.S = num_layers, num_experts, num_slots
        self.policy = policy
        self.num_moe_layers = len(moe_layers) if moe_layers is not None else num_layers
        self.slot_of = np.full((num_layers, num_experts), -1, np.int64)
        self.owner = np.full(num_slots, -1, np.int64)  # flat id layer * E + expert
        self.last_use = np.zeros(num_slots, np.int64)
        self.protect_until = np.full(num_slots, -1, np.int64)
        self.clock = 0
        self.version = 0  # bumped on every change of slot_of (the device mirror re-uploads when it moved)
        self._device_tables: dict = {}  # torch.device -> DeviceSlotTable, made on first request
        # routing counts per (layer, expert) and tokens seen per layer; priors count as `prior_tokens` tokens
        self.counts = np.zeros((num_layers, num_experts), np.float64)
        self.tokens = np.zeros(num_layers, np.float64)
        if priors is not None:
            p = np.asarray(priors, np.float64)
            if p.shape != (num_layers, num_experts):
                raise ValueError(f"priors must be [{num_layers}, {num_experts}], got {list(p.shape)}")
            rows = p.sum(1, keepdims=True)
            self.counts += np.where(rows > 0, p / np.maximum(rows, 1e-30), 0.0) * prior_tokens
            self.tokens += np.where(rows[:, 0] > 0, prior_tokens, 0.0)
        self._prior = (self.counts.copy(), self.tokens.copy())  # `observed` leaves them out

    # ---- queries ----------------------------------------------------------------------------------------
    def lookup(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Slots of `experts` at `layer` (-1 for misses)."""
        return self.slot_of[layer, np.asarray(experts, np.int64)]

    def observed(self) -> tuple[np.ndarray, np.ndarray]:
        """(routed pairs [L, E], tokens [L]) seen while serving, without the priors (`--save-routing`)."""
        return self.counts - self._prior[0], self.tokens - self._prior[1]

    def device_table(self, device):
        """The `DeviceSlotTable` mirroring `slot_of` on `device` (one per device, created on first use)."""
        import torch

        from .slot_table import DeviceSlotTable

        dev = torch.device(device)
        if dev not in self._device_tables:
            self._device_tables[dev] = DeviceSlotTable(self, dev)
        return self._device_tables[dev]

    @property
    def num_resident(self) -> int:
        return int((self.owner >= 0).sum())

    def free_slots(self) -> int:
        return int((self.owner < 0).sum())

    # ---- updates ----------------------------------------------------------------------------------------
    def tick(self) -> int:
        """Advance the clock (one layer call); returns the new time."""
        self.clock += 1
        return self.clock

    def observe(self, layer: int, experts: np.ndarray, tokens: int) -> None:
        """Record routing: `experts` (with repeats, one per routed pair) out of `tokens` tokens."""
        np.add.at(self.counts[layer], np.asarray(experts, np.int64), 1.0)
        self.tokens[layer] += tokens

    def observe_flat(self, flat_ids: np.ndarray, layers: np.ndarray, tokens: int) -> None:
        """`observe` for several layer calls at once: `flat_ids` layer * E + expert (with repeats), `layers` the
        distinct layers of the calls, each of `tokens` tokens."""
        np.add.at(self.counts.reshape(-1), np.asarray(flat_ids, np.int64), 1.0)
        self.tokens[np.asarray(layers, np.int64)] += tokens

    def touch(self, slots: np.ndarray) -> None:
        """Mark slots as used now and protect them until the clock moves."""
        s = np.asarray(slots, np.int64)
        s = s[s >= 0]
        self.last_use[s] = self.clock
        self.protect_until[s] = self.clock

    def frequency(self, flat_ids: np.ndarray) -> np.ndarray:
        """Routing frequency of experts given as flat ids layer * E + expert: pairs routed to each per token seen at
        its layer (priors included)."""
        ids = np.asarray(flat_ids, np.int64)
        return self.counts.ravel()[ids] / np.maximum(self.tokens[ids // self.E], 1.0)

    def _scores(self) -> np.ndarray:
        # larger = evict first; empty slots first of all. Computed over all S slots without boolean gathers (the
        # empty ones are overwritten): this runs once per layer call with misses, over thousands of slots.
        live = self.owner >= 0
        if self.policy == "lru-freq":
            f = self.frequency(np.where(live, self.owner, 0))
            gap = self.num_moe_layers / np.maximum(f, 1e-6)  # layer visits until its next expected use
            score = gap - self.last_use  # age + expected gap: LRU when all gaps are equal
        else:
            score = -self.last_use.astype(np.float64)
        score[~live] = np.inf
        score[self.protect_until >= self.clock] = -np.inf
        return score

    def victims(self, n: int) -> np.ndarray:
        """The next `n` slots to (re)use, best first; fewer when the rest are protected. Admitting only protects the
        slot it takes, leaving every other score as it was, so these are the slots n successive admits would take:
        the scores are computed once per call instead of once per admitted expert (O(S) numpy work each)."""
        if self.S == 0 or n <= 0:
            return np.empty(0, np.int64)
        free = np.flatnonzero(self.owner < 0)  # empty slots score +inf (never protected): they go first, in order
        if len(free) >= n:
            return free[:n]
        neg = -self._scores()  # smaller = evict first
        if n == 1:
            order = np.array([np.argmin(neg)])
        else:  # the n best in O(S); among equal scores the lowest slot first, as successive argmins would pick
            n = min(n, self.S)
            kth = np.partition(neg, n - 1)[n - 1]
            better = np.flatnonzero(neg < kth)
            order = np.concatenate([better, np.flatnonzero(neg == kth)[: n - len(better)]])
            order = order[np.lexsort((order, neg[order]))]
        return order[neg[order] < np.inf]

    def admit_many(self, layer: int, experts: np.ndarray, victims: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Give each of `experts` (distinct, none resident) at `layer` a slot, in order. Returns (slots, evicted flat
        ids), both as long as `experts`: slot -1 where nothing could be evicted (every slot protected), evicted -1
        where the slot was empty. `victims`: slots chosen by an earlier `victims()` call of this clock tick with
        nothing admitted since but from its own head (scores of the other slots have not moved, so they are still
        the next best); default: chosen now."""
        experts = np.asarray(experts, np.int64)
        if (self.slot_of[layer, experts] >= 0).any():
            raise ValueError(f"layer {layer}: experts {experts[self.slot_of[layer, experts] >= 0].tolist()} are "
                             "already resident")
        got = self.victims(len(experts)) if victims is None else np.asarray(victims, np.int64)[:len(experts)]
        slots = np.full(len(experts), -1, np.int64)
        evicted = np.full(len(experts), -1, np.int64)
        slots[:len(got)] = got
        evicted[:len(got)] = self.owner[got]
        for e, slot, old in zip(experts[:len(got)].tolist(), got.tolist(), evicted[:len(got)].tolist()):
            if old >= 0:
                self.slot_of[old // self.E, old % self.E] = -1
            self.owner[slot] = layer * self.E + e
            self.slot_of[layer, e] = slot
        self.last_use[got] = self.clock
        self.protect_until[got] = self.clock
        self.version += len(got)
        return slots, evicted

    def admit(self, layer: int, expert: int) -> tuple[int, int]:
        """Give (layer, expert) a slot. Returns (slot, evicted flat id or -1); slot -1 when nothing can be evicted."""
        slots, evicted = self.admit_many(layer, np.array([expert]))
        return int(slots[0]), int(evicted[0])

    def evict(self, slot: int) -> None:
        old = int(self.owner[slot])
        if old >= 0:
            self.slot_of[old // self.E, old % self.E] = -1
        self.owner[slot] = -1
        self.protect_until[slot] = -1
        if old >= 0:
            self.version += 1

    def resident_ids(self) -> np.ndarray:
        return self.owner[self.owner >= 0]


def plan_num_slots(
    vram_budget: int, allocated: int, record_stride: int, *, reserve: int, max_slots: int
) -> int:
    """Slots that fit: (budget - bytes already allocated - reserve for activations/workspace) / stride."""
    free = vram_budget - allocated - reserve
    return int(max(0, min(max_slots, free // record_stride)))
