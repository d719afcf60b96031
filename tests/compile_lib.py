"""What the family compile tests share: a copy of a checkpoint with its config.json edited, and a compile that must
be refused with a specific error and leave nothing behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ft.compiler import compile_checkpoint
from ft.compiler.errors import CheckpointError


def copy_checkpoint(src: Path, dst: Path, config_change=None) -> Path:
    """`src` copied to `dst`; `config_change(cfg)` edits the copy's config.json in place."""
    shutil.copytree(src, dst)
    if config_change is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_change(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_refused(src: Path, out: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        compile_checkpoint(src, out, progress=False)
    assert not out.exists()
