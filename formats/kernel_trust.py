"""Which prebuilt kernels this machine trusts: the sha256 of each kernels container built here or unpacked from a
bundle whose signature verified against a trusted key.

Kernels are code that runs on the GPU, so the runtime installs a container only when its exact bytes are listed here
(specs/ftw.md §5.7). The list lives with the trusted keys (`$FT_HOME/trusted_kernels`, default `~/.config/ft`), not
in the FTW directory: a directory that came from elsewhere cannot vouch for itself. One line per container,
`<sha256> <how it became trusted>`, appended; a digest, not a name, so a changed file is no longer trusted.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from .home import ft_home

_LINE = re.compile(r"([0-9a-f]{64}) (.{1,200})")


def store_path() -> Path:
    return ft_home() / "trusted_kernels"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def trusted(sha256: str, path: Path | None = None) -> str | None:
    """How the container with this sha256 became trusted here (e.g. "built on this machine"), or None."""
    p = path or store_path()
    try:
        lines = p.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        m = _LINE.fullmatch(line.strip())
        if m and m.group(1) == sha256:
            return m.group(2)
    return None


def trust(sha256: str, source: str, path: Path | None = None) -> Path:
    """Record that the container with this sha256 is trusted (`source`: one line saying why); returns the store."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ValueError(f"{sha256!r} is not a sha256 hex digest")
    source = " ".join(source.split())[:200] or "trusted"
    p = path or store_path()
    if trusted(sha256, p) is None:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:  # one short line per write: appends do not interleave
            f.write(f"{sha256} {source}\n")
            f.flush()
            os.fsync(f.fileno())
    return p


def trust_ftw(ftw: Path, source: str, path: Path | None = None) -> list[str]:
    """Trust every kernels/ entry of the FTW at `ftw` as it is on disk now; returns their names."""
    from .reader import FtwReader

    r = FtwReader(ftw, checksums="off")
    names = []
    for entry in r.records.slots["kernels"]:
        trust(digest((r.path / entry.name).read_bytes()), source, path)
        names.append(entry.name)
    return names
