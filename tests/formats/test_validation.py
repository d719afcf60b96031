"""One malformed fixture per validation rule V1..V22 of specs/ftw.md, each raising its own error class.

Every fixture starts from a valid FTW (`small_ftw`: data-00000.ftd holds `t.f32` at 0, `t.bf16` at 4096 and the
4-expert bank `bank` at 8192 with stride 4096; assets `tokenizer.json` and `plans/tiny.plan`). Manifest edits are
re-packed with a consistent header so that the intended rule, not the manifest checksum (V7), fires.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from ftw_testlib import edit_manifest, patch_bytes, small_ftw, write_manifest

from ft.formats import FtwError, FtwReader
from ft.formats import errors as E
from ft.formats.layout import HEADER_SIZE, MAX_MANIFEST_BYTES, Header


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_ftw(tmp_path_factory.mktemp("base") / "m")


@pytest.fixture()
def ftw(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "m"))


def reject(d: Path, cls: type[FtwError], *words: str, file: str = "model.ftw") -> FtwError:
    """FtwReader(d) raises exactly `cls`; the message names `file`, the rule id and every word in `words`."""
    with pytest.raises(FtwError) as info:
        FtwReader(d)
    err = info.value
    assert type(err) is cls, f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    msg = str(err)
    assert Path(err.where).name == file and msg.startswith(err.where), msg
    assert f"{cls.rule} {cls.title}" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return err


def tensor(m: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in m["tensors"] if t["name"] == name)


def component(m: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in m["expert_banks"][0]["components"] if c["name"] == name)


def set_key(path: tuple, value: Any) -> Callable[[dict], None]:
    """An edit that sets manifest[path...] = value (path items: keys, list indexes, or tensor names)."""
    def fn(m: dict) -> None:
        node = m
        for k in path[:-1]:
            node = tensor(m, k) if k in ("t.f32", "t.bf16") and node is m else node[k]
        node[path[-1]] = value
    return fn


def pack_header(d: Path, **fields: Any) -> None:
    raw = (d / "model.ftw").read_bytes()
    _, h = Header.unpack(raw)
    vals = dict(major=h.major, minor=h.minor, header_size=h.header_size, manifest_offset=h.manifest_offset,
                manifest_nbytes=h.manifest_nbytes, manifest_xxh3=h.manifest_xxh3, reserved=h.reserved)
    vals.update(fields)
    (d / "model.ftw").write_bytes(Header(**vals).pack() + raw[HEADER_SIZE:])


# -- V1 missing file ---------------------------------------------------------------------------

@pytest.mark.parametrize("victim", ["model.ftw", "data-00000.ftd", "tokenizer.json", "plans/tiny.plan"])
def test_V1_missing_file(ftw: Path, victim: str) -> None:
    (ftw / victim).unlink()
    reject(ftw, E.FtwNotFoundError, "missing", file=Path(victim).name)


def test_V1_missing_directory(tmp_path: Path) -> None:
    reject(tmp_path / "nope", E.FtwNotFoundError, "not a directory", file="nope")


# -- V2..V8: the index file -------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 10, HEADER_SIZE - 1])
def test_V2_truncated_header(ftw: Path, size: int) -> None:
    p = ftw / "model.ftw"
    p.write_bytes(p.read_bytes()[:size])
    reject(ftw, E.FtwTruncatedError, f"{size} bytes", "header alone is 64")


@pytest.mark.parametrize("delta", [-100, 1])
def test_V2_index_size_disagrees_with_header(ftw: Path, delta: int) -> None:
    p = ftw / "model.ftw"
    raw = p.read_bytes()
    p.write_bytes(raw[:delta] if delta < 0 else raw + b" " * delta)
    reject(ftw, E.FtwTruncatedError, f"file is {len(raw) + delta} bytes", f"header says {len(raw)}")


@pytest.mark.parametrize("magic", [b"GGUF\x03\x00\x00\x00", b"FTW\x00\n\x1a\n\x00", b"ftw\x00\r\n\x1a\n"])
def test_V3_bad_magic(ftw: Path, magic: bytes) -> None:
    patch_bytes(ftw / "model.ftw", 0, magic)
    reject(ftw, E.FtwMagicError, "expected 46 54 57 00 0d 0a 1a 0a", magic[:4].hex(" "))


def test_V4_unsupported_header_major(ftw: Path) -> None:
    pack_header(ftw, major=2)
    reject(ftw, E.FtwVersionError, "format version 2.0", "supports 1.x")


@pytest.mark.parametrize("version", [[2, 0], [1, 1]])
def test_V4_manifest_version_disagrees_with_header(ftw: Path, version: list[int]) -> None:
    edit_manifest(ftw, set_key(("version",), version))
    reject(ftw, E.FtwVersionError, f"manifest version {version}", "header 1.0")


@pytest.mark.parametrize("fields,word", [({"header_size": 128}, "header_size=128"),
                                         ({"manifest_offset": 72}, "manifest_offset=72"),
                                         ({"reserved": b"\x00" * 23 + b"\x01"}, "reserved=non-zero")])
def test_V5_bad_header_fields(ftw: Path, fields: dict, word: str) -> None:
    pack_header(ftw, **fields)
    reject(ftw, E.FtwHeaderError, word)


def test_V6_manifest_too_large(ftw: Path) -> None:
    pack_header(ftw, manifest_nbytes=MAX_MANIFEST_BYTES + 1)  # the file itself stays small: refused before reading
    reject(ftw, E.FtwManifestTooLargeError, str(MAX_MANIFEST_BYTES + 1), f"limit {MAX_MANIFEST_BYTES}")


def test_V7_manifest_checksum(ftw: Path) -> None:
    p = ftw / "model.ftw"
    raw = p.read_bytes()
    p.write_bytes(raw.replace(b'"t.f32"', b'"t.f33"'))  # same size, header not re-packed
    reject(ftw, E.FtwManifestChecksumError, "do not match the header checksum")


@pytest.mark.parametrize("body,word", [(b"{not json", "Expecting property name"),
                                       (b'{"a":1,"a":2}', "duplicate key"),
                                       (b"[1, 2]", "not a JSON object"),
                                       (b'{"x": "\xff"}', "utf-8"),
                                       (b'{"x": NaN}', "NaN is not valid JSON")])
def test_V8_manifest_parse(ftw: Path, body: bytes, word: str) -> None:
    write_manifest(ftw, None, raw=body)
    reject(ftw, E.FtwManifestParseError, word)


# -- V9..V17, V19: the manifest ---------------------------------------------------------------

def _drop(key: str) -> Callable[[dict], None]:
    return lambda m: m.pop(key)


@pytest.mark.parametrize("edit,word", [
    (_drop("metadata"), "manifest lacks keys ['metadata']"),
    (set_key(("extra",), 1), "manifest has unknown keys ['extra']"),
    (set_key(("tensors",), {}), "key 'tensors' must be a list"),
    (set_key(("format",), "gguf"), "format must be 'ftw'"),
    (set_key(("alignment",), 32), "alignment must be 4096"),
    (set_key(("checksum",), "sha256"), "checksum must be 'xxh3_64'"),
    (set_key(("requires",), [{}]), "requires must list feature names"),
    (set_key(("t.f32", "xxh3"), "ABC"), "xxh3 must be 16 lowercase hex digits"),
    (set_key(("t.f32", "name"), ""), "bad tensor name ''"),
    (set_key(("t.f32", "offset"), 4096.0), "offset/nbytes must be integers"),
    (set_key(("t.f32", "bogus"), 0), "tensor record has unknown keys ['bogus']"),
    (set_key(("quant", "linears"), []), "quant.linears must be an object"),
    (lambda m: m["quant"].pop("source"), "quant lacks keys ['source']"),
    (lambda m: component(m, "s").update(name=["s"]), "component name ['s']"),
    (lambda m: m["expert_banks"][0]["xxh3"].pop(), "one 16-hex-digit checksum per expert"),
])
def test_V9_manifest_schema(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwSchemaError, word)


def test_V10_unknown_required_feature(ftw: Path) -> None:
    edit_manifest(ftw, set_key(("requires",), ["zstd-frames"]))
    reject(ftw, E.FtwFeatureError, "['zstd-frames']")


@pytest.mark.parametrize("edit,word", [
    (lambda m: m["files"][0].update(name="../data-00000.ftd"), "'../data-00000.ftd' is not a plain name"),
    (lambda m: m["files"][0].update(name="/etc/passwd"), "'/etc/passwd' is not a plain name"),
    (lambda m: m["files"][0].update(name="data-00001.ftd"), "must be named 'data-00000.ftd'"),
    (lambda m: m["assets"][0].update(name="../tokenizer.json"), "'../tokenizer.json' is not a plain name"),
    (lambda m: m["assets"][0].update(name="sub/tokenizer.json"), "'sub/tokenizer.json' is not a plain name"),
    (lambda m: m["assets"][0].update(name="tokenizer.json\n"), "is not a plain name"),
    (lambda m: m["assets"][0].update(name="model.ftw"), "'model.ftw' is reserved"),
    (lambda m: m["assets"][0].update(name="data-00003.ftd"), "'data-00003.ftd' is reserved"),
    (lambda m: m["plans"][0].update(name="tiny.plan"), "'tiny.plan' is not a plain name under plans/"),
    (lambda m: m["plans"][0].update(name="plans/../x"), "is not a plain name under plans/"),
    (lambda m: m["kernels"].append(m["plans"][0]), "'plans/tiny.plan' is not a plain name under kernels/"),
])
def test_V11_unsafe_path(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwPathError, word)


@pytest.mark.parametrize("victim", ["data-00000.ftd", "tokenizer.json", "plans/tiny.plan"])
def test_V11_a_symbolic_link_is_refused(ftw: Path, tmp_path: Path, victim: str) -> None:
    # the same bytes, outside the directory: the link is refused whatever it points at
    outside = tmp_path / "elsewhere"
    shutil.copyfile(ftw / victim, outside)
    (ftw / victim).unlink()
    (ftw / victim).symlink_to(outside)
    reject(ftw, E.FtwPathError, "symbolic link", file=Path(victim).name)


def test_V11_a_linked_slot_directory_is_refused(ftw: Path, tmp_path: Path) -> None:
    shutil.move(ftw / "plans", tmp_path / "plans")
    (ftw / "plans").symlink_to(tmp_path / "plans", target_is_directory=True)
    reject(ftw, E.FtwPathError, "outside the FTW directory", file="tiny.plan")


@pytest.mark.parametrize("key,name", [("file", "/etc/passwd"), ("file", "../../tokenizer.json"),
                                      ("chat_template", "missing.jinja"), ("file", 7)])
def test_V9_tokenizer_names_a_listed_asset(ftw: Path, key: str, name: Any) -> None:
    edit_manifest(ftw, lambda m: m["tokenizer"].update({key: name}))
    reject(ftw, E.FtwSchemaError, f"tokenizer.{key} {name!r} names no listed asset")


@pytest.mark.parametrize("edit,word", [
    (set_key(("t.f32", "dtype"), "F64"), "dtype 'F64' not in"),
    (set_key(("t.f32", "dtype"), ["F32"]), "dtype ['F32'] not in"),
    (lambda m: m["expert_banks"][0].update(scheme="int4"), "scheme 'int4' not in"),
    (lambda m: component(m, "w").update(dtype="Q4_K"), "bank.w: dtype 'Q4_K' not in"),
    (set_key(("quant", "linears"), {"layers.0.self_attn.o_proj": "awq"}), "scheme 'awq' not in"),
    (set_key(("quant", "experts"), "gptq"), "quant.experts: scheme 'gptq' not in"),
])
def test_V12_unknown_dtype_or_scheme(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwDtypeError, word)


@pytest.mark.parametrize("edit,word", [
    (set_key(("t.f32", "nbytes"), 64), "tensor t.f32: nbytes 64 != F32 x [3, 5] = 60"),
    (set_key(("t.f32", "shape"), [-3, 5]), "non-negative integers, got [-3, 5]"),
    (set_key(("t.f32", "shape"), ["3", 5]), "non-negative integers"),
    (lambda m: m["expert_banks"][0].update(num_experts=0, xxh3=[]), "num_experts must be positive"),
    (lambda m: component(m, "s").update(nbytes=31), "bank bank.s: nbytes 31 != F32 x [8]"),
])
def test_V13_shape_mismatch(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwShapeError, word)


@pytest.mark.parametrize("edit,word", [
    (set_key(("t.f32", "offset"), 100), "offset 100 is not a multiple of 4096"),
    (lambda m: m["expert_banks"][0].update(stride=2048), "stride 2048 must be positive multiples of 4096"),
    (lambda m: m["expert_banks"][0].update(offset=8192 + 256), "offset 8448"),
    (lambda m: component(m, "s").update(offset=200), "bank.s: offset 200 is not a multiple of 256"),
    (lambda m: m["files"][0].update(nbytes=24577), "size 24577 is not a multiple of 4096"),
])
def test_V14_misaligned(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwAlignmentError, word)


@pytest.mark.parametrize("edit,word", [
    (set_key(("t.f32", "offset"), 1 << 40), "exceed data-00000.ftd size 24576"),
    (set_key(("t.f32", "file"), 1), "file index 1 out of range"),
    # A huge shape passes the nbytes rule but is refused by the range check before anything is allocated.
    (lambda m: tensor(m, "t.f32").update(shape=[2**62], nbytes=2**64), f"bytes [0, {2**64}) exceed"),
    (lambda m: m["expert_banks"][0].update(num_experts=5, xxh3=["0" * 16] * 5), "bank: bytes [8192, 28672)"),
    (lambda m: component(m, "s").update(offset=3840, shape=[72], nbytes=288), "ends at 4128, past the record stride"),
])
def test_V15_out_of_range(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwRangeError, word)


@pytest.mark.parametrize("edit,word", [
    (set_key(("t.bf16", "offset"), 0), "t.bf16 and t.f32 overlap in data-00000.ftd"),
    (lambda m: m["expert_banks"][0].update(offset=4096), "t.bf16 and bank overlap"),
    (lambda m: component(m, "s").update(offset=0), "components s and w overlap"),
])
def test_V16_overlap(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwOverlapError, word)


@pytest.mark.parametrize("edit,word", [
    (set_key(("t.bf16", "name"), "t.f32"), "name 't.f32' appears twice"),
    (lambda m: m["expert_banks"][0].update(name="t.bf16"), "name 't.bf16' appears twice"),
    (lambda m: m["assets"].append(dict(m["assets"][0])), "asset 'tokenizer.json' appears twice"),
    (lambda m: component(m, "s").update(name="w", offset=256), "duplicate component names"),
])
def test_V17_duplicate_name(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwDuplicateError, word)


@pytest.mark.parametrize("victim,new_size", [("data-00000.ftd", 24576 - 4096), ("data-00000.ftd", 24576 + 1),
                                             ("tokenizer.json", 19)])
def test_V18_file_size(ftw: Path, victim: str, new_size: int) -> None:
    p = ftw / victim
    raw = p.read_bytes()
    p.write_bytes(raw[:new_size] + bytes(max(0, new_size - len(raw))))
    reject(ftw, E.FtwFileSizeError, f"{new_size} bytes on disk, manifest says {len(raw)}", file=victim)


@pytest.mark.parametrize("edit,word", [
    (set_key(("config", "family"), "llama"), "unknown family 'llama'"),
    (set_key(("config", "use_sliding_window"), True), "unknown config keys ['use_sliding_window']"),
    (lambda m: m["config"].pop("rope_theta"), "missing config keys ['rope_theta']"),
    (set_key(("config", "num_kv_heads"), 3), "num_heads 4 is not a multiple of num_kv_heads 3"),
    (set_key(("config", "hidden_size"), True), "config key hidden_size has the wrong type"),
])
def test_V19_model_config(ftw: Path, edit: Callable, word: str) -> None:
    edit_manifest(ftw, edit)
    reject(ftw, E.FtwConfigError, word)


# -- V20, V21: content (lazy, and in verify) --------------------------------------------------

def _only(failures: list[FtwError], cls: type[FtwError], *words: str) -> None:
    assert len(failures) == 1 and type(failures[0]) is cls, failures
    assert Path(failures[0].where).name in ("data-00000.ftd", "tokenizer.json")
    for w in words:
        assert w in str(failures[0]), str(failures[0])


def test_V20_tensor_checksum_lazy_and_verify(ftw: Path) -> None:
    patch_bytes(ftw / "data-00000.ftd", 7, b"\x55")  # inside t.f32
    r = FtwReader(ftw)  # content is not read at open
    assert r.tensor("t.bf16").numel() == 7
    with pytest.raises(E.FtwChecksumError, match=r"data-00000\.ftd: V20 checksum mismatch: tensor t\.f32: xxh3 "):
        r.tensor("t.f32")
    _only(r.verify(), E.FtwChecksumError, "tensor t.f32")
    assert FtwReader(ftw, checksums="off").tensor("t.f32").shape == (3, 5)


def test_V20_expert_checksum_covers_inter_component_padding(ftw: Path) -> None:
    patch_bytes(ftw / "data-00000.ftd", 8192 + 2 * 4096 + 200, b"\x01")  # expert 2: between w (ends 128) and s (256)
    r = FtwReader(ftw)
    b = r.bank("bank")
    assert b.expert(1, "w").shape == (8, 4)
    with pytest.raises(E.FtwChecksumError, match="bank bank expert 2"):
        b.expert(2, "s")
    with pytest.raises(E.FtwChecksumError, match="bank bank expert 2"):
        b.record(2)
    _only(r.verify(), E.FtwChecksumError, "bank bank expert 2")


def test_V20_asset_checksum(ftw: Path) -> None:
    patch_bytes(ftw / "tokenizer.json", 0, b"[")
    r = FtwReader(ftw)
    with pytest.raises(E.FtwChecksumError, match=r"tokenizer\.json: V20 checksum mismatch"):
        r.asset("tokenizer.json")
    _only(r.verify(), E.FtwChecksumError, "xxh3")


# gaps after t.f32 and t.bf16; the unused tail of expert record 1; the last byte of the file (record 3's tail)
@pytest.mark.parametrize("offset", [100, 4200, 8192 + 4096 + 1000, 24575])
def test_V21_non_zero_padding(ftw: Path, offset: int) -> None:
    patch_bytes(ftw / "data-00000.ftd", offset, b"\x01")
    r = FtwReader(ftw)
    assert r.tensor("t.f32").shape == (3, 5) and r.bank("bank").expert(1, "s").shape == (8,)
    _only(r.verify(), E.FtwPaddingError, f"padding byte at offset {offset} is not zero")


def test_V22_kernels_entry_that_is_not_a_container(ftw: Path) -> None:
    from ft.formats.slots import update_slot

    update_slot(ftw, "kernels", {"junk.ftk": b"FTKERNEL but not really a container"})
    failures = FtwReader(ftw).verify()  # its digest matches the manifest: only the structure is wrong
    assert len(failures) == 1 and type(failures[0]) is E.FtwKernelsError, failures
    assert str(failures[0]).startswith(f"{ftw / 'kernels/junk.ftk'}: V22 kernels entry: ")


# -- V23: placement plans (verify, and whoever reads a plan; more in test_plan_format.py) ------------------

def test_V23_bad_plan(ftw: Path) -> None:
    from ft.formats.plan import read_plan
    from ft.formats.slots import put_entry

    put_entry(ftw, "plans", "gpu.json", b'{"format": "ft-plan", "version": 2}')
    r = FtwReader(ftw)  # plans are not read at open
    with pytest.raises(E.FtwPlanError, match=r"gpu\.json: V23 bad plan: plan version 2; this reader knows version 1"):
        read_plan(r, "gpu")
    failures = r.verify()
    assert len(failures) == 1 and type(failures[0]) is E.FtwPlanError and Path(failures[0].where).name == "gpu.json"
    assert FtwReader(ftw).tensor("t.f32").shape == (3, 5)  # the weights stay readable


def test_every_rule_has_its_own_class_and_a_fixture() -> None:
    assert [c.rule for c in E.ALL_ERRORS] == [f"V{i}" for i in range(1, 24)]
    assert len({c.__name__ for c in E.ALL_ERRORS}) == 23
    assert all(getattr(E, c.__name__) is c and issubclass(c, ValueError) for c in E.ALL_ERRORS)
    tests = [n for n in dir(sys.modules[__name__]) if n.startswith("test_V")]
    for c in E.ALL_ERRORS:
        assert any(n.startswith(f"test_{c.rule}_") for n in tests), f"no fixture for {c.rule}"


def test_changed_reports_a_data_file_truncated_replaced_or_removed(ftw: Path) -> None:
    r = FtwReader(ftw)
    assert r.changed() is None
    data = ftw / "data-00000.ftd"
    raw = data.read_bytes()
    with open(data, "r+b") as f:
        f.truncate(4096)
    assert f"{len(raw)} -> 4096 bytes" in r.changed() and "data-00000.ftd" in r.changed()
    data.unlink()
    assert "removed" in r.changed()
    data.write_bytes(raw)  # the same bytes in a new file
    assert "replaced" in r.changed() or "modified" in r.changed()


def test_parse_index_is_read_index_on_bytes(ftw: Path) -> None:
    """The pure parser (what tools/campaign_fuzz_ftw.py fuzzes) decides exactly as the file reader."""
    from ft.formats.reader import parse_index, read_index

    raw = (ftw / "model.ftw").read_bytes()
    assert parse_index(raw, "mem") == read_index(ftw)
    with pytest.raises(E.FtwTruncatedError, match="header says"):
        parse_index(raw[:-1], "mem")
    with pytest.raises(E.FtwTruncatedError, match="header says"):  # on disk larger than what was read
        parse_index(raw, "mem", file_size=len(raw) + 1)
