"""Bundles (`ft.formats.bundle`, `ft.formats.trust`): pack -> unpack is byte-identical and verifies; an interrupted
unpack resumes; every hostile bundle is refused with its own error before anything lands outside the target."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.formats import bundle, trust
from ft.formats.bundle import TRAILER, BundleError
from ft.formats.bundle_safety import file_digest
from ft.formats import FtwReader
from ft.formats.verify import verify_all

CHUNK = 64 << 10  # small chunks: several per data file


@pytest.fixture(scope="module")
def ftw(ftw_for) -> Path:
    return ftw_for("qwen3_moe", "nvfp4")


@pytest.fixture()
def packed(ftw, tmp_path) -> Path:
    out = tmp_path / "m.ftb"
    bundle.pack(ftw, out, chunk_size=CHUNK, threads=2)
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".ft-verified"}  # a machine-local note, not part of the FTW


def _rewrite(src: Path, dst: Path, edit=None, *, chunks: bytes | None = None, sig: bytes = b"") -> Path:
    """A copy of bundle `src` with its manifest passed through `edit` (and optionally other chunk bytes)."""
    manifest, body, _ = bundle.read_manifest(src)
    data = src.read_bytes()[:TRAILER.unpack(src.read_bytes()[-TRAILER.size:])[0]] if chunks is None else chunks
    if edit is not None:
        edit(manifest)
        body = json.dumps(manifest).encode()
    dst.write_bytes(data + body + sig + TRAILER.pack(len(data), len(body), len(sig), bundle.VERSION, 0, bundle.MAGIC))
    return dst


def test_pack_unpack_is_byte_identical_and_verifies(ftw, packed, tmp_path):
    manifest = bundle.unpack(packed, tmp_path / "out", threads=2)
    assert _files(tmp_path / "out") == _files(ftw)
    assert verify_all(FtwReader(tmp_path / "out")) == []
    kinds = bundle.sizes_by_kind(manifest)
    assert {"dense", "meta"} <= kinds.keys()  # the tiny model's one data file is mostly dense tensors
    assert sum(k["plain"] for k in kinds.values()) == sum(len(b) for b in _files(ftw).values())
    assert bundle.verify(packed)["files"] == manifest["files"]
    assert not list(tmp_path.glob("*.tmp"))


def test_an_interrupted_unpack_resumes_and_repairs(ftw, packed, tmp_path):
    out = tmp_path / "out"
    manifest = bundle.unpack(packed, out)
    data = next(e["path"] for e in manifest["files"] if e["path"].startswith("data-"))
    blob = (out / data).read_bytes()
    (out / data).unlink()  # as if killed while writing it: half a .part file, one chunk of it damaged
    (out / (data + ".part")).write_bytes(blob[:len(blob) // 2] + b"\0" * 100)
    (out / "model.ftw").unlink()  # and before another file was written at all
    bundle.unpack(packed, out)
    assert _files(out) == _files(ftw)


def test_pack_refuses_links_and_non_ftw_directories(ftw, tmp_path):
    with pytest.raises(BundleError, match="not an FTW"):
        bundle.pack(tmp_path, tmp_path / "x.ftb")
    copy = tmp_path / "copy.ftw"
    copy.mkdir()
    for name, blob in _files(ftw).items():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(blob)
    (copy / "evil").symlink_to("/etc/passwd")
    with pytest.raises(BundleError, match="regular files"):
        bundle.pack(copy, tmp_path / "x.ftb")


def _path_edit(path):
    def edit(m):
        m["files"][0]["path"] = path
    return edit


def _dup(m):
    m["files"][1]["path"] = m["files"][0]["path"]


def _swap_chunks(m):
    e = next(e for e in m["files"] if len(e["chunks"]) > 1)
    e["chunks"][0], e["chunks"][1] = e["chunks"][1], e["chunks"][0]


def _bad_sha(m):  # a consistent manifest whose chunk digest does not match the chunk
    e = m["files"][0]
    e["chunks"][0][3] = "0" * 64
    e["sha256"] = file_digest(e["chunks"])


def _bad_file_sha(m):
    m["files"][0]["sha256"] = "0" * 64


def _other_kind(m):
    m["files"][0]["kind"] = "plans"


def _bigger_chunk(m):
    m["files"][-1]["chunks"][0][2] = 1 << 31


@pytest.mark.parametrize("edit,error", [
    (_path_edit("../escape"), "unsafe path"),
    (_path_edit("/tmp/escape"), "unsafe path"),
    (_path_edit("a/./b"), "unsafe path"),
    (_dup, "appears twice"),
    (_swap_chunks, "back to back"),
    (_bigger_chunk, "declares"),
    (_bad_file_sha, "chunks' digests"),
    (_bad_sha, "sha256"),
])
def test_hostile_manifests_are_refused_before_anything_is_written(packed, tmp_path, edit, error):
    evil = _rewrite(packed, tmp_path / "evil.ftb", edit)
    out = tmp_path / "box" / "out"
    with pytest.raises(BundleError, match=error):
        bundle.unpack(evil, out)
    assert not (tmp_path / "escape").exists() and not Path("/tmp/escape").exists()
    # a bad manifest stops before the target exists; a content mismatch leaves only `.part` files inside it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.ftb", "evil.ftb"] + ["box"] * (error == "sha256"))
    if error == "sha256":
        assert [p.suffix for p in out.iterdir()] == [".part"]


@pytest.mark.parametrize("frame_size,error", [(True, "decompression bomb"), (False, "declared")])
def test_a_decompression_bomb_stops_at_its_declared_size(packed, tmp_path, frame_size, error):
    """8 MiB of zeros in a few hundred bytes, with or without its size in the zstd frame: refused from the frame
    header before anything is allocated, or when the output passes the manifest's size."""
    bomb = zstandard.ZstdCompressor(write_content_size=frame_size).compress(b"\0" * (8 << 20))

    def edit(m):  # a consistent manifest (its hashes are the bomb's) with a small declared size per chunk
        offset = 0
        for e in m["files"]:
            for c in e["chunks"]:
                c[0], c[1], c[3] = offset, len(bomb), hashlib.sha256(bomb).hexdigest()
                offset += len(bomb)
            e["sha256"] = file_digest(e["chunks"])
    manifest, _, _ = bundle.read_manifest(packed)
    n = sum(len(e["chunks"]) for e in manifest["files"])
    evil = _rewrite(packed, tmp_path / "bomb.ftb", edit, chunks=bomb * n)
    with pytest.raises(BundleError, match=error):
        bundle.unpack(evil, tmp_path / "out")


def test_truncated_and_foreign_files_are_refused(packed, tmp_path):
    cut = tmp_path / "cut.ftb"
    cut.write_bytes(packed.read_bytes()[:-100])
    with pytest.raises(BundleError, match="truncated"):
        bundle.read_manifest(cut)
    (tmp_path / "short.ftb").write_bytes(b"FT")
    with pytest.raises(BundleError, match="too short"):
        bundle.read_manifest(tmp_path / "short.ftb")
    damaged = tmp_path / "damaged.ftb"
    blob = bytearray(packed.read_bytes())
    blob[100] ^= 0xFF  # inside the first chunk
    damaged.write_bytes(bytes(blob))
    with pytest.raises(BundleError, match="chunk at 0"):
        bundle.verify(damaged)


def test_unpack_never_writes_through_a_symlink_nor_into_a_used_directory(packed, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    with pytest.raises(BundleError, match="symlink"):
        bundle.unpack(packed, tmp_path / "link")
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="not empty"):
        bundle.unpack(packed, used)
    assert list(outside.iterdir()) == [] and [p.name for p in used.iterdir()] == ["notes.txt"]


def test_a_full_disk_is_refused_before_writing(packed, tmp_path, monkeypatch):
    class Tiny:
        f_bavail, f_frsize = 1, 4096
    monkeypatch.setattr(bundle.os, "statvfs", lambda _: Tiny)
    with pytest.raises(BundleError, match="free"):
        bundle.unpack(packed, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_signatures_vouch_for_the_manifest(ftw, tmp_path):
    key = tmp_path / "key"
    pub = trust.keygen(key)
    assert (tmp_path / "key.pub").read_text().strip() == pub and oct(key.stat().st_mode & 0o777) == "0o600"
    signed = tmp_path / "s.ftb"
    bundle.pack(ftw, signed, chunk_size=CHUNK, signer=trust.Signer(key))
    _, body, sig = bundle.read_manifest(signed)
    assert trust.check(body, sig, set()) is None  # signed, but by a key this machine does not trust
    store = tmp_path / "trusted_keys"
    trust.add(pub, store)
    assert trust.check(body, sig, trust.trusted_keys(store)) == pub
    tampered = _rewrite(signed, tmp_path / "t.ftb", _other_kind, sig=json.dumps(sig).encode())
    _, body2, sig2 = bundle.read_manifest(tampered)
    with pytest.raises(trust.TrustError, match="does not verify"):
        trust.check(body2, sig2, {pub})
    with pytest.raises(trust.TrustError, match="64 hex"):
        trust.add("abc", store)
    with pytest.raises(FileExistsError):
        trust.keygen(key)  # never overwrites a key


def test_unpack_writes_no_temporary_files_outside_its_target(packed, tmp_path):
    before = set(os.listdir(tmp_path))
    bundle.unpack(packed, tmp_path / "out")
    assert set(os.listdir(tmp_path)) - before == {"out"}
    assert not [p for p in (tmp_path / "out").rglob("*.part")]


_leaf = st.none() | st.booleans() | st.integers(-2, 2**40) | st.floats(allow_nan=True) | st.text(max_size=8)
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=st.sampled_from(["top", "file", "chunk"]), value=_json, raw=st.binary(max_size=64))
def test_any_manifest_is_refused_with_a_bundle_error_or_read(packed, tmp_path, edit, value, raw):
    """Arbitrary JSON (or bytes) in place of the manifest, a file entry or a chunk entry: read_manifest either accepts
    it or raises BundleError, never anything else."""
    manifest, body, _ = bundle.read_manifest(packed)
    data = packed.read_bytes()[:TRAILER.unpack(packed.read_bytes()[-TRAILER.size:])[0]]
    if edit == "top":
        new = json.dumps(value).encode() if value is not None else raw
    else:
        m = json.loads(body)
        if edit == "file":
            m["files"][0] = value
        else:
            m["files"][0]["chunks"][0] = value
        new = json.dumps(m).encode()
    path = tmp_path / "fuzz.ftb"
    path.write_bytes(data + new + TRAILER.pack(len(data), len(new), 0, bundle.VERSION, 0, bundle.MAGIC))
    try:
        bundle.read_manifest(path)
    except BundleError:
        pass


def test_absurdly_nested_json_is_a_bundle_error(packed, tmp_path):
    data = packed.read_bytes()[:TRAILER.unpack(packed.read_bytes()[-TRAILER.size:])[0]]
    new = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / "deep.ftb").write_bytes(data + new + TRAILER.pack(len(data), len(new), 0, bundle.VERSION, 0,
                                                                    bundle.MAGIC))
    with pytest.raises(BundleError, match="not valid JSON"):
        bundle.read_manifest(tmp_path / "deep.ftb")
