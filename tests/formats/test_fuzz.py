"""Property test of the reader: any mutation of a valid FTW either loads or raises FtwError, never anything else.

Mutations are JSON-level edits of the manifest (delete/replace/rename keys, change numbers, types and names; the
header is re-packed so the edit reaches the structural rules) and raw byte edits of the index and data files
(flip, overwrite, truncate, extend). A directory that loads must then serve every tensor and expert or raise
FtwError, and verify() must return FtwErrors only. Sizes in the manifest are bounded (64 MiB) and every offset is
range-checked against the file size before use, so absurd numbers (2**62-element shapes) cannot allocate.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from ftw_testlib import read_manifest, small_ftw, write_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.formats import FtwError, FtwReader

SETTINGS = dict(deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow], derandomize=True)

NUMBERS = st.sampled_from([0, 1, -1, 2, 3, 7, 255, 256, 4095, 4096, 4097, 8192, 24576, 2**31, 2**32, 2**62, 2**63,
                           2**64, 2**100, -2**63]) | st.integers(-10**6, 10**6)
NAMES = st.sampled_from(["", "t.f32", "t.bf16", "bank", "w", "s", "F64", "F8_E4M3", "I64", "nvfp4", "int4", "../x",
                         "/etc/passwd", "data-00000.ftd", "data-00001.ftd", "model.ftw", "plans/x", "plans",
                         "tokenizer.json", "a" * 300, "qwen3_moe", "llama", "zstd", "0123456789abcdef"])
SCALARS = st.none() | st.booleans() | NUMBERS | st.floats(allow_nan=False, allow_infinity=False) | NAMES | st.text(
    max_size=6)
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(NAMES | st.text(max_size=4), c,
                                                                                  max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_ftw(tmp_path_factory.mktemp("fuzz") / "m", shard_bytes=8192)  # two data files


def exercise(d: Path) -> str:
    """Open d and touch everything; only FtwError may escape the reader (the caller checks that)."""
    try:
        r = FtwReader(d)
    except FtwError:
        return "rejected"
    assert r.config.family  # a loaded FTW has a valid config
    for name in r.tensor_names():
        try:
            t = r.tensor(name)
            assert t.numel() * t.element_size() == r.records.tensors[name].nbytes
        except FtwError:
            pass
    for name in r.bank_names():
        b = r.bank(name)
        for c in b.components:
            assert b.stacked(c).shape[0] == b.num_experts
        for e in range(min(b.num_experts, 8)):
            for c in b.components:
                try:
                    b.expert(e, c)
                except FtwError:
                    pass
    for a in r.records.assets:
        try:
            r.asset(a)
        except FtwError:
            pass
    failures = r.verify()
    assert all(isinstance(f, FtwError) for f in failures), failures
    return "loaded"


def nodes(v: Any) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every node below v."""
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, child in items:
        yield v, k
        yield from nodes(child)


def mutate_json(data: st.DataObject, m: dict[str, Any]) -> None:
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        # Pick a key name first, then one node with it: every field kind (dtype, offset, stride, ...) is hit as often
        # as every other, however many records carry it.
        # The 30 config keys share one group so that they do not drown the structural fields.
        groups: dict[str, list[tuple[Any, Any]]] = {}
        for parent, key in nodes(m):
            group = "config.*" if parent is m.get("config") else key if isinstance(key, str) else "[]"
            groups.setdefault(group, []).append((parent, key))
        group = data.draw(st.sampled_from(sorted(groups)), label="key")
        parent, key = data.draw(st.sampled_from(groups[group]), label="where")
        op = data.draw(st.sampled_from(["delete", "replace", "retype", "number", "name", "rename", "duplicate"]),
                       label="op")
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = data.draw(JSON, label="value")
        elif op == "retype":  # same content, another JSON type
            old = parent[key]
            parent[key] = data.draw(st.sampled_from([None, True, 1, 1.5, str(old), [old], {"k": old}, [], {}]),
                                    label="retyped")
        elif op == "number":
            old = parent[key]
            bump = data.draw(NUMBERS, label="number")
            is_num = isinstance(old, int) and not isinstance(old, bool)
            parent[key] = data.draw(st.sampled_from([bump, old + bump if is_num else bump, [bump]]), label="how")
        elif op == "name":
            parent[key] = data.draw(NAMES, label="name")
        elif op == "rename" and isinstance(parent, dict):
            parent[data.draw(NAMES, label="new key")] = parent.pop(key)
        elif op == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        if not m:
            return


@settings(max_examples=130, **SETTINGS)
@given(st.data())
def test_manifest_mutations_load_or_raise_ftw_error(base: Path, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(shutil.copytree(base, Path(tmp) / "m"))
        m = read_manifest(d)
        mutate_json(data, m)
        write_manifest(d, m)
        exercise(d)


@settings(max_examples=70, **SETTINGS)
@given(st.data())
def test_byte_mutations_load_or_raise_ftw_error(base: Path, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(shutil.copytree(base, Path(tmp) / "m"))
        p = d / data.draw(st.sampled_from(["model.ftw", "data-00000.ftd", "data-00001.ftd"]), label="file")
        raw = bytearray(p.read_bytes())
        op = data.draw(st.sampled_from(["flip", "overwrite", "truncate", "extend"]), label="op")
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        if op == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif op == "overwrite":
            chunk = data.draw(st.binary(min_size=1, max_size=64), label="bytes")
            raw[at:at + len(chunk)] = chunk
        elif op == "truncate":
            del raw[at:]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=4096), label="bytes")
        p.write_bytes(bytes(raw))
        exercise(d)


@pytest.mark.parametrize("edit", [
    {"shape": [2**62], "nbytes": 2**64},
    {"shape": [2**31, 2**31, 2**31], "nbytes": 2**95},
    {"offset": 2**63, "shape": [1], "nbytes": 4},
])
def test_absurd_sizes_are_refused_by_range_checks(base: Path, tmp_path: Path, edit: dict) -> None:
    d = Path(shutil.copytree(base, tmp_path / "m"))
    m = read_manifest(d)
    m["tensors"][0].update(edit)
    write_manifest(d, m)
    assert exercise(d) == "rejected"
