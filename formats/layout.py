"""Byte layout constants of FTW v1: the 64-byte index header, alignment and naming rules (specs/ftw.md)."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import xxhash

INDEX_NAME = "model.ftw"
MAGIC = b"FTW\x00\r\n\x1a\n"  # "FTW", NUL, then CR LF SUB LF: catches newline translation and text-mode reads
VERSION_MAJOR = 1
VERSION_MINOR = 0
HEADER_SIZE = 64
ALIGN = 4096  # every tensor, bank and expert record starts on a multiple of this (page / O_DIRECT size)
COMPONENT_ALIGN = 256  # components inside one expert record (vectorised GPU loads)
MAX_MANIFEST_BYTES = 64 << 20
CHECKSUM = "xxh3_64"

# <8s magic, u16 major, u16 minor, u32 header_size, u64 manifest_offset, u64 manifest_nbytes,
#  u64 manifest_xxh3, 24 reserved bytes>  -- little-endian, 64 bytes in all.
_HEADER = struct.Struct("<8sHHIQQQ24s")
assert _HEADER.size == HEADER_SIZE

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")  # used with fullmatch (`$` would allow "\n")
_DATA_FILE = re.compile(r"data-[0-9]{5,}\.ftd")
SLOT_DIRS = ("plans", "kernels")


def align_up(x: int, a: int = ALIGN) -> int:
    """The alignment formula of the spec: align(x) = ceil(x / a) * a."""
    return (x + a - 1) // a * a


def data_file_name(index: int) -> str:
    """Data file `index` of `manifest.files` is named data-NNNNN.ftd (at least 5 digits)."""
    return f"data-{index:05d}.ftd"


def is_reserved_name(name: str) -> bool:
    """Names an asset may not take: the index, a data file, or a slot directory."""
    return name == INDEX_NAME or name in SLOT_DIRS or bool(_DATA_FILE.fullmatch(name))


def xxh3_hex(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class Header:
    major: int
    minor: int
    header_size: int
    manifest_offset: int
    manifest_nbytes: int
    manifest_xxh3: int
    reserved: bytes

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.major, self.minor, self.header_size, self.manifest_offset,
                            self.manifest_nbytes, self.manifest_xxh3, self.reserved)

    @classmethod
    def for_manifest(cls, manifest: bytes) -> "Header":
        return cls(VERSION_MAJOR, VERSION_MINOR, HEADER_SIZE, HEADER_SIZE, len(manifest),
                   xxhash.xxh3_64_intdigest(manifest), bytes(24))

    @staticmethod
    def unpack(raw: bytes) -> tuple[bytes, "Header"]:
        magic, *rest = _HEADER.unpack(raw[:HEADER_SIZE])
        return magic, Header(*rest)


def is_safe_name(name: str, *, allow_slot_dir: bool = False) -> bool:
    """A plain file name, or `plans/NAME` / `kernels/NAME` for slot entries: no separators, no `..`."""
    if not isinstance(name, str):
        return False
    if allow_slot_dir and "/" in name:
        head, _, tail = name.partition("/")
        return head in SLOT_DIRS and bool(_SAFE_NAME.fullmatch(tail)) and ".." not in tail
    return bool(_SAFE_NAME.fullmatch(name)) and ".." not in name
