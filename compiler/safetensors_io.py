"""Read tensors out of `.safetensors` files with positioned reads, one tensor (or row range) at a time.

Layout (the safetensors format): u64 little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data section; offsets are
relative to the data section. We parse and check the header ourselves so that a corrupt file gets a message naming
the file and the entry, and we read with `os.preadv` into a fresh buffer instead of mmapping: touched pages of a
mapping count in the process's resident set until it is closed, so mapping a 20 GB shard would defeat the compiler's
bounded-memory guarantee (peak RSS ≈ the largest tensor in flight, not the checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ft.compiler.errors import CheckpointError, supported
from ft.formats.prefetch import will_need

# safetensors dtype string -> torch dtype (those torch can hold; others fail when read, naming the tensor)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}
MAX_HEADER = 100 << 20  # the reference implementation's limit


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range [begin, end) in `path`."""

    path: Path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_DTYPES[self.dtype]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header; every entry's byte range must lie inside the data section."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path.name}: corrupt safetensors file: {size} bytes, no header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path.name}: corrupt safetensors header: header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path.name}: cannot read: {e.strerror or e}") from e
    try:
        entries = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path.name}: corrupt safetensors header: not a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, en) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: corrupt safetensors header: bad entry for {name!r}") from None
        if dtype not in ST_ITEMSIZE:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unknown dtype {dtype!r}")
        want = math.prod(shape) * ST_ITEMSIZE[dtype]
        if not (isinstance(b, int) and isinstance(en, int) and 0 <= b <= en <= data_size and en - b == want):
            raise CheckpointError(
                f"{path.name}: corrupt safetensors header: {name!r} has data_offsets {[b, en]} for {want} bytes "
                f"({dtype} {list(shape)}) in a {data_size}-byte data section")
        out[name] = TensorInfo(path, dtype, shape, data_start + b, data_start + en)
    return out


def _pread_into(fd: int, buf: torch.Tensor, offset: int, path: Path) -> None:
    """Fill the uint8 tensor `buf` from file offset `offset` (short reads retried; EOF is an error)."""
    view = memoryview(buf.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path.name}: truncated: expected {len(view)} bytes at offset {offset}")
        done += n


def byte_range(name: str, info: TensorInfo, rows: tuple[int, int] | None) -> tuple[tuple[int, ...], int, int]:
    """(shape, file offset, nbytes) of a tensor, or of rows [r0, r1) of its first dim; refuses dtypes torch lacks."""
    if info.dtype not in ST_DTYPES:
        raise CheckpointError(f"{info.path.name}: tensor {name!r} has dtype {info.dtype}, which torch cannot "
                              f"hold; supported: {supported(ST_DTYPES)}")
    shape, begin, nbytes = info.shape, info.begin, info.nbytes
    if rows is not None:
        r0, r1 = rows
        if not shape or not 0 <= r0 <= r1 <= shape[0]:
            raise CheckpointError(f"{info.path.name}: rows {rows} out of range for {name!r} {list(shape)}")
        row_bytes = nbytes // shape[0] if shape[0] else 0
        shape, begin, nbytes = (r1 - r0, *shape[1:]), begin + r0 * row_bytes, (r1 - r0) * row_bytes
    return shape, begin, nbytes


class TensorReader:
    """Positioned reads from a set of safetensors files (one descriptor per file, opened lazily).

    `expect(infos)` announces the tensors about to be read, in order; the reader then keeps the kernel reading
    `window` bytes ahead of its position (POSIX_FADV_WILLNEED, asynchronous), so disk reads overlap the transform
    and the writes instead of alternating with them. Page-cache pages are not part of the process's memory."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0
        self._ahead: list[TensorInfo] = []
        self._next = self._advised = self._window = 0

    def expect(self, infos: list[TensorInfo], window: int = 256 << 20) -> None:
        self._ahead, self._next, self._advised, self._window = infos, 0, 0, window
        self._advise()

    def _advise(self) -> None:
        while self._next < len(self._ahead) and self._advised < self.bytes_read + self._window:
            info = self._ahead[self._next]
            will_need(self._fd(info.path), info.begin, info.nbytes)
            self._advised += info.nbytes
            self._next += 1

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def read(self, name: str, info: TensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (or rows [r0, r1) of its first dim) as a new CPU tensor of its own dtype."""
        shape, begin, nbytes = byte_range(name, info, rows)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            _pread_into(self._fd(info.path), buf, begin, info.path)
        self.bytes_read += nbytes
        self._advise()
        return buf.view(info.torch_dtype).reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
