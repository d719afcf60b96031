"""Prebuilt GPU kernels: the container stored as a `kernels/<name>` entry of an FTW (specs/ftw.md §5.7).

One container holds the kernels of one Triton build for one GPU architecture, as entries of Triton's own on-disk
cache: per compiled kernel its cache key (the sha256 Triton files it under), its name, the runtime function it was
compiled from with that function's source key, and two files, `<name>.json` (Triton's metadata) and `<name>.cubin`;
and (version 2) the host launchers Triton builds with a C compiler for those kernels, each a Python extension module
under its own cache key, valid for one Python ABI (`python`: the interpreter's extension suffix) and platform.

    magic "FTKERNEL" | u32 version | u32 reserved (0) | u64 index_nbytes | index (JSON, UTF-8) | blobs

All integers little-endian. The index says which Triton and target the kernels are for and where each file's bytes
lie in the blob area (offset from its start, size, xxh3-64); the blobs tile that area exactly, in index order (per
kernel: json, then cubin; then the launchers). A reader checks every name, range and digest before any byte is used,
and reading runs nothing. The cubins run on the GPU and the launchers on the host once Triton loads them, which is
why the runtime installs them only when trusted (`kernel_trust`). Version 1 (no launchers) is still read.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field

from .errors import FtwKernelsError as KernelContainerError
from .layout import xxh3_hex

MAGIC = b"FTKERNEL"
VERSION = 2
VERSIONS = (1, 2)  # read; VERSION is written
HEADER = struct.Struct("<8sIIQ")
MAX_INDEX_BYTES = 16 << 20
MAX_KERNELS = 65536
EXTENSIONS = ("json", "cubin")  # the files of one kernel, in blob order
LAUNCHER_MODULES = ("__triton_launcher", "cuda_utils")  # Triton's per-signature launcher, its CUDA utilities module
MAX_LAUNCHERS = 65536

_HASH = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_FUNCTION = re.compile(r"ft\.runtime\.gpu\.(?:(?:kernels|cpu)\.)?[a-z0-9_]{1,64}\.[A-Za-z_][A-Za-z0-9_]{0,127}")
_VERSION = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_ENV_NAME = re.compile(r"[A-Z0-9_]{1,128}")
_SUFFIX = re.compile(r"\.[A-Za-z0-9_.-]{1,63}")  # an extension suffix, e.g. .cpython-312-x86_64-linux-gnu.so
_PLATFORM = re.compile(r"[A-Za-z0-9_.,-]{1,128}")  # Triton's platform key, e.g. x86_64,Linux,64bit,ELF
_TOP = {"format", "version", "triton", "triton_build", "backend", "arch", "warp_size", "backend_key", "env",
        "kernels"}
_TOP2 = _TOP | {"python", "platform", "launchers"}


@dataclass(frozen=True)
class Kernel:
    """One compiled kernel: Triton's cache key, its name, the runtime function and that function's source key, and
    the bytes of `<name>.json` and `<name>.cubin`."""

    hash: str
    name: str
    function: str
    source: str
    files: dict[str, bytes] = field(repr=False)

    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())


@dataclass(frozen=True)
class Launcher:
    """One host launcher: Triton's cache key for it, the module name (LAUNCHER_MODULES) and the bytes of the
    extension module `<name><python suffix>` (native code: installed only from a trusted container)."""

    key: str
    name: str
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class KernelSet:
    """The kernels of one Triton build (`triton` version, `triton_build` = sha256 of Triton's own cache key of its
    installation) for one target (`backend`, `arch`, `warp_size`), compiled with the backend key `backend_key`
    (sha256 of what Triton's backend contributes to the cache key: ptxas' version and the arch) and the
    cache-invalidating environment `env`. `launchers` were built for the extension suffix `python` and Triton's
    platform key `platform` (both empty where none were built)."""

    triton: str
    triton_build: str
    arch: int
    backend_key: str
    kernels: tuple[Kernel, ...]
    env: dict[str, str] = field(default_factory=dict)
    backend: str = "cuda"
    warp_size: int = 32
    launchers: tuple[Launcher, ...] = ()
    python: str = ""
    platform: str = ""

    def nbytes(self) -> int:
        return sum(k.nbytes() for k in self.kernels) + sum(len(m.data) for m in self.launchers)


def entry_name(ks: KernelSet, data: bytes) -> str:
    """The plain name of a container under kernels/: Triton version, arch and a digest of its bytes (so a rebuild
    never rewrites a listed file in place)."""
    ver = re.sub(r"[^A-Za-z0-9_.-]", "_", ks.triton)
    return f"triton-{ver}-sm{ks.arch}-{hashlib.sha256(data).hexdigest()[:12]}.ftk"


def pack(ks: KernelSet) -> bytes:
    """The container's bytes; kernels sorted by (name, hash) so that the same build gives the same bytes."""
    kernels, blobs, pos = [], [], 0
    for k in sorted(ks.kernels, key=lambda k: (k.name, k.hash)):
        files = {}
        for ext in EXTENSIONS:
            data = k.files[f"{k.name}.{ext}"]
            files[f"{k.name}.{ext}"] = [pos, len(data), xxh3_hex(data)]
            blobs.append(data)
            pos += len(data)
        kernels.append({"hash": k.hash, "name": k.name, "function": k.function, "source": k.source, "files": files})
    launchers = []
    for m in sorted(ks.launchers, key=lambda m: (m.name, m.key)):
        launchers.append({"key": m.key, "name": m.name, "file": [pos, len(m.data), xxh3_hex(m.data)]})
        blobs.append(m.data)
        pos += len(m.data)
    index = {"format": "ft-kernels", "version": VERSION, "triton": ks.triton, "triton_build": ks.triton_build,
             "backend": ks.backend, "arch": ks.arch, "warp_size": ks.warp_size, "backend_key": ks.backend_key,
             "env": dict(sorted(ks.env.items())), "kernels": kernels, "python": ks.python, "platform": ks.platform,
             "launchers": launchers}
    body = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    data = HEADER.pack(MAGIC, VERSION, 0, len(body)) + body + b"".join(blobs)
    unpack(data, "<new container>")  # never write what a reader refuses
    return data


def read_index(data: bytes, where: object) -> tuple[dict, int]:
    """(index, offset of the blob area) of a container, its header and index checked (not its blobs)."""
    if len(data) < HEADER.size:
        raise KernelContainerError(where, f"{len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, reserved, n = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise KernelContainerError(where, "not a kernels container (bad magic)")
    if version not in VERSIONS or reserved:
        raise KernelContainerError(where, f"container version {version} (reserved {reserved}); this reader knows "
                                          f"versions {', '.join(map(str, VERSIONS))}")
    if n > MAX_INDEX_BYTES or HEADER.size + n > len(data):
        raise KernelContainerError(where, f"index of {n} bytes does not fit the {len(data)}-byte file (truncated?)")
    try:
        index = json.loads(data[HEADER.size:HEADER.size + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise KernelContainerError(where, f"index is not UTF-8 JSON ({type(e).__name__})") from None
    _check_index(index, version, where)
    return index, HEADER.size + n


def unpack(data: bytes, where: object) -> KernelSet:
    """Parse and check a whole container: structure, names, ranges (the blobs tile the rest of the file exactly)
    and every file's xxh3. Raises KernelContainerError naming what is wrong."""
    index, start = read_index(data, where)
    pos, kernels, seen = 0, [], set()

    def blob(what: str, off: int, nbytes: int, digest: str) -> bytes:
        if off != pos:
            raise KernelContainerError(where, f"{what}: at offset {off}, expected {pos} (blobs must follow each other "
                                              f"in index order)")
        b = data[start + off:start + off + nbytes]
        if len(b) != nbytes:
            raise KernelContainerError(where, f"{what}: {len(b)} of {nbytes} bytes (truncated)")
        if xxh3_hex(b) != digest:
            raise KernelContainerError(where, f"{what}: xxh3 {xxh3_hex(b)} != recorded {digest}")
        return bytes(b)

    for i, k in enumerate(index["kernels"]):
        if (k["hash"], k["name"]) in seen:
            raise KernelContainerError(where, f"kernel {k['name']} ({k['hash'][:12]}) is listed twice")
        seen.add((k["hash"], k["name"]))
        files = {}
        for ext in EXTENSIONS:
            fname = f"{k['name']}.{ext}"
            files[fname] = blob(f"kernel {i} file {fname}", *k["files"][fname])
            pos += len(files[fname])
        kernels.append(Kernel(k["hash"], k["name"], k["function"], k["source"], files))
    launchers, keys = [], set()
    for i, m in enumerate(index.get("launchers", [])):
        if (m["name"], m["key"]) in keys:
            raise KernelContainerError(where, f"launcher {m['name']} ({m['key'][:12]}) is listed twice")
        keys.add((m["name"], m["key"]))
        launchers.append(Launcher(m["key"], m["name"], blob(f"launcher {i}", *m["file"])))
        pos += len(launchers[-1].data)
    if start + pos != len(data):
        raise KernelContainerError(where, f"{len(data) - start - pos} bytes after the last blob")
    return KernelSet(triton=index["triton"], triton_build=index["triton_build"], arch=index["arch"],
                     backend_key=index["backend_key"], kernels=tuple(kernels), env=index["env"],
                     backend=index["backend"], warp_size=index["warp_size"], launchers=tuple(launchers),
                     python=index.get("python", ""), platform=index.get("platform", ""))


def _check_index(ix, version: int, where) -> None:
    def bad(what: str):
        return KernelContainerError(where, what)

    top = _TOP if version == 1 else _TOP2
    if not isinstance(ix, dict) or set(ix) != top:
        keys = sorted(ix) if isinstance(ix, dict) else type(ix).__name__
        raise bad(f"index keys {keys}, expected {sorted(top)}")
    if ix["format"] != "ft-kernels" or ix["version"] != version:
        raise bad(f"format {ix['format']!r} version {ix['version']!r} (header: version {version})")
    if not _str(ix["triton"], _VERSION) or not _str(ix["triton_build"], _HASH) or not _str(ix["backend_key"], _HASH):
        raise bad("triton, triton_build or backend_key is malformed")
    if ix["backend"] != "cuda" or not _int(ix["arch"], 1, 10_000) or ix["warp_size"] != 32 or isinstance(
            ix["warp_size"], bool):
        raise bad(f"target {ix['backend']!r} arch {ix['arch']!r} warp size {ix['warp_size']!r}: wants cuda, an "
                  f"arch such as 90, warp size 32")
    env = ix["env"]
    if not isinstance(env, dict) or not all(_str(k, _ENV_NAME) and isinstance(v, str) and len(v) <= 4096
                                            for k, v in env.items()):
        raise bad("env is not an object of environment variable names to strings")
    kernels = ix["kernels"]
    if not isinstance(kernels, list) or len(kernels) > MAX_KERNELS:
        raise bad(f"kernels is not a list of at most {MAX_KERNELS} entries")
    for i, k in enumerate(kernels):
        if not isinstance(k, dict) or set(k) != {"hash", "name", "function", "source", "files"}:
            raise bad(f"kernel {i}: wants exactly hash, name, function, source, files")
        if not _str(k["hash"], _HASH) or not _str(k["name"], _NAME):
            raise bad(f"kernel {i}: hash must be 64 lowercase hex digits and name an identifier of at most 128 "
                      f"characters, got {str(k['hash'])[:80]!r} / {str(k['name'])[:80]!r}")
        if not _str(k["function"], _FUNCTION) or not isinstance(k["source"], str) or not 0 < len(k["source"]) <= 256:
            raise bad(f"kernel {i} ({k['name']}): function must name a kernel of ft.runtime.gpu, source a key of at "
                      f"most 256 characters")
        files = k["files"]
        want = [f"{k['name']}.{ext}" for ext in EXTENSIONS]
        if not isinstance(files, dict) or set(files) != set(want):
            raise bad(f"kernel {i} ({k['name']}): files must be exactly {want}")
        for name, rec in files.items():
            if not _blob(rec):
                raise bad(f"kernel {i} file {name}: wants [offset, nbytes, xxh3 hex]")
    if version > 1:
        _check_launchers(ix, bad)


def _check_launchers(ix, bad) -> None:
    launchers = ix["launchers"]
    if not isinstance(launchers, list) or len(launchers) > MAX_LAUNCHERS:
        raise bad(f"launchers is not a list of at most {MAX_LAUNCHERS} entries")
    if launchers and not (_str(ix["python"], _SUFFIX) and _str(ix["platform"], _PLATFORM)):
        raise bad(f"launchers need python (an extension suffix such as .cpython-312-x86_64-linux-gnu.so) and platform "
                  f"(such as x86_64,Linux,64bit,ELF), got {str(ix['python'])[:80]!r} / {str(ix['platform'])[:80]!r}")
    if not launchers and (ix["python"], ix["platform"]) != ("", ""):
        raise bad("python and platform are empty strings when there are no launchers")
    for i, m in enumerate(launchers):
        if not isinstance(m, dict) or set(m) != {"key", "name", "file"}:
            raise bad(f"launcher {i}: wants exactly key, name, file")
        if not _str(m["key"], _HASH) or m["name"] not in LAUNCHER_MODULES or not _blob(m["file"]):
            raise bad(f"launcher {i}: key must be 64 lowercase hex digits, name one of {LAUNCHER_MODULES}, file "
                      f"[offset, nbytes, xxh3 hex]")


def _blob(rec) -> bool:  # [offset, nbytes, xxh3 hex]
    return (isinstance(rec, list) and len(rec) == 3 and _int(rec[0], 0, 1 << 40) and _int(rec[1], 0, 1 << 32)
            and isinstance(rec[2], str) and re.fullmatch(r"[0-9a-f]{16}", rec[2]) is not None)


def _str(v, pattern: re.Pattern) -> bool:
    return isinstance(v, str) and pattern.fullmatch(v) is not None


def _int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def describe(ftw) -> list[dict]:
    """One summary per kernels/ entry of the FTW at `ftw`: name, arch, Triton version, kernel count, bytes, and
    whether this machine trusts it (`trusted`: how, or None) — or `error` where its index cannot be read."""
    from pathlib import Path

    from .errors import FtwError
    from .kernel_trust import digest, trusted
    from .reader import FtwReader

    r = ftw if isinstance(ftw, FtwReader) else FtwReader(Path(ftw), checksums="off")
    out = []
    for entry in r.records.slots["kernels"]:
        path = r.path / entry.name
        try:
            data = path.read_bytes()
            ix, _ = read_index(data, path)
        except (OSError, FtwError) as e:
            out.append({"name": entry.name, "nbytes": entry.nbytes, "error": str(e)})
            continue
        out.append({"name": entry.name, "arch": ix["arch"], "triton": ix["triton"], "kernels": len(ix["kernels"]),
                    "launchers": len(ix.get("launchers", [])), "nbytes": entry.nbytes,
                    "trusted": trusted(digest(data))})
    return out
