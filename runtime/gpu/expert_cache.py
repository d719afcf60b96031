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

    # ---- queries ----------------------------------------------------------------------------------------
    def lookup(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Slots of `experts` at `layer` (-1 for misses)."""
        return self.slot_of[layer, np.asarray(experts, np.int64)]

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

    def touch(self, slots: np.ndarray) -> None:
        """Mark slots as used now and protect them until the clock moves."""
        s = np.asarray(slots, np.int64)
        s = s[s >= 0]
        self.last_use[s] = self.clock
        self.protect_until[s] = self.clock

    def _scores(self) -> np.ndarray:
        # larger = evict first; empty slots first of all
        score = -self.last_use.astype(np.float64)
        live = self.owner >= 0
        if self.policy == "lru-freq":
            ids = self.owner[live]
            lay, exp = ids // self.E, ids % self.E
            f = self.counts[lay, exp] / np.maximum(self.tokens[lay], 1.0)
            gap = self.num_moe_layers / np.maximum(f, 1e-6)  # layer visits until its next expected use
            score[live] = gap - self.last_use[live]  # age + expected gap: LRU when all gaps are equal
        score[~live] = np.inf
        score[self.protect_until >= self.clock] = -np.inf
        return score

    def victim(self) -> int:
        """Slot to (re)use next, or -1 when every slot is protected."""
        if self.S == 0:
            return -1
        score = self._scores()
        s = int(np.argmax(score))
        return -1 if score[s] == -np.inf else s

    def admit(self, layer: int, expert: int) -> tuple[int, int]:
        """Give (layer, expert) a slot. Returns (slot, evicted flat id or -1); slot -1 when nothing can be evicted."""
        if self.slot_of[layer, expert] >= 0:
            raise ValueError(f"expert {expert} of layer {layer} is already resident")
        s = self.victim()
        if s < 0:
            return -1, -1
        old = int(self.owner[s])
        if old >= 0:
            self.slot_of[old // self.E, old % self.E] = -1
        self.owner[s] = layer * self.E + expert
        self.slot_of[layer, expert] = s
        self.last_use[s] = self.clock
        self.protect_until[s] = self.clock
        self.version += 1
        return s, old

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
