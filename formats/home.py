"""Where this machine keeps ft's own state: `$FT_HOME`, default `~/.config/ft` (trusted keys, trusted kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def ft_home() -> Path:
    return Path(os.environ.get("FT_HOME") or Path.home() / ".config" / "ft")
