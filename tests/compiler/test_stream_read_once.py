"""Every source byte is read from disk once, whatever the tensor size: a fused expert layout (down_proj [E, H, I]
stored before gate_up_proj [E, 2I, H], both larger than the window, read one expert at a time, interleaved) is
served from the single pass; every read the stream makes is counted through an injected `pread_full`."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ft.compiler.byte_io as byte_io
import ft.compiler.source_pass as source_pass
from ft.compiler.safetensors_io import read_header
from ft.compiler.source_stream import SourceStream

E, H, I = 8, 64, 32  # bf16: down 32 KiB, gate_up 64 KiB; chunks of 4 KiB, a window of 4 chunks
CHUNK = 4096


@pytest.fixture
def disk_reads(monkeypatch) -> Counter:
    """(file name, byte offset) -> how many times the stream read that byte from disk (pass and direct reads)."""
    seen: Counter = Counter()
    real = byte_io.pread_full

    def counting(fd, buf, offset, want, path):
        n = real(fd, buf, offset, want, path)
        seen.update((path.name, o) for o in range(offset, offset + n))
        return n

    monkeypatch.setattr(byte_io, "pread_full", counting)
    monkeypatch.setattr(source_pass, "pread_full", counting)
    return seen


def _fused(d: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    g = torch.Generator().manual_seed(0)
    t = {"lm_head.weight": torch.randn(96, H, generator=g).to(torch.bfloat16),  # 12 KiB, first in file, planned last
         "model.embed_tokens.weight": torch.randn(96, H, generator=g).to(torch.bfloat16),
         "model.layers.0.mlp.experts.down_proj": torch.randn(E, H, I, generator=g).to(torch.bfloat16),
         "model.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16),
         "model.layers.0.mlp.gate.weight": torch.randn(E, H, generator=g).to(torch.bfloat16),
         "model.norm.weight": torch.randn(H, generator=g)}
    save_file(t, d / "model.safetensors")  # safetensors sorts the names: lm_head, embed, down, gate_up, ...
    return t, ["model.safetensors"]


def _compile_like(d: Path, t: dict[str, torch.Tensor], names: list[str], **kw) -> SourceStream:
    """The compile's order: embedding, router, the bank expert by expert (gate_up[e] then down[e]), norm, lm_head."""
    infos = read_header(d / names[0])
    gu, dn = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    plan = ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", gu, dn, "model.norm.weight",
            "lm_head.weight"]
    s = SourceStream(d, names, chunk=CHUNK, lag=0, **kw)  # the budgets asserted: no hash lag on top
    s.expect([infos[n] for n in plan])
    for n in plan[:2]:
        assert torch.equal(s.read(n, infos[n]), t[n])
    for e in range(E):
        for n in (gu, dn):
            assert torch.equal(s.read(n, infos[n], (e, e + 1)), t[n][e:e + 1]), (n, e)
    for n in plan[4:]:
        assert torch.equal(s.read(n, infos[n]), t[n])
    assert s.digests() == {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in names}
    s.stop()
    return s


def test_fused_bank_is_read_once(tmp_path: Path, disk_reads: Counter) -> None:
    t, names = _fused(tmp_path)
    size = (tmp_path / names[0]).stat().st_size
    window, hold = 4 * CHUNK, 48 * CHUNK  # hold: down (8 chunks) + lm_head (3) + gate_up streaming by
    s = _compile_like(tmp_path, t, names, window=window, big=2 * CHUNK, hold=hold)
    assert s.direct_bytes == 0 and s.pass_bytes == size
    assert set(disk_reads.values()) == {1} and len(disk_reads) == size  # each byte of the file, once
    assert s.peak_held <= window + hold


def test_small_hold_drops_what_is_needed_last(tmp_path: Path, disk_reads: Counter) -> None:
    """`hold` smaller than down_proj: still exact; memory stays within the budgets; the bytes read twice are the
    dropped chunks (lm_head's first, it is needed last; then down_proj's tail) and the router (filed after the
    bank, read before it), far fewer than the fused tensors."""
    t, names = _fused(tmp_path)
    size = (tmp_path / names[0]).stat().st_size
    window, hold = 4 * CHUNK, 5 * CHUNK
    s = _compile_like(tmp_path, t, names, window=window, big=2 * CHUNK, hold=hold)
    assert s.peak_held <= window + hold
    fused = t["model.layers.0.mlp.experts.down_proj"].nbytes + t["model.layers.0.mlp.experts.gate_up_proj"].nbytes
    assert 0 < s.direct_bytes < fused // 2  # reading the big tensors directly (the old way) re-read all of them
    assert len(disk_reads) == size and sum(disk_reads.values()) - size < fused  # direct reads are page-aligned


def test_big_tensor_whole_streams_through_a_small_hold(tmp_path: Path, disk_reads: Counter) -> None:
    """A tensor bigger than `hold` read whole (an embedding) is copied out chunk by chunk as the pass brings it."""
    g = torch.Generator().manual_seed(1)
    t = {"a.big": torch.randn(64, 1024, generator=g).to(torch.bfloat16), "b.small": torch.randn(7, generator=g)}
    save_file(t, tmp_path / "m.safetensors")
    infos = read_header(tmp_path / "m.safetensors")
    s = SourceStream(tmp_path, ["m.safetensors"], chunk=CHUNK, window=2 * CHUNK, big=CHUNK, hold=2 * CHUNK, lag=0)
    s.expect([infos["a.big"], infos["b.small"]])
    assert torch.equal(s.read("a.big", infos["a.big"]), t["a.big"])  # 128 KiB through 4 chunks of buffers
    assert torch.equal(s.read("b.small", infos["b.small"]), t["b.small"])
    s.digests()
    s.stop()
    assert s.direct_bytes == 0 and set(disk_reads.values()) == {1} and s.peak_held <= 4 * CHUNK


@pytest.mark.parametrize("quantize", [None, "nvfp4"])
def test_compile_of_fused_experts_reads_them_once(tmp_path: Path, monkeypatch, quantize: str | None) -> None:
    """`ft checkpoint` of a fused-layout BF16 source through a window far smaller than its expert tensors: no fused
    byte is read twice, each weight file is read by the pass once, and the output is byte-identical to a compile
    with the default window (plain, and --quantize nvfp4 on 2 worker threads)."""
    import ft.compiler.checkpoint as checkpoint
    from ft.compiler import compile_checkpoint
    from ft.compiler.synth import synth
    from ft.formats.reader import STAMP_NAME

    src = synth("qwen3_5_moe", "tiny", tmp_path / "src", dtype="bf16", expert_layout="fused")
    ref = compile_checkpoint(src, tmp_path / "ref.ftw", progress=False, quantize=quantize, threads=2)
    streams, direct = [], Counter()

    class Small(SourceStream):  # fused tensors: 32 and 64 KiB, lm_head/embedding 68 KiB; a 16 KiB window
        def __init__(self, root, files, **kw):
            super().__init__(root, files, window=4 * CHUNK, chunk=CHUNK, big=2 * CHUNK, hold=48 * CHUNK, **kw)
            streams.append(self)

        def read(self, name, info, rows=None):
            d0 = self.direct_bytes
            t = super().read(name, info, rows)
            direct[name] += self.direct_bytes - d0
            return t

    monkeypatch.setattr(checkpoint, "SourceStream", Small)
    out = compile_checkpoint(src, tmp_path / "small.ftw", progress=False, quantize=quantize, threads=2)
    s = streams[0]
    assert s.pass_bytes == sum(s.sizes) and s.peak_held <= max(4 * CHUNK + 48 * CHUNK, 1536 << 20)
    # the steps run in the source's disk order (prepare._disk_order): nothing is read twice, not even the small
    # tensors a layer-by-layer order would take out of file order through this 16 KiB window
    assert s.direct_bytes == 0 and not [n for n, b in direct.items() if b]
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for n in set(names) - {STAMP_NAME}:
        assert (ref / n).read_bytes() == (out / n).read_bytes(), n


def test_a_planned_copy_leaves_the_pass_its_lock(tmp_path: Path, monkeypatch) -> None:
    """While the compile copies a planned tensor out of the window, the pass's reader and hasher can take the window's
    lock (they store and hash the next chunks meanwhile); the copied bytes are still exact."""
    import ft.compiler.source_stream as source_stream

    t, names = _fused(tmp_path)
    infos = read_header(tmp_path / names[0])
    s = SourceStream(tmp_path, names, chunk=CHUNK, window=4 * CHUNK, big=2 * CHUNK, hold=48 * CHUNK)
    free_during_copy: list[bool] = []
    real = source_stream.np.frombuffer

    def probing(buf, dtype, count, offset):  # asked from another thread: the lock is reentrant for this one
        other: list[bool] = []
        th = threading.Thread(target=lambda: other.append(s._cv.acquire(timeout=1.0) and (s._cv.release() or True)))
        th.start()
        th.join()
        free_during_copy.append(other == [True])
        return real(buf, dtype, count, offset)

    monkeypatch.setattr(source_stream.np, "frombuffer", probing)
    n = "model.embed_tokens.weight"
    s.expect([infos[n]])
    assert torch.equal(s.read(n, infos[n]), t[n])
    monkeypatch.setattr(source_stream.np, "frombuffer", real)
    s.digests()
    s.stop()
    assert free_during_copy and all(free_during_copy)


@pytest.mark.parametrize("nbytes", [1000, byte_io.COPY_PIECE * 2 - 1, byte_io.COPY_PIECE * 5 + 3])
def test_a_split_copy_writes_every_byte_once(nbytes: int) -> None:
    """copy_into splits a copy over threads from 2 pieces on: every byte lands where it belongs, the rest of the
    destination untouched."""
    import numpy as np

    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.full(nbytes + 16, 7, np.uint8)
    byte_io.copy_into(dst[8:8 + nbytes], src)
    assert np.array_equal(dst[8:8 + nbytes], src)
    assert (dst[:8] == 7).all() and (dst[8 + nbytes:] == 7).all()


def test_what_no_read_needs_is_not_read_from_a_published_file(tmp_path: Path, disk_reads: Counter) -> None:
    """A hub download's file (its published sha256 taken, not hashed): the chunks that lie wholly inside tensors the
    compile skips (an MTP head here) are never read; everything planned is exact; a read of a skipped tensor after
    all (outside the plan) still gets its bytes, directly."""
    g = torch.Generator().manual_seed(3)
    t = {"a.first": torch.randn(3000, generator=g), "m.mtp": torch.randn(40_000, generator=g),
         "z.last": torch.randn(3000, generator=g)}
    save_file(t, tmp_path / "m.safetensors")
    infos = read_header(tmp_path / "m.safetensors")
    s = SourceStream(tmp_path, ["m.safetensors"], chunk=CHUNK, window=4 * CHUNK, big=2 * CHUNK,
                     published={"m.safetensors": "cd" * 32})
    s.expect([infos["a.first"], infos["z.last"]])
    assert torch.equal(s.read("a.first", infos["a.first"]), t["a.first"])
    assert torch.equal(s.read("z.last", infos["z.last"]), t["z.last"])
    assert s.digests() == {"m.safetensors": "cd" * 32}
    mtp = infos["m.mtp"]
    inside = range(-(-mtp.begin // CHUNK) * CHUNK, mtp.end // CHUNK * CHUNK)  # chunks wholly inside it
    assert len(inside) >= 30 * CHUNK and not any(("m.safetensors", o) in disk_reads for o in inside)
    assert s.pass_bytes < (tmp_path / "m.safetensors").stat().st_size - len(inside) + 1
    assert torch.equal(s.read("m.mtp", mtp), t["m.mtp"])  # outside the plan: read directly
    s.stop()
