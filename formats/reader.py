"""FTW reader: validates structure up front, maps data files, hands out zero-copy tensors.

Opening checks V1..V19 using only the index and file sizes (cost proportional to the header).
Content checksums (V20) are checked lazily: a tensor on its first `tensor()` call, an expert record
on its first access; `verify()` checks everything, plus zero padding (V21).
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from . import errors as E
from .config import ModelConfig
from .dtypes import torch_dtype
from .layout import HEADER_SIZE, INDEX_NAME, MAGIC, MAX_MANIFEST_BYTES, VERSION_MAJOR, Header, xxh3_hex
from .manifest import BankRecord, Component, Manifest, parse_manifest


def read_index(path: Path) -> dict[str, Any]:
    """Rules V1..V8: read model.ftw and return the decoded manifest object."""
    index = path / INDEX_NAME
    if not path.is_dir():
        raise E.FtwNotFoundError(path, "not a directory")
    if not index.is_file():
        raise E.FtwNotFoundError(index, "index file missing (is this an FTW directory?)")
    size = index.stat().st_size
    with open(index, "rb") as f:
        data = f.read(HEADER_SIZE + MAX_MANIFEST_BYTES + 1)  # a larger file fails the size rule without being read
    return parse_index(data, index, file_size=size)


def parse_index(data: bytes, where: Path | str, *, file_size: int | None = None) -> dict[str, Any]:
    """Rules V1..V8 on the bytes of an index file (`file_size`: its size on disk, when `data` may be cut short) ->
    the decoded manifest object. Raises only FtwError subclasses (tools/campaign_fuzz_ftw.py holds it to that)."""
    size = len(data) if file_size is None else file_size
    if len(data) < HEADER_SIZE:
        raise E.FtwTruncatedError(where, f"{len(data)} bytes, the header alone is {HEADER_SIZE}")
    magic, h = Header.unpack(data[:HEADER_SIZE])
    if magic != MAGIC:
        raise E.FtwMagicError(where, f"expected {MAGIC.hex(' ')}, found {magic.hex(' ')}")
    if h.major != VERSION_MAJOR:
        raise E.FtwVersionError(where, f"format version {h.major}.{h.minor}; this reader supports {VERSION_MAJOR}.x")
    if h.header_size != HEADER_SIZE or h.manifest_offset != HEADER_SIZE or any(h.reserved):
        raise E.FtwHeaderError(where, f"header_size={h.header_size} manifest_offset={h.manifest_offset} "
                                      f"reserved={'zero' if not any(h.reserved) else 'non-zero'}")
    if h.manifest_nbytes > MAX_MANIFEST_BYTES:
        raise E.FtwManifestTooLargeError(where, f"{h.manifest_nbytes} bytes > limit {MAX_MANIFEST_BYTES}")
    if size != HEADER_SIZE + h.manifest_nbytes or len(data) < size:
        raise E.FtwTruncatedError(where, f"file is {size} bytes, header says {HEADER_SIZE + h.manifest_nbytes}")
    body = data[HEADER_SIZE:HEADER_SIZE + h.manifest_nbytes]
    if xxhash.xxh3_64_intdigest(body) != h.manifest_xxh3:
        raise E.FtwManifestChecksumError(where, "manifest bytes do not match the header checksum")
    try:
        obj = json.loads(body.decode("utf-8"), object_pairs_hook=_no_dup_keys, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise E.FtwManifestParseError(where, str(e)[:200]) from None
    if not isinstance(obj, dict):
        raise E.FtwManifestParseError(where, "manifest is not a JSON object")
    if "version" in obj and obj["version"] != [h.major, h.minor]:  # a missing key is V9, checked later
        raise E.FtwVersionError(where, f"manifest version {obj['version']!r} disagrees with header {h.major}.{h.minor}")
    return obj


def _no_dup_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return d


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


@dataclass(frozen=True)
class ExpertBankView:
    """Per-expert addressing of one bank inside a mapped data file."""

    record_info: BankRecord
    file: Path
    _buf: torch.Tensor  # uint8 view of the whole bank [E * stride]
    _reader: "FtwReader"

    @property
    def name(self) -> str: return self.record_info.name
    @property
    def scheme(self) -> str: return self.record_info.scheme
    @property
    def num_experts(self) -> int: return self.record_info.num_experts
    @property
    def stride(self) -> int: return self.record_info.stride
    @property
    def offset(self) -> int: return self.record_info.offset

    @property
    def components(self) -> dict[str, Component]:
        return {c.name: c for c in self.record_info.components}

    def record(self, e: int) -> torch.Tensor:
        """uint8 [stride]: expert e's whole contiguous record (one read or one DMA)."""
        if not 0 <= e < self.num_experts:
            raise IndexError(f"bank {self.name}: expert {e} out of range 0..{self.num_experts - 1}")
        rec = self._buf[e * self.stride:(e + 1) * self.stride]
        self._reader._check_expert(self.record_info, e, rec)
        return rec

    def expert(self, e: int, comp: str) -> torch.Tensor:
        c = self.components[comp]
        return _view(self.record(e)[c.offset:c.offset + c.nbytes], c.dtype, c.shape)

    def stacked(self, comp: str) -> torch.Tensor:
        """[E, *shape] strided zero-copy view of one component across all experts (not checksummed)."""
        c = self.components[comp]
        dt = torch_dtype(c.dtype)
        item = torch.empty((), dtype=dt).element_size()
        if c.offset % item or self.stride % item:
            raise ValueError(f"component {comp} is not aligned to its dtype")
        flat = self._buf.view(dt)
        inner = [1] * len(c.shape)  # contiguous strides of one component, in elements
        for i in range(len(c.shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * c.shape[i + 1]
        # as_strided's storage offset is absolute (from the start of the mapped file), not from the bank
        return flat.as_strided((self.num_experts, *c.shape), (self.stride // item, *inner),
                               flat.storage_offset() + c.offset // item)


STAMP_NAME = ".ft-verified"  # not part of the FTW: a note of this machine (inodes, mtimes), never packed


def read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((Path(path) / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def _stamp(p: Path) -> tuple[int, int, int] | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _what(old: tuple | None, new: tuple | None) -> str:
    if new is None:
        return "removed"
    if old[0] != new[0]:
        return "replaced"
    return f"{old[1]} -> {new[1]} bytes" if old[1] != new[1] else "modified"


def _view(buf: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return buf.view(torch_dtype(dtype)).view(shape)


class FtwReader:
    def __init__(self, path: str | Path, *, checksums: str = "lazy"):
        if checksums not in ("lazy", "off"):
            raise ValueError("checksums must be 'lazy' or 'off'")
        self.path = Path(path)
        self.index_path = self.path / INDEX_NAME
        self.manifest_obj = read_index(self.path)
        self._m: Manifest = parse_manifest(self.manifest_obj, str(self.index_path))
        self._checked_tensors: set[str] = set()
        self._checked_experts: set[tuple[str, int]] = set()
        for f in self._m.files:
            self._check_size(self.path / f.name, f.nbytes)
        self._stamps = {f.name: _stamp(self.path / f.name) for f in self._m.files}  # what `changed` compares to
        # every byte already checked (`ft verify`, or the compiler that wrote them) and not changed since: no lazy
        # checksums (a serving start then reads no byte it does not use)
        self.verified = read_stamp(self.path) == self._stamp_record()
        self._lazy = checksums == "lazy" and not self.verified
        for a in (*self._m.assets.values(), *self._m.slots["plans"], *self._m.slots["kernels"]):
            self._check_size(self.path / a.name, a.nbytes)
        self._maps: dict[int, torch.Tensor] = {}

    def _stamp_record(self) -> dict:
        files = {INDEX_NAME: _stamp(self.index_path), **self._stamps}
        return {"format": "ft-verified-1", "files": {k: list(v) if v else None for k, v in files.items()}}

    def write_stamp(self) -> bool:
        """Record that every byte of these files was checked (call after a full pass without failures, or after
        writing them); False where the directory is not writable (then nothing changes)."""
        try:
            tmp = self.path / (STAMP_NAME + ".tmp")
            tmp.write_text(json.dumps(self._stamp_record()))
            os.replace(tmp, self.path / STAMP_NAME)
        except OSError:
            return False
        self.verified = True
        return True

    def changed(self) -> str | None:
        """None while every data file is the one opened (same inode, size and modification time); else what changed.
        A data file truncated or replaced under a mapping turns a read of it into SIGBUS: callers check before use."""
        for name, stamp in self._stamps.items():
            now = _stamp(self.path / name)
            if now != stamp:
                return f"{self.path / name} changed on disk since it was opened ({_what(stamp, now)})"
        return None

    def _check_size(self, p: Path, nbytes: int) -> None:
        # an entry is a regular file inside the directory: not a symbolic link (to anything), not under a linked
        # slot directory that leads elsewhere
        if p.is_symlink() or (p.exists() and not p.resolve().is_relative_to(self.path.resolve())):
            raise E.FtwPathError(p, "is a symbolic link or resolves outside the FTW directory; entries must be "
                                    "regular files inside it")
        if not p.is_file():
            raise E.FtwNotFoundError(p, "file listed in the manifest is missing")
        size = p.stat().st_size
        if size != nbytes:
            raise E.FtwFileSizeError(p, f"{size} bytes on disk, manifest says {nbytes}")

    # -- manifest sections ---------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]: return self.manifest_obj
    @property
    def config(self) -> ModelConfig: return self._m.config
    @property
    def quant(self) -> dict: return self.manifest_obj["quant"]
    @property
    def tokenizer(self) -> dict: return self.manifest_obj["tokenizer"]
    @property
    def generation(self) -> dict: return self.manifest_obj["generation"]
    @property
    def provenance(self) -> dict: return self.manifest_obj["provenance"]
    @property
    def metadata(self) -> dict: return self.manifest_obj["metadata"]
    @property
    def records(self) -> Manifest: return self._m

    # -- data ----------------------------------------------------------------------------------
    def _file_buf(self, idx: int) -> torch.Tensor:
        buf = self._maps.get(idx)
        if buf is None:
            rec = self._m.files[idx]
            if rec.nbytes == 0:
                buf = torch.empty(0, dtype=torch.uint8)
            else:
                with open(self.path / rec.name, "rb") as f:
                    # ACCESS_COPY: private mapping, so tensors are writable without touching the file.
                    mm = mmap.mmap(f.fileno(), rec.nbytes, access=mmap.ACCESS_COPY)
                buf = torch.frombuffer(mm, dtype=torch.uint8)
            self._maps[idx] = buf
        return buf

    def tensor_names(self) -> list[str]: return list(self._m.tensors)
    def has_tensor(self, name: str) -> bool: return name in self._m.tensors
    def bank_names(self) -> list[str]: return list(self._m.banks)
    def has_bank(self, name: str) -> bool: return name in self._m.banks

    def tensor(self, name: str) -> torch.Tensor:
        try:
            t = self._m.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None
        raw = self._file_buf(t.file)[t.offset:t.offset + t.nbytes]
        if self._lazy and name not in self._checked_tensors:
            self._check(raw, t.xxh3, f"tensor {name}", self._m.files[t.file].name)
            self._checked_tensors.add(name)
        return _view(raw, t.dtype, t.shape)

    def bank(self, name: str) -> ExpertBankView:
        try:
            b = self._m.banks[name]
        except KeyError:
            raise KeyError(f"{self.path}: no expert bank named {name!r}") from None
        return ExpertBankView(b, self.path / self._m.files[b.file].name,
                              self._file_buf(b.file)[b.offset:b.offset + b.nbytes], self)

    def _check_expert(self, b: BankRecord, e: int, rec: torch.Tensor) -> None:
        if self._lazy and (b.name, e) not in self._checked_experts:
            self._check(rec[:b.used_bytes], b.xxh3[e], f"bank {b.name} expert {e}", self._m.files[b.file].name)
            self._checked_experts.add((b.name, e))

    def _check(self, raw: torch.Tensor, want: str, what: str, file: str) -> None:
        got = xxh3_hex(raw.numpy()) if raw.numel() else xxh3_hex(b"")
        if got != want:
            raise E.FtwChecksumError(self.path / file, f"{what}: xxh3 {got} != recorded {want}")

    def asset_path(self, name: str) -> Path:
        if name not in self._m.assets:
            raise KeyError(f"{self.path}: no asset named {name!r}")
        return self.path / name

    def asset(self, name: str) -> bytes:
        data = self.asset_path(name).read_bytes()
        rec = self._m.assets[name]
        if xxh3_hex(data) != rec.xxh3:
            raise E.FtwChecksumError(self.path / name, f"asset xxh3 {xxh3_hex(data)} != recorded {rec.xxh3}")
        return data

    def verify(self, progress: Callable[[int], None] | None = None) -> list[E.FtwError]:
        """Full pass (V20, V21): every checksum and every padding byte. Returns all failures found."""
        from .verify import verify_all  # kept separate: only `ft verify` and the compiler need it
        return verify_all(self, progress)
