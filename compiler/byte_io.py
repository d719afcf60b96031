"""Helpers of the single-pass source reader (`source_stream.py`): positioned reads, O_DIRECT where the filesystem
allows it (aligned offsets, lengths and buffers); copies out of its window on a few threads; and tensor views of a
byte span read in one go."""

from __future__ import annotations

import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.safetensors_io import ST_DTYPES, TensorInfo

ALIGN = 4096
COPY_PIECE = 1 << 20  # bytes per piece of a split copy, at least
COPY_THREADS = min(4, os.cpu_count() or 1)


@functools.cache
def _copier() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="ft-copy")


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src (uint8, equal lengths), split over up to COPY_THREADS threads: the compile's thread copies every
    weight byte out of the source window into fresh tensors (page faults included), ~2.5 GB/s on one core, which on a
    fast disk held the reader back (numpy copies run without the GIL)."""
    n = dst.nbytes
    parts = min(COPY_THREADS, n // COPY_PIECE)
    if parts < 2:
        dst[:] = src
        return
    step = -(-n // parts)
    jobs = [_copier().submit(dst.__setitem__, slice(a, a + step), src[a:a + step]) for a in range(step, n, step)]
    dst[:step] = src[:step]
    for j in jobs:
        j.result()


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
