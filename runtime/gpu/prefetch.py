"""Next-layer expert prediction: apply layer l+1's router to layer l's MoE input.

The residual stream changes little from one layer to the next, so the experts that layer l+1's router picks for
layer l's (normalised) hidden state are a good guess of what it will pick one layer later; fetching them while
layer l+1's attention runs turns some misses into hits. The guess costs one [T, H] x [H, E] product and a top-k.
Accounting: every prefetched expert is later found used (a prefetch hit) or unused (wasted bytes).
"""

from __future__ import annotations

import numpy as np
import torch


class NextLayerPredictor:
    def __init__(self, routers: dict[int, torch.Tensor], moe_layers: list[int], top_k: int):
        self.routers = routers  # layer -> router weight [E, H] on the compute device
        self.next_of = {a: b for a, b in zip(moe_layers, moe_layers[1:])}
        self.top_k = top_k
        self.pending: dict[int, set[int]] = {}  # layer -> experts prefetched for it, not yet checked
        self.issued = 0
        self.hits = 0
        self.wasted = 0
        self.predicted = 0
        self.correct = 0  # predicted (resident or not) and then really routed

    def next_layer(self, layer: int) -> int | None:
        return self.next_of.get(layer)

    def predict_ids(self, layer: int, x: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """(next MoE layer, its top-k expert ids for x: int64 [T*k] on x's device, no host sync), or None."""
        nxt = self.next_of.get(layer)
        if nxt is None:
            return None
        logits = x @ self.routers[nxt].to(x.dtype).T  # [T, E]
        return nxt, torch.topk(logits.float(), self.top_k, dim=-1).indices.reshape(-1)

    def rank(self, nxt: int, ids: np.ndarray) -> np.ndarray:
        """Predicted experts of layer `nxt` from host ids, most popular first (recorded for precision stats)."""
        uniq, counts = np.unique(ids, return_counts=True)
        pred = uniq[np.argsort(-counts, kind="stable")]
        self._last_prediction = (nxt, set(pred.tolist()))
        return pred

    def predict(self, layer: int, x: torch.Tensor) -> tuple[int, np.ndarray] | None:
        """Experts the next MoE layer will probably route x to, most popular first (None at the last layer)."""
        p = self.predict_ids(layer, x)
        return None if p is None else (p[0], self.rank(p[0], p[1].cpu().numpy()))

    def issued_for(self, layer: int, experts: list[int]) -> None:
        self.pending.setdefault(layer, set()).update(experts)
        self.issued += len(experts)

    def check(self, layer: int, used: np.ndarray) -> None:
        """Called when `layer` runs with its real routing."""
        used_set = set(np.asarray(used).tolist())
        fetched = self.pending.pop(layer, set())
        self.hits += len(fetched & used_set)
        self.wasted += len(fetched - used_set)
        last = getattr(self, "_last_prediction", None)
        if last is not None and last[0] == layer:
            self.predicted += len(last[1])
            self.correct += len(last[1] & used_set)
            self._last_prediction = None

    def stats(self) -> dict:
        return {
            "prefetch_issued": self.issued,
            "prefetch_hits": self.hits,
            "prefetch_wasted": self.wasted,
            "prefetch_precision": self.correct / self.predicted if self.predicted else None,
        }


def prefetch_next(ex, nxt: int, experts: np.ndarray, victims: np.ndarray) -> None:
    """Admit and upload up to `ex.prefetch_max` of layer `nxt`'s predicted `experts` that are not
    resident, into `victims` (slots the current call's scoring pass chose after its own fetches)."""
    experts = np.asarray(experts, np.int64)
    missing = experts[ex.cache.slot_of[nxt, experts] < 0][:ex.prefetch_max]
    slots, _ = ex.cache.admit_many(nxt, missing, victims)
    issued = [e for e, s in zip(missing.tolist(), slots.tolist()) if s >= 0]  # a -1 means the pool is all busy
    for e, s in zip(issued, slots.tolist()):
        ex.uploader.upload(s, ex.banks[nxt].record(e))
    ex.predictor.issued_for(nxt, issued)
    ex.counters["bytes_h2d"] += len(issued) * ex.layout.stride
