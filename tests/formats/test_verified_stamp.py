"""The verified stamp (`FtwReader.verified`): after a full check (`ft verify`) or the compiler's write, a later open of
the same unchanged files skips the lazy per-record checksums; any change to a file (or a copy elsewhere) drops it."""

from __future__ import annotations

import os
import shutil

import pytest

from ft.formats import FtwReader
from ft.formats.errors import FtwChecksumError
from ft.formats.reader import STAMP_NAME


def test_a_stamp_holds_for_the_same_files_only(ftw_for, tmp_path):
    ftw = ftw_for("qwen3_moe", "nvfp4")
    assert FtwReader(ftw).verified  # the compiler stamped what it wrote
    copy = tmp_path / "copy.ftw"
    shutil.copytree(ftw, copy)  # same bytes and times, other inodes: not checked here
    r = FtwReader(copy)
    assert not r.verified and r.verify() == [] and r.write_stamp()
    assert FtwReader(copy).verified
    bank = next(iter(FtwReader(copy).bank_names()))
    data = copy / "data-00000.ftd"
    with open(data, "r+b") as f:  # one flipped byte inside the first expert record of that bank
        f.seek(FtwReader(copy).bank(bank).offset)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    r = FtwReader(copy)
    assert not r.verified  # the file changed since the stamp: records are hashed again on first use
    with pytest.raises(FtwChecksumError):
        r.bank(bank).record(0)
    (copy / STAMP_NAME).write_text("not json")
    assert not FtwReader(copy).verified
