"""Where this machine keeps ft's own state: `$FT_HOME`, default `~/.config/ft` (trusted keys, trusted kernels), and
its caches: `$FT_CACHE_DIR`, else `$XDG_CACHE_HOME/ft`, default `~/.cache/ft` (built CPU kernels, bandwidth profiles,
tokenizers, the start-up file list): anything there may be deleted at any time."""

from __future__ import annotations

import os
from pathlib import Path


def ft_home() -> Path:
    return Path(os.environ.get("FT_HOME") or Path.home() / ".config" / "ft")


def cache_home() -> Path:
    if os.environ.get("FT_CACHE_DIR"):
        return Path(os.environ["FT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ft"
