"""Helpers of the single-pass source reader (`source_stream.py`): positioned reads, O_DIRECT where the filesystem
allows it (aligned offsets, lengths and buffers); and tensor views of a byte span read in one go."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.safetensors_io import ST_DTYPES, TensorInfo

ALIGN = 4096


def open_direct(path: Path) -> int:
    """An O_DIRECT descriptor where the filesystem allows it, else a buffered one (same reads work on both)."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, os.O_RDONLY)


def pread_full(fd: int, buf, offset: int, want: int, path: Path) -> int:
    """Read into `buf` from `offset` until `want` bytes arrived (or end of file); returns the count. Every read
    starts at an aligned file offset and buffer offset (O_DIRECT), since short reads only happen at EOF."""
    view, done = memoryview(buf), 0
    while done < want:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"{path.name}: cannot read at offset {offset + done}: {e.strerror or e}") from e
        if n <= 0:
            break
        done += n
    return done


def read_direct(fd: int, path: Path, begin: int, nbytes: int) -> torch.Tensor:
    """Aligned positioned read of [begin, begin + nbytes) into a fresh page-aligned buffer (a uint8 tensor)."""
    a0 = begin - begin % ALIGN
    a1 = -(-(begin + nbytes) // ALIGN) * ALIGN
    buf = mmap.mmap(-1, a1 - a0)
    if pread_full(fd, buf, a0, begin + nbytes - a0, path) < begin + nbytes - a0:
        raise CheckpointError(f"{path.name}: truncated: expected {nbytes} bytes at offset {begin}")
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=begin - a0)


def span_views(span: torch.Tensor, b0: int, infos: list[TensorInfo]) -> list[torch.Tensor]:
    """The tensors `infos` as views of `span` (uint8, the file's bytes from offset `b0`); a tensor whose start is not
    aligned to its element size is copied (`.view(dtype)` needs an aligned start)."""
    out = []
    for i in infos:
        piece = span[i.begin - b0:i.end - b0]
        if (i.begin - b0) % ST_DTYPES[i.dtype].itemsize:
            piece = piece.clone()
        out.append(piece.view(ST_DTYPES[i.dtype]).reshape(i.shape))
    return out
