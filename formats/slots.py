"""Add and remove `plans/` and `kernels/` entries of an existing FTW (specs/ftw.md §5.7, §11).

The data files are never touched. Order, so that a crash at any point leaves a readable FTW: new entry files are
written under their final names (names not listed yet: a listed name is never rewritten) to a temporary name,
fsynced and renamed; then `model.ftw` is rewritten (temporary name, fsync, rename, fsync of the directory); only then
are the entries it no longer lists deleted. A directory whose files were verified (`.ft-verified`) stays so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .layout import INDEX_NAME, MAX_MANIFEST_BYTES, SLOT_DIRS, Header, is_safe_name, xxh3_hex
from .manifest import parse_manifest
from .reader import FtwReader


def update_slot(ftw: Path, slot: str, add: dict[str, bytes], remove: set[str] = frozenset()) -> list[str]:
    """Add entries `slot/NAME` (`add`: plain name -> bytes) and drop the listed entries named in `remove` (full
    names, `slot/NAME`); returns the slot's entry names after the change. An added name that is already listed must
    hold the same bytes (it is kept as it is); entries are never replaced in place."""
    if slot not in SLOT_DIRS:
        raise ValueError(f"slot {slot!r} is not one of {SLOT_DIRS}")
    ftw = Path(ftw)
    r = FtwReader(ftw, checksums="off")
    verified = r.verified
    obj = dict(r.manifest_obj)
    listed = {e["name"]: e for e in obj[slot]}
    new = {}
    for name, data in add.items():
        full = f"{slot}/{name}"
        if not is_safe_name(full, allow_slot_dir=True):
            raise ValueError(f"{full!r} is not a plain entry name")
        if full in listed:
            if listed[full]["xxh3"] != xxh3_hex(data) or listed[full]["nbytes"] != len(data):
                raise ValueError(f"{ftw / full} is listed with other bytes; add the new bytes under a new name")
            continue
        new[full] = {"name": full, "nbytes": len(data), "xxh3": xxh3_hex(data)}
    entries = [e for e in obj[slot] if e["name"] not in remove] + list(new.values())
    obj[slot] = sorted(entries, key=lambda e: e["name"])
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    if len(body) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest would be {len(body)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    parse_manifest(json.loads(body), str(ftw / INDEX_NAME))  # never write what a reader refuses
    if new:
        (ftw / slot).mkdir(exist_ok=True)
        for full in new:
            _write(ftw / full, add[full.split("/", 1)[1]])
        _fsync_dir(ftw / slot)
    _write(ftw / INDEX_NAME, Header.for_manifest(body).pack() + body)
    _fsync_dir(ftw)
    for full in set(listed) & set(remove):
        (ftw / full).unlink(missing_ok=True)
    if verified:  # the data files are the ones checked, and every listed side file's digest was just computed
        FtwReader(ftw, checksums="off").write_stamp()
    return [e["name"] for e in obj[slot]]


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
