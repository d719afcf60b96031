"""Structural validation of the FTW manifest (rules V9..V17, V19 of specs/ftw.md).

`parse_manifest` turns the decoded JSON object into typed records or raises the rule's error. It
touches only the manifest, so its cost is proportional to the header, not to the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import errors as E
from .config import ModelConfig
from .dtypes import DTYPES, SCHEMES, nbytes_of
from .layout import ALIGN, CHECKSUM, COMPONENT_ALIGN, VERSION_MAJOR, data_file_name, is_reserved_name, is_safe_name

REQUIRED_KEYS = ("format", "version", "alignment", "checksum", "requires", "files", "tensors",
                 "expert_banks", "assets", "config", "quant", "tokenizer", "generation",
                 "provenance", "plans", "kernels", "metadata")
KNOWN_FEATURES: frozenset[str] = frozenset()  # v1.0 readers know no optional features yet


@dataclass(frozen=True)
class FileRecord:
    name: str
    nbytes: int


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: int
    offset: int
    nbytes: int
    xxh3: str


@dataclass(frozen=True)
class Component:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # inside one expert record
    nbytes: int


@dataclass(frozen=True)
class BankRecord:
    name: str
    scheme: str
    file: int
    offset: int
    num_experts: int
    stride: int
    components: tuple[Component, ...]
    xxh3: tuple[str, ...]  # one per expert record (its first `used_bytes`)

    @property
    def nbytes(self) -> int:
        return self.num_experts * self.stride

    @property
    def used_bytes(self) -> int:
        """Bytes of one record that hold data; the rest up to `stride` is zero padding."""
        return max(c.offset + c.nbytes for c in self.components)


@dataclass(frozen=True)
class AssetRecord:
    name: str
    nbytes: int
    xxh3: str


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileRecord, ...]
    tensors: dict[str, TensorRecord]
    banks: dict[str, BankRecord]
    assets: dict[str, AssetRecord]
    slots: dict[str, tuple[AssetRecord, ...]]  # "plans" / "kernels" entries, names under that dir
    config: ModelConfig
    raw: dict[str, Any]


def _need(cond: bool, err: type[E.FtwError], where: str, detail: str) -> None:
    if not cond:
        raise err(where, detail)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _dtype(v: Any) -> bool:
    return isinstance(v, str) and v in DTYPES  # (a JSON list or object is unhashable: test the type first)


def _scheme(v: Any) -> bool:
    return isinstance(v, str) and v in SCHEMES


def _hex(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 16 and all(c in "0123456789abcdef" for c in v)


def _shape(v: Any, where: str, what: str) -> tuple[int, ...]:
    _need(isinstance(v, list) and all(_int(x) for x in v), E.FtwShapeError, where,
          f"{what}: shape must be a list of non-negative integers, got {v!r}")
    return tuple(v)


def _obj(m: dict, key: str, where: str, typ: type) -> Any:
    v = m[key]
    _need(isinstance(v, typ), E.FtwSchemaError, where, f"key {key!r} must be a {typ.__name__}")
    return v


def _keys(d: Any, required: tuple[str, ...], where: str, what: str) -> None:
    _need(isinstance(d, dict), E.FtwSchemaError, where, f"{what} must be an object")
    missing = [k for k in required if k not in d]
    unknown = sorted(set(d) - set(required))
    _need(not missing, E.FtwSchemaError, where, f"{what} lacks keys {missing}")
    _need(not unknown, E.FtwSchemaError, where, f"{what} has unknown keys {unknown}")


def parse_manifest(m: Any, where: str) -> Manifest:
    _keys(m, REQUIRED_KEYS, where, "manifest")
    _need(m["format"] == "ftw", E.FtwSchemaError, where, f"format must be 'ftw', got {m['format']!r}")
    ver = m["version"]
    _need(isinstance(ver, list) and len(ver) == 2 and all(_int(x) for x in ver), E.FtwSchemaError,
          where, "version must be [major, minor]")
    _need(ver[0] == VERSION_MAJOR, E.FtwVersionError, where, f"manifest version {ver}, reader knows {VERSION_MAJOR}.x")
    _need(_int(m["alignment"]) and m["alignment"] == ALIGN, E.FtwSchemaError, where, f"alignment must be {ALIGN}")
    _need(m["checksum"] == CHECKSUM, E.FtwSchemaError, where, f"checksum must be {CHECKSUM!r}")
    req = _obj(m, "requires", where, list)
    _need(all(isinstance(f, str) for f in req), E.FtwSchemaError, where, "requires must list feature names (strings)")
    unknown = [f for f in req if f not in KNOWN_FEATURES]
    _need(not unknown, E.FtwFeatureError, where, f"requires features {unknown}; this reader supports none beyond v1.0")
    for key in ("config", "quant", "tokenizer", "generation", "provenance", "metadata"):
        _obj(m, key, where, dict)
    _quant(m["quant"], where)

    files = tuple(_file(f, i, where) for i, f in enumerate(_obj(m, "files", where, list)))
    names: set[str] = set()
    tensors: dict[str, TensorRecord] = {}
    for t in _obj(m, "tensors", where, list):
        rec = _tensor(t, where, len(files))
        _need(rec.name not in names, E.FtwDuplicateError, where, f"name {rec.name!r} appears twice")
        names.add(rec.name)
        tensors[rec.name] = rec
    banks: dict[str, BankRecord] = {}
    for b in _obj(m, "expert_banks", where, list):
        rec = _bank(b, where, len(files))
        _need(rec.name not in names, E.FtwDuplicateError, where, f"name {rec.name!r} appears twice")
        names.add(rec.name)
        banks[rec.name] = rec
    assets = _assets(_obj(m, "assets", where, list), where, slot=None)
    for key in ("file", "chat_template"):  # the tokenizer's side files: assets of this FTW, nothing else
        ref = m["tokenizer"].get(key)
        _need(ref is None or (isinstance(ref, str) and ref in assets), E.FtwSchemaError, where,
              f"tokenizer.{key} {ref!r} names no listed asset")
    slots = {s: tuple(_assets(_obj(m, s, where, list), where, slot=s).values()) for s in ("plans", "kernels")}
    _check_regions(files, tensors, banks, where)
    try:
        config = ModelConfig.from_dict(m["config"])
    except ValueError as e:
        raise E.FtwConfigError(where, str(e)) from None
    return Manifest(files, tensors, banks, assets, slots, config, m)


def _quant(q: dict, where: str) -> None:
    _keys(q, ("linears", "experts", "source"), where, "quant")
    _need(isinstance(q["linears"], dict), E.FtwSchemaError, where, "quant.linears must be an object")
    for module, scheme in q["linears"].items():
        _need(_scheme(scheme), E.FtwDtypeError, where,
              f"quant.linears[{module!r}]: scheme {scheme!r} not in {sorted(SCHEMES)}")
    _need(q["experts"] is None or _scheme(q["experts"]), E.FtwDtypeError, where,
          f"quant.experts: scheme {q['experts']!r} not in {sorted(SCHEMES)} (or null)")
    _need(q["source"] is None or isinstance(q["source"], dict), E.FtwSchemaError, where,
          "quant.source must be an object or null")


def _file(f: Any, idx: int, where: str) -> FileRecord:
    _keys(f, ("name", "nbytes"), where, "file record")
    _need(is_safe_name(f["name"]), E.FtwPathError, where, f"data file name {f['name']!r} is not a plain name")
    _need(f["name"] == data_file_name(idx), E.FtwPathError, where,
          f"data file {idx} must be named {data_file_name(idx)!r}, got {f['name']!r}")
    _need(_int(f["nbytes"]) and f["nbytes"] % ALIGN == 0, E.FtwAlignmentError, where,
          f"data file {f['name']} size {f['nbytes']!r} is not a multiple of {ALIGN}")
    return FileRecord(f["name"], f["nbytes"])


def _tensor(t: Any, where: str, num_files: int) -> TensorRecord:
    _keys(t, ("name", "dtype", "shape", "file", "offset", "nbytes", "xxh3"), where, "tensor record")
    name = t["name"]
    _need(isinstance(name, str) and 0 < len(name) <= 256, E.FtwSchemaError, where, f"bad tensor name {name!r}")
    _need(_dtype(t["dtype"]), E.FtwDtypeError, where, f"tensor {name}: dtype {t['dtype']!r} not in {sorted(DTYPES)}")
    shape = _shape(t["shape"], where, f"tensor {name}")
    _need(_int(t["file"]) and t["file"] < num_files, E.FtwRangeError, where,
          f"tensor {name}: file index {t['file']!r} out of range")
    _need(_int(t["offset"]) and _int(t["nbytes"]), E.FtwSchemaError, where,
          f"tensor {name}: offset/nbytes must be integers")
    _need(t["offset"] % ALIGN == 0, E.FtwAlignmentError, where,
          f"tensor {name}: offset {t['offset']} is not a multiple of {ALIGN}")
    _need(nbytes_of(t["dtype"], shape) == t["nbytes"], E.FtwShapeError, where,
          f"tensor {name}: nbytes {t['nbytes']} != {t['dtype']} x {list(shape)} = {nbytes_of(t['dtype'], shape)}")
    _need(_hex(t["xxh3"]), E.FtwSchemaError, where, f"tensor {name}: xxh3 must be 16 lowercase hex digits")
    return TensorRecord(name, t["dtype"], shape, t["file"], t["offset"], t["nbytes"], t["xxh3"])


def _bank(b: Any, where: str, num_files: int) -> BankRecord:
    _keys(b, ("name", "scheme", "file", "offset", "num_experts", "stride", "components", "xxh3"), where, "expert bank")
    name = b["name"]
    _need(isinstance(name, str) and 0 < len(name) <= 256, E.FtwSchemaError, where, f"bad bank name {name!r}")
    _need(_scheme(b["scheme"]), E.FtwDtypeError, where, f"bank {name}: scheme {b['scheme']!r} not in {sorted(SCHEMES)}")
    for k in ("file", "offset", "num_experts", "stride"):
        _need(_int(b[k]), E.FtwSchemaError, where, f"bank {name}: {k} must be a non-negative integer")
    _need(b["file"] < num_files, E.FtwRangeError, where, f"bank {name}: file index {b['file']} out of range")
    _need(b["num_experts"] > 0, E.FtwShapeError, where, f"bank {name}: num_experts must be positive")
    _need(b["offset"] % ALIGN == 0 and b["stride"] % ALIGN == 0 and b["stride"] > 0, E.FtwAlignmentError,
          where, f"bank {name}: offset {b['offset']} and stride {b['stride']} must be positive multiples of {ALIGN}")
    comps = []
    _need(isinstance(b["components"], list) and b["components"], E.FtwSchemaError, where,
          f"bank {name}: components must be a non-empty list")
    for c in b["components"]:
        _keys(c, ("name", "dtype", "shape", "offset", "nbytes"), where, f"bank {name} component")
        cname = c["name"]
        _need(isinstance(cname, str) and 0 < len(cname) <= 64, E.FtwSchemaError, where,
              f"bank {name}: component name {cname!r} must be a string of 1..64 characters")
        _need(_dtype(c["dtype"]), E.FtwDtypeError, where,
              f"bank {name}.{cname}: dtype {c['dtype']!r} not in {sorted(DTYPES)}")
        shape = _shape(c["shape"], where, f"bank {name}.{cname}")
        _need(_int(c["offset"]) and c["offset"] % COMPONENT_ALIGN == 0, E.FtwAlignmentError, where,
              f"bank {name}.{cname}: offset {c['offset']!r} is not a multiple of {COMPONENT_ALIGN}")
        _need(_int(c["nbytes"]) and nbytes_of(c["dtype"], shape) == c["nbytes"], E.FtwShapeError, where,
              f"bank {name}.{cname}: nbytes {c['nbytes']!r} != {c['dtype']} x {list(shape)}")
        _need(c["offset"] + c["nbytes"] <= b["stride"], E.FtwRangeError, where,
              f"bank {name}.{cname}: ends at {c['offset'] + c['nbytes']}, past the record stride {b['stride']}")
        comps.append(Component(cname, c["dtype"], shape, c["offset"], c["nbytes"]))
    spans = sorted((c.offset, c.offset + c.nbytes, c.name) for c in comps)
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        _need(e0 <= s1, E.FtwOverlapError, where, f"bank {name}: components {n0} and {n1} overlap")
    _need(len({c.name for c in comps}) == len(comps), E.FtwDuplicateError, where,
          f"bank {name}: duplicate component names")
    sums = b["xxh3"]
    _need(isinstance(sums, list) and len(sums) == b["num_experts"] and all(_hex(s) for s in sums), E.FtwSchemaError,
          where, f"bank {name}: xxh3 must list one 16-hex-digit checksum per expert")
    return BankRecord(name, b["scheme"], b["file"], b["offset"], b["num_experts"], b["stride"],
                      tuple(comps), tuple(sums))


def _assets(items: list, where: str, slot: str | None) -> dict[str, AssetRecord]:
    out: dict[str, AssetRecord] = {}
    for a in items:
        _keys(a, ("name", "nbytes", "xxh3"), where, f"{slot or 'asset'} record")
        name = a["name"]
        ok = is_safe_name(name, allow_slot_dir=True) and (name.startswith(f"{slot}/") if slot else "/" not in name)
        _need(ok, E.FtwPathError, where,
              f"{slot or 'asset'} name {name!r} is not a plain name" + (f" under {slot}/" if slot else ""))
        _need(slot is not None or not is_reserved_name(name), E.FtwPathError, where,
              f"asset name {name!r} is reserved (the index, a data file or a slot directory)")
        _need(_int(a["nbytes"]), E.FtwSchemaError, where, f"asset {name}: nbytes must be an integer")
        _need(_hex(a["xxh3"]), E.FtwSchemaError, where, f"asset {name}: xxh3 must be 16 lowercase hex digits")
        _need(name not in out, E.FtwDuplicateError, where, f"asset {name!r} appears twice")
        out[name] = AssetRecord(name, a["nbytes"], a["xxh3"])
    return out


def _check_regions(files, tensors, banks, where: str) -> None:
    per_file: dict[int, list[tuple[int, int, str]]] = {}
    for t in tensors.values():
        per_file.setdefault(t.file, []).append((t.offset, t.offset + t.nbytes, t.name))
    for b in banks.values():
        per_file.setdefault(b.file, []).append((b.offset, b.offset + b.nbytes, b.name))
    for idx, spans in per_file.items():
        size = files[idx].nbytes
        spans.sort()
        for start, end, name in spans:
            _need(end <= size, E.FtwRangeError, where,
                  f"{name}: bytes [{start}, {end}) exceed {files[idx].name} size {size}")
        for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
            _need(e0 <= s1, E.FtwOverlapError, where, f"{n0} and {n1} overlap in {files[idx].name}")
