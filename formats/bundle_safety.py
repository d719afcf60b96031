"""What a bundle may contain and where it may write (`bundle.py`): every check that runs before a byte is written.

* source: an FTW directory of regular files (no symlinks, hard links, devices);
* manifest: relative POSIX paths without `..`, `.` or empty parts, no duplicates (case-insensitively, for
  case-folding filesystems), known kinds, chunks stored back to back in manifest order up to the manifest, each at
  most chunk_size plain bytes, adding up to the file's size; a `model.ftw` (it is an FTW);
* target: a plain directory (not a symlink) that is new, or holds only this bundle's files (a resumed unpack), with
  room on its disk for the declared sizes; subfolders are made without following symlinks.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path, PurePosixPath

KINDS = ("dense", "experts", "kernels", "plans", "meta")
VERSION = 1


class BundleError(ValueError):
    """A bundle that is malformed, hostile, truncated or does not match its manifest."""


def source_files(src: Path) -> list[str]:
    """The FTW directory's regular files (relative POSIX paths, sorted); links and special files are refused."""
    if not (src / "model.ftw").is_file():
        raise BundleError(f"{src} is not an FTW directory (no model.ftw)")
    files = []
    for root, dirs, names in os.walk(src):
        for name in dirs + names:
            p = Path(root) / name
            rel, st = p.relative_to(src).as_posix(), p.lstat()
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise BundleError(f"{rel}: only regular files are packed, not links or special files")
            if not name.endswith((".part", ".tmp")) and name != ".ft-verified":  # not part of the FTW
                files.append(rel)
    return sorted(files)


def check_manifest(m, end: int, where: str) -> None:
    if not isinstance(m, dict) or m.get("format") != "ft-bundle" or m.get("version") != VERSION:
        raise BundleError(f"{where}: the manifest is not an ft-bundle version {VERSION} manifest")
    size = m.get("chunk_size")
    files = m.get("files")
    if not isinstance(size, int) or not 0 < size <= 1 << 30 or not isinstance(files, list):
        raise BundleError(f"{where}: the manifest's chunk_size or files are malformed")
    seen, offset = set(), 0
    for e in files:
        if not isinstance(e, dict) or not isinstance(e.get("path"), str) or not isinstance(e.get("chunks"), list):
            raise BundleError(f"{where}: a malformed file entry")
        path = _safe_path(e["path"], where)
        if path.lower() in seen:
            raise BundleError(f"{where}: {path} appears twice")
        seen.add(path.lower())
        if e.get("kind") not in KINDS or not isinstance(e.get("sha256"), str) or len(e["sha256"]) != 64:
            raise BundleError(f"{where}: {path}: malformed kind or sha256")
        total = 0
        for c in e["chunks"]:
            if (not isinstance(c, list) or len(c) != 5 or not all(isinstance(v, int) and v >= 0 for v in c[:3])
                    or not all(isinstance(v, str) for v in c[3:])):
                raise BundleError(f"{where}: {path}: a malformed chunk entry")
            if c[0] != offset:
                raise BundleError(f"{where}: {path}: chunks are not stored back to back in order (reordered or "
                                  f"truncated bundle)")
            if not 0 < c[2] <= size or c[1] == 0:
                raise BundleError(f"{where}: {path}: a chunk declares {c[2]} plain bytes (chunk_size {size})")
            if len(c[3]) != 64 or len(c[4]) != 16:
                raise BundleError(f"{where}: {path}: a chunk's sha256 or xxh3 is malformed")
            offset += c[1]
            total += c[2]
        if e["sha256"] != file_digest(e["chunks"]):
            raise BundleError(f"{where}: {path}: its sha256 does not match its chunks' digests")
        if e.get("size") != total:
            raise BundleError(f"{where}: {path}: its chunks add up to {total} bytes, not its size {e.get('size')}")
    if offset != end:
        raise BundleError(f"{where}: the chunks end at {offset}, the manifest starts at {end}")
    if "model.ftw" not in seen:
        raise BundleError(f"{where}: no model.ftw: not an FTW bundle")


def _safe_path(p: str, where: str) -> str:
    pp = PurePosixPath(p)
    if (not p or "\\" in p or "\0" in p or pp.is_absolute() or p != pp.as_posix()
            or any(part in ("", ".", "..") for part in p.split("/")) or p.endswith((".part", ".tmp"))):
        raise BundleError(f"{where}: unsafe path {p!r} in the manifest (absolute, '..', or not a plain relative path)")
    return p


def prepare_dest(dest: Path, manifest: dict) -> None:
    """Create dest (and subfolders) without following symlinks; refuse a non-empty dest holding other files, or a
    disk without room for the declared sizes."""
    if dest.is_symlink():
        raise BundleError(f"{dest} is a symlink; unpack into a plain directory")
    dest.mkdir(parents=True, exist_ok=True)
    ours = {e["path"] for e in manifest["files"]} | {e["path"] + ".part" for e in manifest["files"]}
    for root, dirs, names in os.walk(dest):
        for name in dirs + names:
            p = Path(root) / name
            rel = p.relative_to(dest).as_posix()
            if p.is_symlink() or (p.is_file() and rel not in ours):
                raise BundleError(f"{dest} is not empty ({rel}); unpack into a new directory")
    need = sum(e["size"] for e in manifest["files"])
    fs = os.statvfs(dest)
    free = fs.f_bavail * fs.f_frsize
    if need > free + sum((dest / e["path"]).stat().st_size for e in manifest["files"] if (dest / e["path"]).exists()):
        raise BundleError(f"{dest}: the bundle needs {need} bytes, the disk has {free} free")
    for e in manifest["files"]:
        parent = dest
        for part in e["path"].split("/")[:-1]:
            parent = parent / part
            if parent.is_symlink():
                raise BundleError(f"{parent} is a symlink; refusing to write through it")
            parent.mkdir(exist_ok=True)


def file_digest(chunks: list) -> str:
    """A file's sha256 in the manifest: over the concatenated binary sha256 digests of its chunks, in order (computed
    from the chunks, in parallel, rather than in one serial pass over the file)."""
    return hashlib.sha256(b"".join(bytes.fromhex(c[3]) for c in chunks)).hexdigest()
