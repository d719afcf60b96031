"""Streaming FTW writer (specs/ftw.md).

Invariants:
* Memory is bounded by the largest single tensor (or one expert record's components) handed in plus
  the data file's staging buffers: bytes go straight to the data file (O_DIRECT, `datafile.py`).
* Everything is written into a hidden sibling directory `.NAME.tmp-PID`; `finish()` writes the
  index last, fsyncs every file and the directory, then renames. An interrupted write therefore
  never leaves a directory at `out_dir`, and a half-written temp dir has no valid index.
* Output is a pure function of the inputs (no timestamps, no absolute paths): byte-identical reruns.
* Every digest is computed from the very bytes handed to the data file; `finish(check=...)` runs a
  content check on the complete temp dir before the rename (the compiler's sampled or full verify).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from .config import ModelConfig
from .datafile import DataFile
from .dtypes import SCHEMES, dtype_name
from .layout import (ALIGN, CHECKSUM, COMPONENT_ALIGN, INDEX_NAME, MAX_MANIFEST_BYTES, VERSION_MAJOR, VERSION_MINOR,
                     Header, align_up, data_file_name, is_reserved_name, is_safe_name, xxh3_hex)
from .manifest import parse_manifest

DEFAULT_SHARD_BYTES = 4 << 30
_ZEROS = bytes(ALIGN)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Little-endian raw bytes of a tensor without an extra copy when it is already contiguous."""
    t = t.detach().to("cpu").contiguous().reshape(-1)  # 1-D first: a 0-dim tensor cannot change element size
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def clean_stale_temp_dirs(out_dir: Path) -> None:
    """Tidy what writers that died (kill -9) left beside `out_dir`, so a rerun starts clean.

    `.NAME.tmp-PID` is an unfinished write: removed. `.NAME.old-PID` is the previous FTW moved aside
    by a `--force` rewrite that died between its two renames: put back if nothing replaced it.
    """
    for kind in ("tmp", "old"):
        for p in sorted(out_dir.parent.glob(f".{out_dir.name}.{kind}-*")):
            pid = p.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or _pid_alive(int(pid)):
                continue
            if kind == "old" and not out_dir.exists():
                os.rename(p, out_dir)
            else:
                shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BankWriter:
    """Writes the E records of one expert bank; experts arrive in order 0..E-1."""

    def __init__(self, w: "FtwWriter", rec: dict[str, Any], comps: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self._w, self._rec, self._comps, self._next = w, rec, comps, 0

    def write_expert(self, e: int, parts: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
        """Expert e's components; a component may come as a tuple of tensors that are its rows in order (dim-0
        pieces, e.g. gate and up of gate_up), written one after the other without concatenating them first."""
        if e != self._next:
            raise ValueError(f"bank {self._rec['name']}: expected expert {self._next}, got {e}")
        if set(parts) != set(self._comps):
            raise ValueError(f"bank {self._rec['name']}: components {sorted(parts)} != {sorted(self._comps)}")
        for c in self._rec["components"]:  # refuse before writing a byte of the record
            ts = parts[c["name"]]
            ts = ts if isinstance(ts, tuple) else (ts,)
            dtype, shape = self._comps[c["name"]]
            if len(ts) == 1:
                got = tuple(ts[0].shape)
            elif ts and all(t.dim() and t.shape[1:] == ts[0].shape[1:] for t in ts):
                got = (sum(t.shape[0] for t in ts), *ts[0].shape[1:])
            else:
                got = None  # nothing, or pieces that do not stack on dim 0
            if got != tuple(shape) or any(t.dtype != dtype for t in ts):
                desc = ", ".join(f"{t.dtype} {list(t.shape)}" for t in ts) or "nothing"
                raise ValueError(f"bank {self._rec['name']} expert {e} {c['name']}: got {desc}, "
                                 f"declared {dtype} {list(shape)}")
        # components in offset order straight to the file, zero gaps between them; the digest covers
        # [0, used_bytes) (components and gaps), the zero tail up to `stride` is not hashed (V21)
        fh, h, pos = self._w._fh, xxhash.xxh3_64(), 0
        for c in self._rec["components"]:
            if c["offset"] > pos:
                gap = _ZEROS[:c["offset"] - pos]  # < COMPONENT_ALIGN bytes
                h.update(gap)
                fh.write(gap)
            ts = parts[c["name"]]
            for t in ts if isinstance(ts, tuple) else (ts,):
                data = tensor_bytes(t)
                h.update(data)
                fh.write(data)
            pos = c["offset"] + c["nbytes"]
        fh.zeros(self._rec["stride"] - pos)
        self._rec["xxh3"].append(h.hexdigest())
        self._w._pos += self._rec["stride"]
        self._next += 1
        if self._next == self._rec["num_experts"]:
            self._w._open_bank = None

    @property
    def done(self) -> bool:
        return self._next == self._rec["num_experts"]


class FtwWriter:
    def __init__(self, out_dir: str | Path, *, shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()) and not force:
            raise FileExistsError(f"{self.out_dir} exists and is not empty; pass --force to replace it")
        if shard_bytes < ALIGN:
            raise ValueError(f"shard_bytes must be at least {ALIGN}")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temp_dirs(self.out_dir)
        self.tmp_dir = self.out_dir.parent / f".{self.out_dir.name}.tmp-{os.getpid()}"
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir()
        self.force, self.shard_bytes = force, shard_bytes
        self._files: list[dict[str, Any]] = []
        self._tensors: list[dict[str, Any]] = []
        self._banks: list[dict[str, Any]] = []
        self._assets: dict[str, list[dict[str, Any]]] = {"assets": [], "plans": [], "kernels": []}
        self._names: set[str] = set()
        self._fh: DataFile | None = None
        self._pos = 0
        self._open_bank: BankWriter | None = None

    # -- data regions -------------------------------------------------------------------------
    def _region(self, name: str, nbytes: int) -> int:
        """Pick the file for a region of `nbytes` and pad to the next aligned offset; returns the offset."""
        if self._open_bank is not None:
            raise RuntimeError(f"bank {self._open_bank._rec['name']} is still being written")
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise ValueError(f"FTW name {name!r} must be a string of 1..256 characters")
        if name in self._names:
            raise ValueError(f"duplicate FTW name {name!r}")
        self._names.add(name)
        if self._fh is None or (self._pos > 0 and self._pos + nbytes > self.shard_bytes):
            self._new_file()
        pad = align_up(self._pos) - self._pos
        self._fh.zeros(pad)
        self._pos += pad
        return self._pos

    def _new_file(self) -> None:
        self._close_file()
        name = data_file_name(len(self._files))
        self._fh = DataFile(self.tmp_dir / name)
        self._files.append({"name": name, "nbytes": 0})
        self._pos = 0

    def _close_file(self) -> None:
        if self._fh is None:
            return
        pad = align_up(self._pos) - self._pos
        self._fh.zeros(pad)
        self._pos += pad
        fh, self._fh = self._fh, None
        fh.close()  # flushes, fsyncs; a write error surfaces here at the latest
        if fh.pos != self._pos:  # the writer's cursor (all offsets in the manifest) must be the file's size
            raise RuntimeError(f"{fh.path.name}: wrote {fh.pos} bytes, cursor at {self._pos}")
        self._files[-1]["nbytes"] = self._pos

    def add_tensor(self, name: str, t: torch.Tensor) -> None:
        dtype = dtype_name(t.dtype)  # refuse before any byte is written
        data = tensor_bytes(t)
        offset = self._region(name, len(data))
        self._fh.write(data)
        self._pos += len(data)
        self._tensors.append({"name": name, "dtype": dtype, "shape": list(t.shape),
                              "file": len(self._files) - 1, "offset": offset, "nbytes": len(data),
                              "xxh3": xxh3_hex(data)})

    def add_expert_bank(self, name: str, scheme: str, num_experts: int,
                        components: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> BankWriter:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; supported: {sorted(SCHEMES)}")
        if not isinstance(num_experts, int) or num_experts <= 0 or not components:
            raise ValueError(f"bank {name}: needs num_experts > 0 and at least one component")
        comps, off = [], 0
        for cname, (dtype, shape) in components.items():
            if not isinstance(cname, str) or not 0 < len(cname) <= 64:
                raise ValueError(f"bank {name}: component name {cname!r} must be a string of 1..64 characters")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            comps.append({"name": cname, "dtype": dtype_name(dtype), "shape": list(shape),
                          "offset": off, "nbytes": nbytes})
            off = align_up(off + nbytes, COMPONENT_ALIGN)
        stride = align_up(max(1, max(c["offset"] + c["nbytes"] for c in comps)))  # > 0 even if all are empty
        offset = self._region(name, num_experts * stride)
        rec = {"name": name, "scheme": scheme, "file": len(self._files) - 1, "offset": offset,
               "num_experts": num_experts, "stride": stride, "components": comps, "xxh3": []}
        self._banks.append(rec)
        self._open_bank = BankWriter(self, rec, {k: (v[0], tuple(v[1])) for k, v in components.items()})
        return self._open_bank

    def add_asset(self, name: str, data: bytes, *, slot: str = "assets") -> None:
        """A side file (tokenizer.json, chat template, or `plans/`/`kernels/` slot entries)."""
        full = name if slot == "assets" else f"{slot}/{name}"
        if slot not in self._assets or not is_safe_name(full, allow_slot_dir=slot != "assets"):
            raise ValueError(f"asset name {full!r} is not a plain file name (slot {slot!r})")
        if slot == "assets" and is_reserved_name(full):
            raise ValueError(f"asset name {full!r} is reserved (the index, a data file or a slot directory)")
        if any(a["name"] == full for a in self._assets[slot]):
            raise ValueError(f"duplicate asset {full!r}")
        path = self.tmp_dir / full
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._assets[slot].append({"name": full, "nbytes": len(data), "xxh3": xxh3_hex(data)})

    # -- finish -------------------------------------------------------------------------------
    def finish(self, *, config: ModelConfig, quant: dict, tokenizer: dict, generation: dict,
               provenance: dict, metadata: dict | None = None,
               check: Callable[[Path], None] | None = None) -> Path:
        """Write the index and install the directory. `check(tmp_dir)`, if given, runs on the complete, fsynced
        temp dir before the rename; if it raises, the temp dir is removed and nothing appears at `out_dir`."""
        if self._open_bank is not None:
            raise RuntimeError(f"bank {self._open_bank._rec['name']} is incomplete")
        if self._fh is None and not self._files:
            self._new_file()
        self._close_file()
        manifest = {
            "format": "ftw", "version": [VERSION_MAJOR, VERSION_MINOR], "alignment": ALIGN,
            "checksum": CHECKSUM, "requires": [], "files": self._files, "tensors": self._tensors,
            "expert_banks": self._banks, "assets": self._assets["assets"], "config": config.to_dict(),
            "quant": quant, "tokenizer": tokenizer, "generation": generation, "provenance": provenance,
            "plans": self._assets["plans"], "kernels": self._assets["kernels"], "metadata": metadata or {},
        }
        body = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        if len(body) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest is {len(body)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
        parse_manifest(json.loads(body), str(self.tmp_dir / INDEX_NAME))  # never write what a reader refuses
        with open(self.tmp_dir / INDEX_NAME, "wb") as f:
            f.write(Header.for_manifest(body).pack() + body)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp_dir)
        for slot in ("plans", "kernels"):
            if (self.tmp_dir / slot).is_dir():
                _fsync_dir(self.tmp_dir / slot)
        if check is not None:
            try:
                check(self.tmp_dir)
            except BaseException:
                self.abort()
                raise
        self._install()
        return self.out_dir

    def _install(self) -> None:
        old = None
        if self.out_dir.exists():
            old = self.out_dir.parent / f".{self.out_dir.name}.old-{os.getpid()}"
            os.rename(self.out_dir, old)
        os.rename(self.tmp_dir, self.out_dir)
        _fsync_dir(self.out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.abort()
            self._fh = None
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "FtwWriter":
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        if exc_type is not None:
            self.abort()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
