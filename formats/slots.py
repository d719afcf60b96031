"""Adding, replacing and removing `plans/` and `kernels/` entries of an existing FTW (specs/ftw.md §5.7, §11).

Data files are never opened for writing. Every change ends with the index (`model.ftw`) replaced atomically: the new
index is written to a hidden temporary name in the directory, fsynced, renamed over the old one, and the directory
fsynced; the entry's file goes through the same temporary name + fsync + rename first. Readers ignore files the
manifest does not list, so a crash at any point leaves a valid FTW: the old one, or the new one, or the old one plus
an unlisted file. Replacing an entry takes two index writes (first without the entry, then with the new file), so
the manifest never lists a file whose bytes are not the ones it describes.

    put_entry(ftw, "plans", "gpu.json", data)             # add, or replace (plans: `ft plan` run again)
    remove_entry(ftw, "plans", "gpu.json")
    update_slot(ftw, "kernels", {name: data}, remove)     # several at once, one index write; never in place

A valid `.ft-verified` stamp (every data file checked, none changed since) is written again for the new index: the
data files it vouches for are untouched, and an index is validated whenever it is opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .layout import INDEX_NAME, MAX_MANIFEST_BYTES, SLOT_DIRS, Header, is_safe_name, xxh3_hex
from .manifest import parse_manifest
from .reader import FtwReader
from .writer import _fsync_dir, _pid_alive


def put_entry(ftw: str | Path, slot: str, name: str, data: bytes) -> Path:
    """Add `<slot>/<name>` holding `data`, replacing an entry of that name. Returns the entry's path."""
    ftw = Path(ftw)
    full = _entry_name(slot, name)
    reader = FtwReader(ftw, checksums="off")  # the FTW must be valid before it is changed (V1..V19)
    verified = reader._stamps if reader.verified else None
    manifest = dict(reader.manifest_obj)
    if any(e["name"] == full for e in manifest[slot]):
        manifest[slot] = [e for e in manifest[slot] if e["name"] != full]
        _write_index(ftw, manifest)
    _clean_stale(ftw)
    (ftw / slot).mkdir(exist_ok=True)
    write_atomic(ftw / full, data)
    _fsync_dir(ftw)
    manifest[slot] = sorted([*manifest[slot], {"name": full, "nbytes": len(data), "xxh3": xxh3_hex(data)}],
                            key=lambda e: e["name"])
    _write_index(ftw, manifest)
    _restamp(ftw, verified)
    return ftw / full


def update_slot(ftw: str | Path, slot: str, add: dict[str, bytes], remove: set[str] = frozenset()) -> list[str]:
    """Add entries `slot/NAME` (`add`: plain name -> bytes) and drop the listed entries named in `remove` (full names,
    `slot/NAME`) with one index write; returns the slot's entry names after the change. An added name that is already
    listed must hold the same bytes (it is kept as it is): entries are never replaced in place (kernels are named by
    their content, `ft kernels build`). Files of dropped entries are deleted after the index no longer lists them."""
    ftw = Path(ftw)
    reader = FtwReader(ftw, checksums="off")
    verified = reader._stamps if reader.verified else None
    manifest = dict(reader.manifest_obj)
    listed = {e["name"]: e for e in manifest.get(slot, ())}
    new = {}
    for name, data in add.items():
        full = _entry_name(slot, name)
        if full in listed:
            if listed[full]["xxh3"] != xxh3_hex(data) or listed[full]["nbytes"] != len(data):
                raise ValueError(f"{ftw / full} is listed with other bytes; add the new bytes under a new name")
            continue
        new[full] = {"name": full, "nbytes": len(data), "xxh3": xxh3_hex(data)}
    manifest[slot] = sorted([e for e in manifest[slot] if e["name"] not in remove] + list(new.values()),
                            key=lambda e: e["name"])
    if new:
        _clean_stale(ftw)
        (ftw / slot).mkdir(exist_ok=True)
        for full in new:
            write_atomic(ftw / full, add[full.split("/", 1)[1]])
    _write_index(ftw, manifest)
    for full in set(listed) & set(remove):
        (ftw / full).unlink(missing_ok=True)
    _restamp(ftw, verified)
    return [e["name"] for e in manifest[slot]]


def remove_entry(ftw: str | Path, slot: str, name: str) -> bool:
    """Drop `<slot>/<name>` from the manifest, then delete its file. False when there is no such entry."""
    ftw = Path(ftw)
    full = _entry_name(slot, name)
    reader = FtwReader(ftw, checksums="off")
    verified = reader._stamps if reader.verified else None
    manifest = dict(reader.manifest_obj)
    if not any(e["name"] == full for e in manifest[slot]):
        return False
    manifest[slot] = [e for e in manifest[slot] if e["name"] != full]
    _write_index(ftw, manifest)
    (ftw / full).unlink(missing_ok=True)
    _fsync_dir(ftw / slot)
    _restamp(ftw, verified)
    return True


def _entry_name(slot: str, name: str) -> str:
    full = f"{slot}/{name}"
    if slot not in SLOT_DIRS or not is_safe_name(full, allow_slot_dir=True):
        raise ValueError(f"{full!r} is not a slot entry name: {'/'.join(SLOT_DIRS)}/ and a plain file name "
                         f"([A-Za-z0-9_][A-Za-z0-9_.-]*, no '..')")
    return full


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: Path, data: bytes) -> None:
    """`data` into `path` through a temporary name in the same directory (the writer's pid in it, so a dead writer's
    leftovers are recognised), fsynced, renamed, the directory fsynced: a crash leaves the old file or the new one."""
    tmp = _tmp(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_index(ftw: Path, manifest: dict) -> None:
    """Serialise as the writer does, refuse what a reader would refuse, then replace model.ftw atomically."""
    body = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    if len(body) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest would be {len(body)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    parse_manifest(json.loads(body), str(ftw / INDEX_NAME))
    write_atomic(ftw / INDEX_NAME, Header.for_manifest(body).pack() + body)


def _clean_stale(ftw: Path) -> None:
    """Temporary files of writers that died (their process is gone) in the directory and its slot directories."""
    for d in (ftw, *(ftw / s for s in SLOT_DIRS)):
        for p in d.glob(".*.tmp-*") if d.is_dir() else ():
            pid = p.name.rsplit("-", 1)[-1]
            if p.is_file() and pid.isdigit() and not _pid_alive(int(pid)):
                p.unlink(missing_ok=True)


def _restamp(ftw: Path, verified: dict | None) -> None:
    """`verified`: the data files' stamps when they were found verified; stamped again if none has changed since."""
    if verified is not None:
        reader = FtwReader(ftw, checksums="off")
        if reader._stamps == verified:
            reader.write_stamp()
