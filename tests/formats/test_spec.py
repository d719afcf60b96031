"""specs/ftw.md and specs/ftw.schema.json agree with the code: the writer's manifests validate against the schema,
the schema refuses what the reader refuses per value, and the spec's tables list exactly the code's ids and rules."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
import torch
from ftw_testlib import finish, moe_config, read_manifest, small_ftw, worked_example

from ft.formats import FtwWriter, ModelConfig
from ft.formats import errors as E
from ft.formats.config import FAMILIES
from ft.formats.dtypes import DTYPE_IDS, DTYPES, SCHEMES
from ft.formats.layout import ALIGN, COMPONENT_ALIGN, HEADER_SIZE, MAGIC, MAX_MANIFEST_BYTES
from ft.formats.manifest import REQUIRED_KEYS

SPECS = Path(__file__).resolve().parents[2] / "specs"
SCHEMA = json.loads((SPECS / "ftw.schema.json").read_text(encoding="utf-8"))
SPEC = (SPECS / "ftw.md").read_text(encoding="utf-8")
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def nvfp4_ftw(out: Path) -> Path:
    """A bank-heavy FTW: an nvfp4 expert bank, an fp8_row linear, assets with a chat template, full sections."""
    H, I, E_ = 32, 16, 2
    w = FtwWriter(out)
    w.add_tensor("embed_tokens.weight", torch.zeros(64, H, dtype=torch.bfloat16))
    w.add_tensor("layers.0.self_attn.o_proj.weight", torch.zeros(H, H, dtype=torch.float8_e4m3fn))
    w.add_tensor("layers.0.self_attn.o_proj.weight_scale", torch.ones(H))
    comps = {"gate_up": (torch.uint8, (2 * I, H // 2)), "gate_up_scale": (torch.float8_e4m3fn, (2 * I, H // 16)),
             "gate_up_scale_2": (torch.float32, (2 * I,)), "down": (torch.uint8, (H, I // 2)),
             "down_scale": (torch.float8_e4m3fn, (H, I // 16)), "down_scale_2": (torch.float32, (H,))}
    bank = w.add_expert_bank("layers.0.mlp.experts", "nvfp4", E_, comps)
    for e in range(E_):
        bank.write_expert(e, {k: torch.zeros(s, dtype=dt) for k, (dt, s) in comps.items()})
    w.add_asset("tokenizer.json", b"{}")
    w.add_asset("chat_template.jinja", "{{ messages }} \u00e9".encode())
    return finish(w, moe_config(num_experts=E_, num_experts_per_tok=1),
                  quant={"linears": {"layers.0.self_attn.o_proj": "fp8_row"}, "experts": "nvfp4",
                         "source": {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}},
                  tokenizer={"file": "tokenizer.json", "chat_template": "chat_template.jinja", "bos_token": None,
                             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                             "special_tokens": {"<|im_end|>": 2}},
                  generation={"temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_ids": [2]},
                  provenance={"source": "org/model", "revision": "0" * 40, "files": {"config.json": "a" * 64},
                              "compiler": "ft 0.1.0"},
                  metadata={"architectures": ["Qwen3MoeForCausalLM"]})


@pytest.mark.parametrize("build", [worked_example, small_ftw, nvfp4_ftw])
def test_writer_output_validates_against_the_schema(tmp_path: Path, build: Callable[[Path], Path]) -> None:
    VALIDATOR.validate(read_manifest(build(tmp_path / "m")))


def _tensor0(m: dict) -> dict:
    return m["tensors"][0]


@pytest.mark.parametrize("edit", [
    lambda m: m.update(extra=1),
    lambda m: m.pop("plans"),
    lambda m: m.update(version=[2, 0]),
    lambda m: m.update(requires=["zstd"]),
    lambda m: _tensor0(m).update(dtype="F64"),
    lambda m: _tensor0(m).update(offset=100),
    lambda m: _tensor0(m).update(shape=[-1]),
    lambda m: _tensor0(m).update(xxh3="XYZ"),
    lambda m: m["files"][0].update(name="../data-00000.ftd"),
    lambda m: m["files"][0].update(nbytes=100),
    lambda m: m["assets"][0].update(name="model.ftw"),
    lambda m: m["assets"][0].update(name="a/b.json"),
    lambda m: m["plans"][0].update(name="kernels/x"),
    lambda m: m["expert_banks"][0].update(stride=0),
    lambda m: m["expert_banks"][0]["components"][0].update(offset=128),
    lambda m: m["quant"].update(experts="int4"),
    lambda m: m["config"].update(family="llama"),
    lambda m: m["config"].update(use_sliding_window=True),
    lambda m: m["config"].update(sliding_window=-1),
    lambda m: m["config"].update(hidden_size=True),
])
def test_schema_refuses_what_the_reader_refuses(tmp_path: Path, edit: Callable[[dict], Any]) -> None:
    m = copy.deepcopy(read_manifest(small_ftw(tmp_path / "m")))
    edit(m)
    assert not VALIDATOR.is_valid(m)


def test_schema_tables_match_the_code() -> None:
    assert SCHEMA["required"] == list(REQUIRED_KEYS)
    defs = SCHEMA["$defs"]
    assert defs["dtype"]["enum"] == list(DTYPES) and defs["scheme"]["enum"] == list(SCHEMES)
    assert defs["config"]["required"] == [f.name for f in fields(ModelConfig) if f.default is MISSING]
    assert list(defs["config"]["properties"]) == [f.name for f in fields(ModelConfig)]
    for f in fields(ModelConfig):
        if f.default is not MISSING:
            want = list(f.default) if isinstance(f.default, tuple) else f.default  # JSON has lists
            assert defs["config"]["properties"][f.name]["default"] == want, f.name
    assert defs["config"]["properties"]["family"]["enum"] == list(FAMILIES)
    assert defs["aligned"]["multipleOf"] == ALIGN
    assert defs["component"]["properties"]["offset"]["multipleOf"] == COMPONENT_ALIGN


def _table_rows(first_cell: str) -> list[list[str]]:
    """Markdown table rows whose first cell matches `first_cell` (a regex), split into stripped cells."""
    rows = []
    for line in SPEC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(first_cell, cells[0]):
            rows.append(cells)
    return rows


def test_spec_type_tables_match_the_code() -> None:
    dtype_rows = [r for r in _table_rows(r"\d+") if r[1].strip("`") in DTYPES]
    assert {r[1].strip("`"): (int(r[0]), int(r[2])) for r in dtype_rows} == {
        n: (DTYPE_IDS[n], size) for n, (_, size) in DTYPES.items()}
    scheme_rows = [r for r in _table_rows(r"\d+") if r[1].strip("`") in SCHEMES or r[2] in ("defined", "reserved")]
    assert {r[1].strip("`"): int(r[0]) for r in scheme_rows} == SCHEMES


def test_spec_rule_table_names_every_error_class() -> None:
    rows = {r[0]: r for r in _table_rows(r"V\d+")}
    assert list(rows) == [c.rule for c in E.ALL_ERRORS]
    for c in E.ALL_ERRORS:
        assert rows[c.rule][1] == f"`{c.__name__}`" and getattr(E, c.__name__) is c
        assert f"{c.rule} {c.title}:" in rows[c.rule][4], rows[c.rule][4]  # the example message has the real title


def test_spec_header_constants_match_the_code() -> None:
    assert " ".join(f"{b:02X}" for b in MAGIC) in SPEC
    header = {r[3].strip("`"): (int(r[0]), int(r[1])) for r in _table_rows(r"\d+") if len(r) == 5 and r[2] != ""
              and r[3].startswith("`")}
    assert header == {"magic": (0, 8), "major": (8, 2), "minor": (10, 2), "header_size": (12, 4),
                      "manifest_offset": (16, 8), "manifest_nbytes": (24, 8), "manifest_xxh3": (32, 8),
                      "reserved": (40, 24)}
    assert sum(size for _, size in header.values()) == HEADER_SIZE
    assert f"{MAX_MANIFEST_BYTES:,}".replace(",", " ") in SPEC and "align(x) = ceil(x / 4096) · 4096" in SPEC
