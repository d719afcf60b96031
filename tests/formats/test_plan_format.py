"""Placement plans as FTW content (specs/plan.md, specs/ftw.md §5.7, §11): the schema refuses every malformed or
foreign plan with V23, plans are added / replaced / removed without touching data files, atomically, and a crash
leaves a valid FTW."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from ftw_testlib import patch_bytes, small_ftw, worked_example

from ft.formats import FtwReader
from ft.formats import errors as E
from ft.formats import slots
from ft.formats.plan import (Plan, PlanDecodeTerms, PlanMachine, PlanModel, PlanPrediction, PlanRates, PlanRouting,
                             PlanVram, model_key, parse_plan, plan_names, read_plan)

GIB = 1 << 30


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_ftw(tmp_path_factory.mktemp("base") / "m")


@pytest.fixture()
def ftw(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "m"))


def a_plan(d: Path, **changes: Any) -> Plan:
    """A valid plan for the FTW at `d` (small_ftw: one MoE layer of 4 experts, record 4096 bytes)."""
    p = Plan(
        format="ft-plan", version=1, name="gpu",
        model=PlanModel(model_key(FtwReader(d).records), "qwen3_moe", (0,), 4, 1, 4096),
        machine=PlanMachine("NVIDIA Test", 8 * GIB, 64 * GIB, 16 * GIB, True,
                            PlanRates(1e12, 25e9, 22e9, 2e-5, 4e-5, "defaults")),
        vram=PlanVram(budget=GIB, outside=100 << 20, dense=200 << 20, kv_tokens=1024, kv=50 << 20,
                      prefill_buffers=262144, reserve=512 << 20, expert_slots=2, max_slots=4, max_running_requests=4,
                      dense_quantized=False),
        routing=PlanRouting("calibration", "a test", 100, ((10, 5, 1, 0),)),
        resident=((0, 0), (0, 1)), pinned_banks=(0,), lane_only=(), prefill_chunk=4096,
        prediction=PlanPrediction(100.0, 2000.0, 0.9375, (0.9375,), 0.1, 0.05,
                                  PlanDecodeTerms(1e-3, 1e-3, 1e-3, 1e-3, 1e-2), ("a line",),
                                  ((GIB // 2, 50.0, None), (GIB, 100.0, 2000.0))))
    return dataclasses.replace(p, **changes)


def _stat(p: Path) -> tuple[int, int, int]:
    st = p.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def test_a_plan_is_written_read_back_and_verified_without_touching_data_files(ftw: Path) -> None:
    before = _stat(ftw / "data-00000.ftd")
    p = a_plan(ftw)
    slots.put_entry(ftw, "plans", "gpu.json", p.to_json())
    r = FtwReader(ftw)
    assert _stat(ftw / "data-00000.ftd") == before
    assert [a["name"] for a in r.manifest["plans"]] == ["plans/gpu.json", "plans/tiny.plan"]  # sorted by name
    assert plan_names(r) == ["gpu"] and read_plan(r, "gpu") == p  # other plans/ entries are not placement plans
    assert r.verify() == []
    assert not [f for f in (*ftw.iterdir(), *(ftw / "plans").iterdir()) if ".tmp-" in f.name]
    with pytest.raises(KeyError, match="no plan named 'cpu' \\(plans: gpu\\)"):
        read_plan(r, "cpu")


def test_replace_and_remove(ftw: Path) -> None:
    slots.put_entry(ftw, "plans", "gpu.json", a_plan(ftw).to_json())
    newer = a_plan(ftw, prefill_chunk=2048)
    slots.put_entry(ftw, "plans", "gpu.json", newer.to_json())
    r = FtwReader(ftw)
    assert [a["name"] for a in r.manifest["plans"]].count("plans/gpu.json") == 1 and read_plan(r, "gpu") == newer
    assert slots.remove_entry(ftw, "plans", "gpu.json") and not (ftw / "plans" / "gpu.json").exists()
    assert plan_names(FtwReader(ftw)) == [] and not slots.remove_entry(ftw, "plans", "gpu.json")


def test_a_verified_ftw_stays_verified_unless_a_data_file_changed(ftw: Path) -> None:
    r = FtwReader(ftw)
    assert r.verify() == [] and r.write_stamp()
    slots.put_entry(ftw, "plans", "gpu.json", a_plan(ftw).to_json())
    assert FtwReader(ftw).verified  # only the index changed, and it is validated at every open
    os.utime(ftw / "data-00000.ftd", ns=(1, 1))
    slots.put_entry(ftw, "plans", "cpu.json", a_plan(ftw, name="cpu").to_json())
    assert not FtwReader(ftw).verified


def test_an_interrupted_change_leaves_a_valid_ftw(ftw: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def die(*_: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(slots, "_write_index", die)  # killed after the entry's file, before the index
    with pytest.raises(KeyboardInterrupt):
        slots.put_entry(ftw, "plans", "gpu.json", a_plan(ftw).to_json())
    monkeypatch.undo()
    assert (ftw / "plans" / "gpu.json").exists()  # written, but not listed: ignored
    r = FtwReader(ftw)
    assert plan_names(r) == [] and r.verify() == []
    stale = [ftw / ".model.ftw.tmp-999999999", ftw / "plans" / ".gpu.json.tmp-999999999"]  # a writer that died
    for p in stale:
        p.write_bytes(b"half")
    assert FtwReader(ftw).verify() == []
    slots.put_entry(ftw, "plans", "gpu.json", a_plan(ftw).to_json())
    assert not any(p.exists() for p in stale) and plan_names(FtwReader(ftw)) == ["gpu"]


def test_entry_names_are_plain_names_in_a_slot(ftw: Path) -> None:
    for slot, name in (("plans", "../x.json"), ("plans", "a/b.json"), ("assets", "x.json"), ("plans", ".x")):
        with pytest.raises(ValueError, match="is not a slot entry name"):
            slots.put_entry(ftw, slot, name, b"{}")
    assert FtwReader(ftw).verify() == []


def test_a_plan_for_another_model_is_refused(ftw: Path, tmp_path: Path) -> None:
    other = worked_example(tmp_path / "other")
    slots.put_entry(other, "plans", "gpu.json", a_plan(ftw).to_json())
    with pytest.raises(E.FtwPlanError, match="made for another model"):
        read_plan(FtwReader(other), "gpu")
    assert [type(f) for f in FtwReader(other).verify()] == [E.FtwPlanError]


def test_a_tampered_plan_fails_its_checksum(ftw: Path) -> None:
    slots.put_entry(ftw, "plans", "gpu.json", a_plan(ftw).to_json())
    patch_bytes(ftw / "plans" / "gpu.json", 3, b"X")
    r = FtwReader(ftw)
    with pytest.raises(E.FtwChecksumError, match="gpu.json: V20"):
        read_plan(r, "gpu")
    assert [type(f) for f in r.verify()] == [E.FtwChecksumError]


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(obj: dict) -> None:
        *head, last = path.split(".")
        for k in head:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value
    return edit


def _drop(path: str) -> Callable[[dict], None]:
    def edit(obj: dict) -> None:
        *head, last = path.split(".")
        for k in head:
            obj = obj[k]
        del obj[last]
    return edit


@pytest.mark.parametrize("edit,words", [
    (_set("format", "ft-plan-2"), "format 'ft-plan-2'; expected 'ft-plan'"),
    (_set("version", 2), "plan version 2; this reader knows version 1 only"),
    (_set("extra", 1), "plan has unknown keys ['extra']"),
    (_drop("machine"), "plan lacks keys ['machine']"),
    (_set("machine.rates.turbo", 1.0), "plan.machine.rates has unknown keys ['turbo']"),
    (_set("vram.budget", True), "plan.vram.budget must be a non-negative integer, got True"),
    (_set("vram.budget", -1), "plan.vram.budget must be a non-negative integer"),
    (_set("vram.kv_tokens", 1.5), "plan.vram.kv_tokens must be a non-negative integer"),
    (_set("prediction.decode_tok_s", "fast"), "plan.prediction.decode_tok_s must be a finite number"),
    (_set("machine.cpu_lane", 1), "plan.machine.cpu_lane must be true or false"),
    (_set("name", "x" * 5000), "plan.name must be a string of <= 4096 characters"),
    (_set("resident", [[0]]), "plan.resident[0] must have 2 items"),
    (_set("name", "cpu"), "the plan is named 'cpu' but stored as 'gpu'"),
    (_set("name", "../gpu"), "name '../gpu' is not a plain name"),
    (_set("model.key", "0" * 16), "made for another model (model key 0000000000000000"),
    (_set("model.top_k", 5), "need 1 <= top_k <= num_experts"),
    (_set("model.record_bytes", 100), "record_bytes must be a multiple of 4096"),
    (_set("model.moe_layers", [1, 0]), "moe_layers must be increasing"),
    (_set("machine.rates.h2d_pinned", 0), "every rate must be positive"),
    (_set("vram.max_slots", 8), "disagree with the model's 1 x 4 experts"),
    (_set("vram.reserve", 2 * GIB), "more than the budget"),
    (_set("routing.source", "guess"), "routing.source 'guess' not in"),
    (_set("routing.counts", None), "routing.counts is null exactly for source uniform"),
    (_set("routing.counts", [[1, 2, 3]]), "routing.counts must be [1 MoE layers][4 experts]"),
    (_set("resident", [[0, 7]]), "resident names an expert outside the model"),
    (_set("resident", [[3, 0]]), "resident names an expert outside the model"),
    (_set("resident", [[0, 1], [0, 1]]), "resident must list distinct experts"),
    (_set("resident", [[0, 0], [0, 1], [0, 2]]), "at most expert_slots (2)"),
    (_set("lane_only", [0]), "both pinned_banks and lane_only"),
    (_set("pinned_banks", [2]), "pinned_banks must be increasing MoE layer ids"),
    (_set("prefill_chunk", 0), "prefill_chunk must be >= 1"),
    (_set("prediction.hit_rate", 1.5), "hit rates <= 1"),
    (_set("prediction.layer_hit_rates", []), "one per MoE layer"),
    (_set("prediction.curve", [[2, 1.0, None], [1, 2.0, None]]), "budgets must rise"),
])
def test_malformed_plans_are_refused(ftw: Path, edit: Callable[[dict], None], words: str) -> None:
    obj = json.loads(a_plan(ftw).to_json())
    edit(obj)
    key = model_key(FtwReader(ftw).records)
    with pytest.raises(E.FtwPlanError) as info:
        parse_plan(json.dumps(obj).encode(), ftw / "plans" / "gpu.json", name="gpu", key=key)
    assert info.value.rule == "V23" and words in str(info.value), str(info.value)
    assert str(info.value).startswith(str(ftw / "plans" / "gpu.json") + ": V23 bad plan: ")


@pytest.mark.parametrize("data,words", [
    (b"\xff\xfe", "not a UTF-8 JSON object"),
    (b'{"format": "ft-plan", "format": "ft-plan"}', "duplicate key"),
    (b'{"format": "ft-plan", "version": 1, "x": NaN}', "NaN is not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"{}", "format None; expected 'ft-plan'"),
])
def test_plans_that_are_not_json_objects_are_refused(data: bytes, words: str) -> None:
    with pytest.raises(E.FtwPlanError, match="V23 bad plan") as info:
        parse_plan(data, "p.json")
    assert words in str(info.value)


def test_a_plan_too_large_is_refused_unread(ftw: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ft.formats.plan as plan_module

    slots.put_entry(ftw, "plans", "gpu.json", a_plan(ftw).to_json())
    monkeypatch.setattr(plan_module, "MAX_PLAN_BYTES", 1000)
    with pytest.raises(E.FtwPlanError, match="more than a plan may take"):
        read_plan(FtwReader(ftw), "gpu")


def test_a_uniform_plan_has_no_counts(ftw: Path) -> None:
    p = a_plan(ftw, routing=PlanRouting("uniform", "no profile", 0, None))
    assert parse_plan(p.to_json(), "p.json") == p
