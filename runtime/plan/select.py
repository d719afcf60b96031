"""Which placement an engine starts with: the FTW's plan for this machine, or one planned at start (not written).

`choose_placement` runs when the engine knows its VRAM budget, before the weights load:
  * `--plan none`: no placement (the scheduler starts cold, KV from the budget);
  * `--plan NAME`: that plan (refused if missing or invalid); a machine it was not made for is said in the log;
  * default: the plans that match this machine (`machine.mismatch`), the one whose budget is closest first; a plan
    that cannot be read is skipped with a warning. None matching: planned at start from the routing of the FTW's
    first plan that has routing counts (same model, another machine), else the uniform prior; nothing is written.
`Placement.preload` turns it into the experts the slot pool is filled with and the cache's routing priors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ft.formats import FtwError, FtwReader
from ft.formats.plan import Plan, plan_names, read_plan

from .machine import mismatch, this_machine
from .routing import RoutingProfile, preload_order, shares

log = logging.getLogger("ft.plan")


@dataclass(frozen=True)
class Placement:
    plan: str | None  # the plan's name; None when planned at start
    note: str  # what the engine logs
    routing: RoutingProfile
    resident: tuple[tuple[int, int], ...]  # the plan's preload list (planned at start: empty, from `routing`)
    kv_tokens: int | None
    prefill_chunk: int | None
    predicted_decode_tok_s: float | None

    def preload(self, moe_layers: list[int], num_experts: int, num_slots: int, *, num_layers: int
                ) -> tuple[list[tuple[int, int]], np.ndarray | None]:
        """(the first `num_slots` (layer, expert) to upload, routing priors [num_layers, E] or None): the plan's
        list, continued (when the engine has more slots than the plan) in the order its routing implies."""
        order = [(moe_layers[i], int(e)) for i, e in
                 preload_order(shares(self.routing.counts, len(moe_layers), num_experts))]
        seen = set(self.resident)
        pairs = [*self.resident, *(p for p in order if p not in seen)][:num_slots]
        priors = None
        if self.routing.counts is not None:
            priors = np.zeros((num_layers, num_experts))
            priors[moe_layers] = self.routing.counts
        return pairs, priors

    def stats(self) -> dict:
        return {"plan": self.plan, "note": self.note, "routing": self.routing.source,
                "predicted_decode_tok_s": self.predicted_decode_tok_s}


def from_plan(p: Plan, note: str) -> Placement:
    counts = None if p.routing.counts is None else np.asarray(p.routing.counts, np.int64)
    routing = RoutingProfile(p.routing.source, p.routing.detail, p.routing.tokens, counts)
    return Placement(p.name, note, routing, p.resident, p.vram.kv_tokens, p.prefill_chunk,
                     p.prediction.decode_tok_s)


def choose_placement(reader: FtwReader, choice: str | None, device: torch.device, budget: int) -> Placement | None:
    """See the module docstring. Raises ValueError for a named plan that is missing, FtwError for one invalid."""
    if choice == "none":
        return None
    here = this_machine(device)
    if choice is not None:
        try:
            p = read_plan(reader, choice)
        except KeyError as e:
            raise ValueError(str(e).strip('"')) from None
        why = mismatch(p, here, budget)
        return from_plan(p, f"placement plan {p.name} (as asked" + (f"; made for {why})" if why else ")")
                         + _predicted(p))
    readable, matching, reasons = [], [], []
    for name in plan_names(reader):
        try:
            p = read_plan(reader, name)
        except FtwError as e:
            log.warning("placement plan %s skipped: %s", name, e)
            reasons.append(f"{name}: unreadable")
            continue
        readable.append(p)
        why = mismatch(p, here, budget)
        if why is None:
            matching.append(p)
        else:
            reasons.append(f"{name}: {why}")
    if matching:
        p = min(matching, key=lambda p: (abs(p.vram.budget - budget), p.name))
        return from_plan(p, f"placement plan {p.name} (made for this machine: {p.machine.gpu}, VRAM budget "
                            f"{p.vram.budget / 2**30:.2f} GiB){_predicted(p)}")
    counted = next((p for p in readable if p.routing.counts is not None), None)
    routing = RoutingProfile.uniform("no plan of this FTW has routing counts") if counted is None else \
        from_plan(counted, "").routing
    none = "; ".join(reasons) if reasons else "the FTW has none"
    return Placement(None, f"no placement plan matches this machine ({none}); planned at start from "
                           f"{routing.source} routing, not written (`ft plan --ftw DIR` writes one)",
                     routing, (), None, None, None)


def _predicted(p: Plan) -> str:
    return f"; predicted decode {p.prediction.decode_tok_s:.1f} tok/s"
