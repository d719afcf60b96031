"""Streaming writer of sharded safetensors checkpoints, laid out like Hugging Face releases.

Files: `model-0000x-of-0000y.safetensors` + `model.safetensors.index.json` (`{"metadata": {"total_size": bytes},
"weight_map": {name: file}}`), or a single `model.safetensors` when everything fits one shard. Each tensor is an
`Entry` whose bytes are produced lazily in chunks, so a checkpoint of any size is written in bounded memory: a shard's
header is computed from the names/dtypes/shapes alone, then the data follows in header order with no gaps.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
             torch.uint8: "U8", torch.int8: "I8", torch.float8_e8m0fnu: "F8_E8M0", torch.int64: "I64",
             torch.int32: "I32"}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """One tensor to write. `produce()` yields tensors (any shape, this dtype) whose bytes, in order, are the tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def tensor_entry(name: str, t: torch.Tensor) -> Entry:
    """An Entry for a tensor already in memory."""
    return Entry(name, t.dtype, tuple(t.shape), lambda: (t,))


def plan_shards(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Greedy split in order: a shard closes before the tensor that would push it past max_shard_size."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards if shards[0] else []


def _header(entries: list[Entry]) -> bytes:
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in ST_DTYPES:
            raise ValueError(f"{e.name}: dtype {e.dtype} has no safetensors name")
        meta[e.name] = {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape),
                        "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_file(path: Path, entries: list[Entry], on_bytes: Callable[[int], None] | None = None) -> None:
    """Write one safetensors file, checking that every entry produces exactly its declared bytes."""
    with open(path, "wb", buffering=16 << 20) as f:
        f.write(_header(entries))
        for e in entries:
            written = 0
            for chunk in e.produce():
                if chunk.dtype != e.dtype:
                    raise ValueError(f"{e.name}: produced {chunk.dtype}, declared {e.dtype}")
                buf = _bytes_of(chunk)
                f.write(buf)
                written += len(buf)
                if on_bytes is not None:
                    on_bytes(len(buf))
            if written != e.nbytes:
                raise ValueError(f"{e.name}: produced {written} bytes, declared {e.nbytes} for {list(e.shape)}")
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(out_dir: Path, entries: list[Entry], max_shard_size: int,
                     on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Write all entries as HF shards (+ index) into out_dir; returns the file names."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup[:5]}")
    shards = plan_shards(entries, max_shard_size)
    if len(shards) == 1:
        write_file(out_dir / "model.safetensors", shards[0], on_bytes)
        return ["model.safetensors"]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(files, shards):
        write_file(out_dir / fname, shard, on_bytes)
        weight_map.update({e.name: fname for e in shard})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files + [INDEX_NAME]


def total_bytes(entries: list[Entry]) -> int:
    return sum(e.nbytes for e in entries)
