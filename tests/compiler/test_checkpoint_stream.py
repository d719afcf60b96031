"""The single-pass source reader: tensors served in any order equal the file's bytes, every weight file's sha256 is
that of its bytes, whatever the window size; it falls back to buffered reads where O_DIRECT is refused and fails
loudly on a file that shrinks under it."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ft.compiler.source_pass as source_pass
from ft.compiler.errors import CheckpointError
from ft.compiler.safetensors_io import read_header
from ft.compiler.source_stream import SourceStream


def _files(d: Path) -> tuple[list[str], dict[str, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for f, n in (("a.safetensors", 40), ("b.safetensors", 25)):
        # sizes straddle chunk boundaries: 1 byte to ~50 KB, several dtypes
        tensors[f] = {f"{f[0]}.{i:03d}": torch.randint(0, 255, (int(torch.randint(1, 50_000, (1,), generator=g)),),
                                                        dtype=torch.uint8, generator=g).view(torch.uint8)
                      for i in range(n)}
        tensors[f][f"{f[0]}.bf16"] = torch.randn(33, 17, generator=g).to(torch.bfloat16)
        save_file(tensors[f], d / f)
    return list(tensors), tensors


def _run(d: Path, names: list[str], tensors, order_seed: int, **kw) -> SourceStream:
    infos = {n: i for f in names for n, i in read_header(d / f).items()}
    order = sorted(infos)
    random.Random(order_seed).shuffle(order)
    s = SourceStream(d, names, **kw)
    s.expect([infos[n] for n in order])
    want = {n: t for f in names for n, t in tensors[f].items()}
    for n in order + order[:5]:  # re-reads (outside the plan) come last
        got = s.read(n, infos[n])
        assert got.dtype == want[n].dtype and torch.equal(got, want[n]), n
    big = max(order, key=lambda n: infos[n].nbytes)
    rows = s.read(big, infos[big], (1, 3))
    assert torch.equal(rows, want[big][1:3])
    digests = s.digests()
    assert digests == {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in names}
    s.stop()
    return s


@pytest.mark.parametrize("window,chunk,seed", [(64 << 20, 8 << 20, 1), (3 * 8192, 8192, 2), (8 * 4096, 4096, 3)])
def test_any_order_any_window(tmp_path: Path, window: int, chunk: int, seed: int) -> None:
    names, tensors = _files(tmp_path)
    s = _run(tmp_path, names, tensors, seed, window=window, chunk=chunk, big=window // 2)
    if window < 1 << 20:  # a tiny window cannot hold a shuffled plan: some reads went direct, still exact
        assert s.direct_bytes > 0


def test_in_order_plan_reads_once(tmp_path: Path) -> None:
    names, tensors = _files(tmp_path)
    infos = {n: i for f in names for n, i in read_header(tmp_path / f).items()}
    order = sorted(infos, key=lambda n: (names.index(infos[n].path.name), infos[n].begin))
    s = SourceStream(tmp_path, names, window=12 * 8192, chunk=8192)  # > the largest tensor + 1 chunk
    s.expect([infos[n] for n in order])
    for n in order:
        s.read(n, infos[n])
    s.digests()
    assert s.direct_bytes == 0  # file order plan: every byte came from the single pass


def test_falls_back_when_o_direct_refused(tmp_path: Path, monkeypatch) -> None:
    names, tensors = _files(tmp_path)
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    _run(tmp_path, names, tensors, 4, window=3 * 8192, chunk=8192)


def test_truncated_file_is_an_error(tmp_path: Path) -> None:
    names, _ = _files(tmp_path)
    infos = read_header(tmp_path / names[0])
    s = SourceStream(tmp_path, names, chunk=4096, window=4 * 4096)
    os.truncate(tmp_path / names[0], 20_000)  # shrinks after the sizes were taken
    s.expect(list(infos.values()))
    with pytest.raises(CheckpointError, match="a.safetensors"):
        for n, i in infos.items():
            s.read(n, i)
        s.digests()
    s.stop()


def test_stop_before_the_end(tmp_path: Path) -> None:
    names, _ = _files(tmp_path)
    infos = read_header(tmp_path / names[0])
    s = SourceStream(tmp_path, names, chunk=4096, window=2 * 4096)
    s.expect(list(infos.values()))
    s.stop()  # returns (the reader is blocked on a full window of pinned chunks)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_verify_reads_uncached_output_from_disk(tmp_path: Path) -> None:
    """The final verify's O_DIRECT path (pages not cached) reads the same bytes, and finds a flipped byte."""
    from ftw_testlib import small_ftw

    from ft.formats import FtwReader

    out = small_ftw(tmp_path / "m.ftw")
    data = out / "data-00000.ftd"
    _drop_cache(data)
    assert FtwReader(out).verify() == []
    with open(data, "r+b") as f:
        f.seek(4096)  # first byte of tensor t.bf16
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0xFF]))
    _drop_cache(data)
    failures = FtwReader(out).verify()
    assert len(failures) == 1 and "t.bf16" in str(failures[0])


def test_read_many_equals_single_reads(tmp_path: Path) -> None:
    """Groups of neighbouring planned tensors come out of one window copy, exactly; groups that cannot (spread out,
    across files, outside the plan) are declined and read one by one."""
    names, tensors = _files(tmp_path)
    infos = {n: i for f in names for n, i in read_header(tmp_path / f).items()}
    order = sorted(infos, key=lambda n: (names.index(infos[n].path.name), infos[n].begin))
    want = {n: t for f in names for n, t in tensors[f].items()}
    s = SourceStream(tmp_path, names, window=64 * 8192, chunk=8192, big=32 * 8192)
    s.expect([infos[n] for n in order])
    a = [n for n in order if infos[n].path.name == "a.safetensors"]
    assert s.read_many([(n, infos[n]) for n in (a[0], a[5])]) is None  # spread out: declined
    assert s.read_many([(n, infos[n]) for n in (a[-1], order[len(a)])]) is None  # two files: declined
    grouped = 0
    for k in range(0, len(order), 3):
        group = [n for n in order[k:k + 3] if infos[n].path == infos[order[k]].path]
        got = s.read_many([(n, infos[n]) for n in group])
        grouped += got is not None
        if got is None:
            got = [s.read(n, infos[n]) for n in group]
        for n, t in zip(group, got):
            assert t.dtype == want[n].dtype and torch.equal(t, want[n]), n
    s.digests()
    assert grouped >= len(order) // 3 - 1 and s.direct_bytes == 0  # (the group that straddles the files reads singly)
    s.stop()


def _wait_read(s: SourceStream, fi: int, chunks: int) -> None:
    deadline = time.monotonic() + 30
    while s._read_upto[fi] < chunks and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s._read_upto[fi] == chunks


@pytest.mark.parametrize("first", ["a.safetensors", "b.safetensors"])
def test_prefetch_before_the_plan(tmp_path: Path, first: str) -> None:
    """Started early on the plan's first file, every tensor is served from the pass, big ones included (none is
    read twice); started on another file (a wrong guess), every tensor and digest is still exact."""
    names, tensors = _files(tmp_path)
    infos = {n: i for f in names for n, i in read_header(tmp_path / f).items()}
    order = sorted(infos, key=lambda n: (names.index(infos[n].path.name), infos[n].begin))  # a first
    want = {n: t for f in names for n, t in tensors[f].items()}
    big = 16 << 10
    s = SourceStream(tmp_path, names, window=8 * 4096, chunk=4096, big=big)
    s.prefetch(first, early=4 << 20)  # the whole early file fits
    fi = names.index(first)
    _wait_read(s, fi, -(-(tmp_path / first).stat().st_size // 4096))
    s.expect([infos[n] for n in order])
    for n in order:
        got = s.read(n, infos[n])
        assert got.dtype == want[n].dtype and torch.equal(got, want[n]), n
    assert s.digests() == {f: hashlib.sha256((tmp_path / f).read_bytes()).hexdigest() for f in names}
    if first == "a.safetensors":  # the early file leads the plan: a's and b's big tensors came from the pass
        assert s.direct_bytes == 0 and s.pass_bytes == sum(s.sizes)
    s.stop()


def test_published_digests_are_taken_not_hashed(tmp_path: Path) -> None:
    """A file whose hub-published sha256 is given is read for the compile (every read exact, its chunks evicted once
    served: a window of three chunks suffices) but not hashed: its digest is the published one, the others' their
    own."""
    names, tensors = _files(tmp_path)
    published = {"a.safetensors": "ab" * 32}
    infos = {n: i for f in names for n, i in read_header(tmp_path / f).items()}
    order = sorted(infos, key=lambda n: (names.index(infos[n].path.name), infos[n].begin))
    s = SourceStream(tmp_path, names, window=3 * 8192, chunk=8192, big=8192, published=published)
    s.expect([infos[n] for n in order])
    want = {n: t for f in names for n, t in tensors[f].items()}
    for n in order:
        assert torch.equal(s.read(n, infos[n]), want[n]), n
    assert s.digests() == {"a.safetensors": "ab" * 32,
                           "b.safetensors": hashlib.sha256((tmp_path / "b.safetensors").read_bytes()).hexdigest()}
    s.stop()


def test_the_next_file_is_hashed_beside_this_one(tmp_path: Path, monkeypatch) -> None:
    """sha256 threads take the weight files in turns: with a hash slower than the disk, the second file's chunks are
    hashed while the first file's still are, and each digest is still its own file's."""
    names, tensors = _files(tmp_path)
    lock, active, peak = threading.Lock(), [0], [0]

    class Slow:  # sha256 at ~4 MB/s: 2 ms per 8 KiB chunk
        def __init__(self) -> None:
            self.h = hashlib.sha256()

        def update(self, b) -> None:
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.002)
            self.h.update(b)
            with lock:
                active[0] -= 1

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    monkeypatch.setattr(source_pass, "hashlib", types.SimpleNamespace(sha256=Slow))
    _read_in_file_order(tmp_path, names, tensors, window=4 << 20, chunk=8192, big=1 << 20)
    assert peak[0] == source_pass.HASHERS == 2


def _read_in_file_order(d: Path, names: list[str], tensors, made=None, **kw) -> SourceStream:
    """Every tensor read in file order through a stream of `kw` (`made(stream)` before its pass starts), each equal
    to the file's, and every digest its file's sha256; the stream stopped."""
    infos = {n: i for f in names for n, i in read_header(d / f).items()}
    order = sorted(infos, key=lambda n: (names.index(infos[n].path.name), infos[n].begin))
    s = SourceStream(d, names, **kw)
    if made is not None:
        made(s)
    s.expect([infos[n] for n in order])
    want = {n: t for f in names for n, t in tensors[f].items()}
    for n in order:
        assert torch.equal(s.read(n, infos[n]), want[n]), n
    assert s.digests() == {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in names}
    s.stop()
    return s


@pytest.mark.parametrize("lag", [0, 4 << 20])
def test_the_reader_runs_ahead_of_a_lagging_hash(tmp_path: Path, monkeypatch, lag: int) -> None:
    """Chunks the compile is done with wait only for their hash within `lag` bytes: the first file's sha256 thread
    holds still until the pass has read every byte of both files. With no lag the window (2 chunks) stops the reader
    first, and the first file's hash waits in vain."""
    names, tensors = _files(tmp_path)
    total = sum((tmp_path / f).stat().st_size for f in names)
    streams: list[SourceStream] = []
    waited: list[bool] = []

    class Held:  # the first sha256 thread's first chunk waits (up to 3 s) for the pass to read everything
        def __init__(self) -> None:
            self.h = hashlib.sha256()

        def update(self, b) -> None:
            if threading.current_thread().name == "ft-sha256-0" and not waited:
                t0 = time.monotonic()
                while streams[0].pass_bytes < total and time.monotonic() - t0 < 3:
                    time.sleep(0.002)
                waited.append(streams[0].pass_bytes == total)
            self.h.update(b)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    monkeypatch.setattr(source_pass, "hashlib", types.SimpleNamespace(sha256=Held))
    s = _read_in_file_order(tmp_path, names, tensors, streams.append, window=2 * 8192, chunk=8192, big=1 << 20,
                            hold=8192, lag=lag)
    assert waited == [lag >= total]
    assert s.peak_held <= 2 * 8192 + 8192 + lag
