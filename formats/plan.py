"""Placement plans: the content of `plans/<name>.json` entries of an FTW (specs/plan.md).

A plan says how one model runs on one machine: the machine it was made for, the VRAM split, which experts start
resident, which banks are page-locked, and the predicted speed with its arithmetic. It is a frozen dataclass tree
(`Plan`), written as compact JSON and validated completely on read: every key present, no unknown key, every value of
its type (integers never booleans, numbers finite and >= 0), then the cross-field rules of specs/plan.md. Anything
else raises `FtwPlanError` (rule V23) naming the file and the first problem; an unknown `format` or `version` is
refused before anything else is read.

Only entries named `plans/<name>.json` are plans in this sense; other names under `plans/` are not defined by this
revision and are left alone (specs/ftw.md §5.7: a reader ignores entries it does not understand).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import errors as E
from .layout import is_safe_name, xxh3_hex

PLAN_FORMAT = "ft-plan"
PLAN_VERSION = 1
SUFFIX = ".json"
ROUTING_SOURCES = ("calibration", "trace", "uniform")
MAX_TEXT = 4096  # characters of any string field
MAX_PLAN_BYTES = 64 << 20  # a plan of the largest models is well under 1 MiB; nothing larger is read


@dataclass(frozen=True)
class PlanModel:
    key: str  # model_key() of the FTW the plan was made for
    family: str
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    record_bytes: int  # expert record stride


@dataclass(frozen=True)
class PlanRates:
    """The machine's rates the prediction used (bytes/s and seconds), and where they came from."""
    hbm_read: float
    h2d_pinned: float  # large copies from page-locked host memory (prefill streaming)
    h2d_expert_pinned: float  # record-sized reads of page-locked host memory (decode misses)
    cpu_fixed_s: float  # the CPU lane's cost per call beyond its experts
    cpu_per_expert_s: float
    source: str


@dataclass(frozen=True)
class PlanMachine:
    gpu: str  # torch's device name; "cpu" for the CPU emulation of the scheduler
    gpu_memory: int  # total device memory (0 on the CPU)
    host_memory: int  # MemTotal
    pinned_memory: int  # host memory the banks may page-lock
    cpu_lane: bool
    rates: PlanRates


@dataclass(frozen=True)
class PlanVram:
    budget: int
    outside: int  # in use at start + kernel modules (ft.runtime.gpu.sizing)
    dense: int
    kv_tokens: int
    kv: int  # KV reserve + per-sequence state of max_running_requests sequences
    prefill_buffers: int
    reserve: int
    expert_slots: int
    max_slots: int
    max_running_requests: int
    dense_quantized: bool


@dataclass(frozen=True)
class PlanRouting:
    source: str  # one of ROUTING_SOURCES
    detail: str
    tokens: int
    counts: tuple[tuple[int, ...], ...] | None  # [MoE layer][expert] routed pairs; None for the uniform prior


@dataclass(frozen=True)
class PlanDecodeTerms:
    """Seconds of one decode step at batch 1 (specs/plan.md, "Speed model")."""
    hbm_s: float
    layers_s: float
    misses_s: float
    overhead_s: float
    step_s: float


@dataclass(frozen=True)
class PlanPrediction:
    decode_tok_s: float
    prefill_tok_s: float | None  # None where the model does not predict prefill (see its arithmetic)
    hit_rate: float
    layer_hit_rates: tuple[float, ...]
    gpu_misses_per_token: float
    cpu_misses_per_token: float
    decode: PlanDecodeTerms
    arithmetic: tuple[str, ...]
    curve: tuple[tuple[int, float, float | None], ...]  # (VRAM budget, decode tok/s, prefill tok/s), budget rising


@dataclass(frozen=True)
class Plan:
    format: str
    version: int
    name: str
    model: PlanModel
    machine: PlanMachine
    vram: PlanVram
    routing: PlanRouting
    resident: tuple[tuple[int, int], ...]  # (layer, expert) in preload order, hottest first
    pinned_banks: tuple[int, ...]
    lane_only: tuple[int, ...]
    prefill_chunk: int
    prediction: PlanPrediction

    def to_json(self) -> bytes:
        body = json.dumps(dataclasses.asdict(self), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return body.encode()

    @property
    def entry(self) -> str:
        return f"plans/{self.name}{SUFFIX}"


# ---- identity of the model ---------------------------------------------------------------------------------------
def model_key(manifest) -> str:
    """xxh3 of what the plan depends on: the config and every tensor's and expert record's digest (not the side
    files, plans or provenance), from an `ft.formats.manifest.Manifest`."""
    ident = [manifest.raw["config"], sorted((t.name, t.xxh3) for t in manifest.tensors.values()),
             sorted((b.name, b.stride, list(b.xxh3)) for b in manifest.banks.values())]
    return xxh3_hex(json.dumps(ident, separators=(",", ":"), sort_keys=True).encode())


# ---- reading ------------------------------------------------------------------------------------------------------
def plan_names(reader) -> list[str]:
    """Names of the plans of an FtwReader (`plans/<name>.json` entries), in manifest order."""
    return [a.name[len("plans/"):-len(SUFFIX)] for a in reader.records.slots["plans"] if a.name.endswith(SUFFIX)]


def read_plan(reader, name: str) -> Plan:
    """The plan `name` of an FtwReader: its digest (V20), then its content (V23), made for this model."""
    entry = f"plans/{name}{SUFFIX}"
    rec = next((a for a in reader.records.slots["plans"] if a.name == entry), None)
    if rec is None:
        have = ", ".join(plan_names(reader)) or "none"
        raise KeyError(f"{reader.path}: no plan named {name!r} (plans: {have})")
    path = reader.path / entry
    if rec.nbytes > MAX_PLAN_BYTES:
        raise E.FtwPlanError(path, f"{rec.nbytes} bytes, more than a plan may take ({MAX_PLAN_BYTES})")
    data = path.read_bytes()
    if xxh3_hex(data) != rec.xxh3:
        raise E.FtwChecksumError(path, f"plan xxh3 {xxh3_hex(data)} != recorded {rec.xxh3}")
    return parse_plan(data, path, name=name, key=model_key(reader.records))


def parse_plan(data: bytes, where: str | Path, *, name: str | None = None, key: str | None = None) -> Plan:
    """Validate plan bytes completely -> Plan (V23 on any problem). `name`: the entry's name the plan must carry;
    `key`: the model_key of the FTW it must have been made for."""
    _need(len(data) <= MAX_PLAN_BYTES, where, f"{len(data)} bytes, more than a plan may take ({MAX_PLAN_BYTES})")
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_no_dup_keys, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise E.FtwPlanError(where, f"not a UTF-8 JSON object: {str(e)[:200]}") from None
    _need(isinstance(obj, dict), where, "not a JSON object")
    _need(obj.get("format") == PLAN_FORMAT, where, f"format {obj.get('format')!r}; expected {PLAN_FORMAT!r}")
    _need(obj.get("version") == PLAN_VERSION, where,
          f"plan version {obj.get('version')!r}; this reader knows version {PLAN_VERSION} only")
    plan = _decode(Plan, obj, "plan", where)
    _check(plan, where, name, key)
    return plan


def _no_dup_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _need(cond: bool, where, detail: str) -> None:
    if not cond:
        raise E.FtwPlanError(where, detail)


def _decode(tp: Any, v: Any, path: str, where) -> Any:
    """A JSON value as type `tp` (a dataclass of this module, int, float, str, bool, tuples, `X | None`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        _need(isinstance(v, dict), where, f"{path} must be an object")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        missing, unknown = [k for k in names if k not in v], sorted(set(v) - set(names))
        _need(not missing, where, f"{path} lacks keys {missing}")
        _need(not unknown, where, f"{path} has unknown keys {unknown}")
        return tp(**{k: _decode(hints[k], v[k], f"{path}.{k}", where) for k in names})
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), v, path, where)
    if origin is tuple:
        _need(isinstance(v, list), where, f"{path} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], x, f"{path}[{i}]", where) for i, x in enumerate(v))
        _need(len(v) == len(args), where, f"{path} must have {len(args)} items")
        return tuple(_decode(a, x, f"{path}[{i}]", where) for i, (a, x) in enumerate(zip(args, v)))
    if tp is bool:
        _need(isinstance(v, bool), where, f"{path} must be true or false")
    elif tp is int:
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, where,
              f"{path} must be a non-negative integer, got {v!r}")
    elif tp is float:
        _need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0, where,
              f"{path} must be a finite number >= 0, got {v!r}")
        v = float(v)
    elif tp is str:
        _need(isinstance(v, str) and len(v) <= MAX_TEXT, where, f"{path} must be a string of <= {MAX_TEXT} characters")
    else:  # pragma: no cover - a field type this decoder does not know is a bug of this module
        raise TypeError(f"{path}: unsupported field type {tp!r}")
    return v


def _increasing(xs: tuple[int, ...]) -> bool:
    return all(a < b for a, b in zip(xs, xs[1:]))


def _check(p: Plan, where, name: str | None, key: str | None) -> None:
    """The cross-field rules of specs/plan.md ("Validation")."""
    m, v, r = p.model, p.vram, p.routing
    _need(is_safe_name(p.name + SUFFIX), where, f"name {p.name!r} is not a plain name")
    _need(name is None or p.name == name, where, f"the plan is named {p.name!r} but stored as {name!r}")
    _need(len(m.key) == 16 and all(c in "0123456789abcdef" for c in m.key), where, "model.key must be 16 hex digits")
    _need(key is None or m.key == key, where,
          f"made for another model (model key {m.key}, this FTW's is {key}); run `ft plan` again for this one")
    _need(bool(m.moe_layers) and _increasing(m.moe_layers), where, "model.moe_layers must be increasing, non-empty")
    _need(m.num_experts >= 1 and 1 <= m.top_k <= m.num_experts, where, "model: need 1 <= top_k <= num_experts")
    _need(m.record_bytes > 0 and m.record_bytes % 4096 == 0, where, "model.record_bytes must be a multiple of 4096")
    rates = p.machine.rates
    _need(min(rates.hbm_read, rates.h2d_pinned, rates.h2d_expert_pinned, rates.cpu_per_expert_s) > 0, where,
          "machine.rates: every rate must be positive")
    _need(v.max_slots == len(m.moe_layers) * m.num_experts and v.expert_slots <= v.max_slots, where,
          f"vram: expert_slots {v.expert_slots} / max_slots {v.max_slots} disagree with the model's "
          f"{len(m.moe_layers)} x {m.num_experts} experts")
    used = v.outside + v.dense + v.kv + v.prefill_buffers + v.reserve + v.expert_slots * m.record_bytes
    _need(used <= v.budget, where, f"vram: the parts take {used} bytes, more than the budget {v.budget}")
    _need(v.kv_tokens >= 1 and v.max_running_requests >= 1, where, "vram: kv_tokens and max_running_requests >= 1")
    _need(r.source in ROUTING_SOURCES, where, f"routing.source {r.source!r} not in {list(ROUTING_SOURCES)}")
    _need((r.counts is None) == (r.source == "uniform"), where, "routing.counts is null exactly for source uniform")
    if r.counts is not None:
        _need(len(r.counts) == len(m.moe_layers) and all(len(row) == m.num_experts for row in r.counts), where,
              f"routing.counts must be [{len(m.moe_layers)} MoE layers][{m.num_experts} experts]")
    layers = set(m.moe_layers)
    _need(all(layer in layers and e < m.num_experts for layer, e in p.resident), where,
          "resident names an expert outside the model")
    _need(len(set(p.resident)) == len(p.resident) and len(p.resident) <= v.expert_slots, where,
          f"resident must list distinct experts, at most expert_slots ({v.expert_slots})")
    for what, xs in (("pinned_banks", p.pinned_banks), ("lane_only", p.lane_only)):
        _need(_increasing(xs) and set(xs) <= layers, where, f"{what} must be increasing MoE layer ids")
    _need(not set(p.pinned_banks) & set(p.lane_only), where, "a bank is both pinned_banks and lane_only")
    _need(p.prefill_chunk >= 1, where, "prefill_chunk must be >= 1")
    pr = p.prediction
    _need(pr.decode_tok_s > 0 and pr.hit_rate <= 1 and all(h <= 1 for h in pr.layer_hit_rates), where,
          "prediction: decode_tok_s > 0 and hit rates <= 1")
    _need(len(pr.layer_hit_rates) == len(m.moe_layers), where, "prediction.layer_hit_rates: one per MoE layer")
    _need(all(a[0] < b[0] for a, b in zip(pr.curve, pr.curve[1:])), where, "prediction.curve: budgets must rise")
