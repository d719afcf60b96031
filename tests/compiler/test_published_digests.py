"""Provenance takes the sha256 a Hugging Face download recorded for a weight file (hub cache blob names,
`hf download --local-dir` metadata) instead of hashing the file, only where the record is one and still holds."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from ft.compiler import compile_checkpoint
from ft.compiler.metadata import published_sha256
from ft.formats import FtwReader

SHA = "0123456789abcdef" * 4


def _local_dir(tmp_path: Path, etag: str, stamp_offset: float) -> Path:
    root = tmp_path / "local"
    (root / ".cache" / "huggingface" / "download").mkdir(parents=True)
    f = root / "model.safetensors"
    f.write_bytes(b"weights")
    meta = root / ".cache" / "huggingface" / "download" / "model.safetensors.metadata"
    meta.write_text(f"{'c' * 40}\n{etag}\n{f.stat().st_mtime + stamp_offset}\n")
    return root


def test_hub_cache_links_give_the_blob_name_when_it_is_a_sha256(tmp_path: Path) -> None:
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / ("r" * 40)
    blobs.mkdir()
    snap.mkdir(parents=True)
    for name, blob in (("model.safetensors", SHA), ("config.json", "d" * 40)):  # LFS: sha256; git files: sha1
        (blobs / blob).write_bytes(b"x")
        os.symlink(Path("..") / ".." / "blobs" / blob, snap / name)
    (snap / "plain.safetensors").write_bytes(b"y")
    assert published_sha256(snap, "model.safetensors") == SHA
    assert published_sha256(snap, "config.json") is None
    assert published_sha256(snap, "plain.safetensors") is None
    assert published_sha256(snap, "missing.safetensors") is None


def test_local_dir_metadata_counts_only_while_the_file_is_unchanged(tmp_path: Path) -> None:
    assert published_sha256(_local_dir(tmp_path / "1", SHA, 0.0), "model.safetensors") == SHA
    assert published_sha256(_local_dir(tmp_path / "2", SHA, -5.0), "model.safetensors") is None  # modified since
    assert published_sha256(_local_dir(tmp_path / "3", '"' + "e" * 40 + '"', 0.0), "model.safetensors") is None
    broken = _local_dir(tmp_path / "4", SHA, 0.0)
    (broken / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").write_text("only one line\n")
    assert published_sha256(broken, "model.safetensors") is None


def test_a_compile_from_a_hub_cache_records_the_published_digests(hf_for, tmp_path: Path) -> None:
    """The tiny checkpoint laid out as a hub cache snapshot: weight files are links to blobs named by a sha256,
    which provenance records as it is (here not the bytes' own: the files were not hashed); other files are hashed
    as before."""
    src = hf_for("qwen3_moe")
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    published = {}
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        if f.suffix == ".safetensors":
            digest = published[f.name] = hashlib.sha256(f.name.encode()).hexdigest()
            shutil.copy(f, blobs / digest)
            os.symlink(Path("..") / ".." / "blobs" / digest, snap / f.name)
        else:
            shutil.copy(f, snap / f.name)
    assert published
    files = FtwReader(compile_checkpoint(snap, tmp_path / "m.ftw")).provenance["files"]
    assert {n: files[n] for n in published} == published
    assert files["config.json"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
