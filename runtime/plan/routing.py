"""Routing profiles: how often each expert of each MoE layer is routed to, and the resident set they imply.

A profile comes from calibration (`calibrate.py`), from a routing-count file a server wrote at shutdown
(`--save-routing FILE`, format below), or is the uniform prior. The resident set of S slots is the S experts with
the largest routing share (an expert's share of its layer's routed pairs), across all layers: each layer sees k pairs
per token, so this maximises the expected hits per token. Ties (the uniform prior) go round-robin over layers, so a
truncated list stays balanced. A layer's expected hit rate is the share of its resident experts, measured on counts
the choice did not see (`held_out_hit_rates`): the share of a set picked from the same counts overstates it (with
uniform routing and 512 calibration tokens, 0.41 predicted where 0.23 was measured on the H200).

Routing-count file (JSON, UTF-8; written to a temporary name, fsynced, renamed):

    {"format": "ft-routing", "version": 1, "model_key": "<16 hex: ft.formats.plan.model_key>",
     "num_experts": E, "moe_layers": [...], "tokens": [tokens seen per MoE layer], "counts": [[pairs per expert]...]}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ft.formats.slots import write_atomic

log = logging.getLogger("ft.plan")
ROUTING_FORMAT = "ft-routing"
ROUTING_VERSION = 1


@dataclass(frozen=True)
class RoutingProfile:
    source: str  # "calibration", "trace" or "uniform" (ft.formats.plan.ROUTING_SOURCES)
    detail: str
    tokens: int
    counts: np.ndarray | None  # int64 [MoE layers, E]; None for the uniform prior

    @staticmethod
    def uniform(why: str) -> "RoutingProfile":
        return RoutingProfile("uniform", why, 0, None)


def shares(counts: np.ndarray | None, moe_layers: int, num_experts: int) -> np.ndarray:
    """float64 [moe_layers, E]: each expert's share of its layer's routed pairs (a row without counts: uniform)."""
    if counts is None:
        return np.full((moe_layers, num_experts), 1.0 / num_experts)
    c = np.asarray(counts, np.float64)
    rows = c.sum(1, keepdims=True)
    return np.where(rows > 0, c / np.maximum(rows, 1e-300), 1.0 / num_experts)


def preload_order(share: np.ndarray) -> np.ndarray:
    """int64 [moe_layers * E, 2] (MoE layer index, expert), largest share first; ties by rank within the layer, then
    by layer (round-robin), then by expert id."""
    n_layers, n_exp = share.shape
    rank = np.empty_like(share, dtype=np.int64)
    by_share = np.argsort(-share, axis=1, kind="stable")
    rank[np.arange(n_layers)[:, None], by_share] = np.arange(n_exp)[None, :]
    layer = np.repeat(np.arange(n_layers), n_exp)
    expert = np.tile(np.arange(n_exp), n_layers)
    order = np.lexsort((expert, layer, rank.ravel(), -share.ravel()))
    return np.stack([layer[order], expert[order]], 1)


def hit_rates(share: np.ndarray, order: np.ndarray, slots: int) -> list[float]:
    """Expected hit rate per MoE layer when the first `slots` entries of `order` are resident."""
    chosen = order[:max(0, slots)]
    hits = np.zeros(share.shape[0])
    np.add.at(hits, chosen[:, 0], share[chosen[:, 0], chosen[:, 1]])
    return [float(min(1.0, h)) for h in hits]


def held_out(counts: np.ndarray | None, num_experts: int, moe_layers: int,
             seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(share, order) to estimate hit rates with out of sample: each count is split in two by binomial thinning (for
    multinomial or Poisson counts, two independent samples of half the tokens); `order` ranks the experts on one half,
    `share` is the other half's. Deterministic (seeded); a slight underestimate for the set chosen on all counts. The
    uniform prior needs no split. `hit_rates(share, order, slots)` then gives the expected hit rate per layer."""
    if counts is None:
        share = shares(None, moe_layers, num_experts)
        return share, preload_order(share)
    c = np.asarray(counts, np.int64)
    pick = np.random.default_rng(seed).binomial(c, 0.5)
    return shares(c - pick, moe_layers, num_experts), preload_order(shares(pick, moe_layers, num_experts))


def held_out_hit_rates(counts: np.ndarray | None, slots: int, num_experts: int, moe_layers: int,
                       seed: int = 0) -> list[float]:
    """Expected hit rate per MoE layer of the `slots` experts with the largest counts, estimated out of sample
    (`held_out`)."""
    return hit_rates(*held_out(counts, num_experts, moe_layers, seed), slots)


# ---- the routing-count file ----------------------------------------------------------------------------------------
def save_counts(path: str | Path, *, key: str, moe_layers: list[int], counts: np.ndarray,
                tokens: np.ndarray) -> Path:
    """Write a routing-count file atomically. counts [MoE layers, E], tokens [MoE layers] (whole numbers)."""
    path = Path(path)
    obj = {"format": ROUTING_FORMAT, "version": ROUTING_VERSION, "model_key": key,
           "num_experts": int(counts.shape[1]), "moe_layers": [int(x) for x in moe_layers],
           "tokens": [int(round(t)) for t in tokens], "counts": np.rint(counts).astype(np.int64).tolist()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(obj, separators=(",", ":")) + "\n").encode())
    return path


def save_engine_counts(path: str | Path, reader, experts) -> Path | None:
    """`--save-routing`: the expert cache's counts seen while serving (priors left out), for this model; logs and
    returns None when there is nothing to write or the file cannot be written (a shutdown does not fail for it)."""
    from ft.formats.plan import model_key

    cache = getattr(experts, "cache", None)
    if cache is None:
        log.warning("--save-routing %s: no expert cache (the routed experts ran on the CPU): nothing written", path)
        return None
    if callable(getattr(experts, "settle", None)):
        experts.settle()  # mode mapped: routing still on its way back is counted first
    counts, tokens = cache.observed()
    moe = list(experts.moe_layers)
    if not counts[moe].sum():
        log.warning("--save-routing %s: no routing was counted (resident layers keep their routing on the device): "
                    "nothing written", path)
        return None
    try:
        out = save_counts(path, key=model_key(reader.records), moe_layers=moe, counts=counts[moe],
                          tokens=tokens[moe])
    except OSError as e:
        log.error("--save-routing %s: not written: %s", path, e)
        return None
    log.info("routing counts of %d tokens written to %s (`ft plan --routing %s`)", int(tokens[moe].max(initial=0)),
             out, out)
    return out


def load_counts(path: str | Path, *, key: str, moe_layers: list[int], num_experts: int) -> RoutingProfile:
    """Read a routing-count file for the model with `key`; ValueError naming the file and the problem otherwise."""
    path = Path(path)

    def need(cond: bool, detail: str) -> None:
        if not cond:
            raise ValueError(f"{path}: not a usable routing-count file: {detail}")

    try:
        obj = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read a routing-count file: {str(e)[:200]}") from None
    need(isinstance(obj, dict), "not a JSON object")
    need(obj.get("format") == ROUTING_FORMAT, f"format {obj.get('format')!r}, expected {ROUTING_FORMAT!r}")
    need(obj.get("version") == ROUTING_VERSION, f"version {obj.get('version')!r}; this reader knows "
                                                f"{ROUTING_VERSION}")
    want = {"format", "version", "model_key", "num_experts", "moe_layers", "tokens", "counts"}
    need(set(obj) == want, f"keys {sorted(obj)}, expected {sorted(want)}")
    need(obj["model_key"] == key, f"written for another model (key {obj['model_key']!r}, this FTW's is {key})")
    need(obj["moe_layers"] == list(moe_layers) and obj["num_experts"] == num_experts,
         f"MoE layers / experts {obj['moe_layers']} / {obj['num_experts']} differ from the model's")

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62

    rows, toks = obj["counts"], obj["tokens"]
    need(isinstance(rows, list) and len(rows) == len(moe_layers) and all(
        isinstance(r, list) and len(r) == num_experts and all(whole(v) for v in r) for r in rows),
        f"counts must be [{len(moe_layers)}][{num_experts}] non-negative integers")
    need(isinstance(toks, list) and len(toks) == len(moe_layers) and all(whole(t) for t in toks),
         "tokens must list a non-negative integer per MoE layer")
    counts = np.asarray(rows, np.int64)
    need(bool(counts.sum()), "it counts no routed pairs at all")
    return RoutingProfile("trace", f"routing counts of {path.name} ({max(toks)} tokens)", int(max(toks)), counts)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")
