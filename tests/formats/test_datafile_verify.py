"""The O_DIRECT data-file sink writes exactly the bytes it is given (any write sizes, O_DIRECT or not), keeps them out
of the page cache, and surfaces write errors with their errno; the sampled verify always covers the first and last
region of every data file and the first and last record of every bank, stays within its budget, and finds what the
full verify finds in what it samples."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
from pathlib import Path

import pytest
import torch
from ftw_testlib import finish, patch_bytes, small_ftw

from ft.formats import FtwReader, FtwWriter
from ft.formats.datafile import DataFile
from ft.formats.verify import full_plan, plan_bytes, sample_plan, verify_sample


def _write_random(path: Path, total: int, seed: int, **kw) -> tuple[DataFile, bytes]:
    rnd = random.Random(seed)
    want = rnd.randbytes(total)
    f = DataFile(path, **kw)
    pos = 0
    while pos < total:
        n = min(total - pos, rnd.choice([1, 7, 100, 4095, 4096, 5000, 3 * 4096 + 1]))
        if rnd.random() < 0.2 and not any(want[pos:pos + n]):
            f.zeros(n)
        else:
            f.write(want[pos:pos + n])
        pos += n
    return f, want


def _resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache: mincore over a mapping whose pages are never touched (a read, even an
    RWF_NOWAIT one, may bring pages in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        head = ctypes.c_char.from_buffer(m)  # the mapping's address (a private mapping is writable)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(head)), ctypes.c_size_t(size), vec)
        del head
    if rc != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("block,depth,seed", [(4096, 2, 1), (3 * 4096, 3, 2), (16 << 20, 3, 3)])
def test_bytes_land_in_order(tmp_path: Path, block: int, depth: int, seed: int) -> None:
    f, want = _write_random(tmp_path / "d.ftd", 10 * 4096, seed, block=block, depth=depth)
    f.close()
    assert f.pos == len(want) and (tmp_path / "d.ftd").read_bytes() == want


def test_bypasses_page_cache(tmp_path: Path) -> None:
    f, want = _write_random(tmp_path / "d.ftd", 64 * 4096, 4, block=8 * 4096)
    f.close()
    if not f.direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert _resident_pages(tmp_path / "d.ftd") == 0  # written around the page cache
    assert (tmp_path / "d.ftd").read_bytes() == want


def test_buffered_when_o_direct_refused(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    f, want = _write_random(tmp_path / "d.ftd", 5 * 4096 + 3, 5, block=4096)  # unaligned total is fine buffered
    f.close()
    assert not f.direct and (tmp_path / "d.ftd").read_bytes() == want


def test_write_error_keeps_its_errno(tmp_path: Path, monkeypatch) -> None:
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    f = DataFile(tmp_path / "d.ftd", block=4096)
    with pytest.raises(OSError) as ei:
        for _ in range(16):  # the failure of an earlier block surfaces on a later write at the latest at close
            f.write(bytes(4096))
        f.close()
    assert ei.value.errno == errno.ENOSPC
    f.abort()


def test_unaligned_close_is_refused_with_o_direct(tmp_path: Path) -> None:
    f = DataFile(tmp_path / "d.ftd", block=4096)
    f.write(b"x" * 100)
    if not f.direct:
        f.abort()
        pytest.skip("this filesystem refuses O_DIRECT")
    with pytest.raises(ValueError, match="not a multiple of 4096"):
        f.close()


def _what(plan) -> dict[int, list[str]]:
    return {i: [u[3] for u in units] for i, units in plan.items()}


def test_sample_plan_order_and_budget(tmp_path: Path) -> None:
    m = FtwReader(small_ftw(tmp_path / "m", shard_bytes=8192)).records  # t.f32, t.bf16 | bank (4 records)
    full = full_plan(m)
    assert all(plan_bytes(sample_plan(m, budget=b, rng=random.Random(b))) <= b for b in range(0, 40000, 4096))
    assert sample_plan(m, budget=plan_bytes(full), rng=random.Random(0)) == full
    # each unit is 4096 bytes; the ends come first: file lasts, bank last, file firsts, bank first
    assert _what(sample_plan(m, budget=3 * 4096)) == {0: ["tensor t.f32", "tensor t.bf16"],
                                                      1: ["bank bank expert 3"]}
    assert _what(sample_plan(m, budget=4 * 4096)) == {0: ["tensor t.f32", "tensor t.bf16"],
                                                      1: ["bank bank expert 0", "bank bank expert 3"]}
    assert len(sample_plan(m, budget=5 * 4096, rng=random.Random(1))[1]) == 3  # plus one random record


def test_sample_end_regions_are_bounded(tmp_path: Path) -> None:
    w = FtwWriter(tmp_path / "m")
    for name, n in (("a", 1024), ("b", 1024), ("big", 64 << 10)):  # 4, 4 and 256 KiB
        w.add_tensor(name, torch.ones(n))
    m = FtwReader(finish(w)).records
    assert _what(sample_plan(m, budget=4096)) == {0: ["tensor b"]}  # big is over budget // 16: b stands for the end
    assert _what(sample_plan(m, budget=128 << 10)) == {0: ["tensor a", "tensor b"]}  # big does not fit at all
    assert _what(sample_plan(m, budget=1 << 20)) == {0: ["tensor a", "tensor b", "tensor big"]}  # random fill


def test_sample_finds_a_flipped_byte_in_the_last_region_and_bad_padding(tmp_path: Path) -> None:
    out = small_ftw(tmp_path / "m")  # one file: t.f32 at 0, t.bf16 at 4096, bank records at 8192 + 4096 e
    ends = 3 * 4096  # the file's last (record 3) and first (t.f32) region, the bank's first record
    assert verify_sample(FtwReader(out), budget=ends) == []
    data = out / "data-00000.ftd"
    raw = data.read_bytes()
    patch_bytes(data, 8192 + 3 * 4096 + 5, bytes([raw[8192 + 3 * 4096 + 5] ^ 1]))  # last expert record
    patch_bytes(data, 60, b"\x01")  # padding after t.f32 (3 x 5 x 4 bytes), the first region
    failures = [str(f) for f in verify_sample(FtwReader(out), budget=ends)]
    assert len(failures) == 2
    assert "bank bank expert 3" in failures[0] and "offset 60" in failures[1]
    patch_bytes(data, 8192 + 3 * 4096 + 5, raw[8192 + 3 * 4096 + 5:8192 + 3 * 4096 + 6])
    patch_bytes(data, 8192 + 4096 + 5, b"\xff")  # a middle record: only a sample that includes it can see it
    assert len(verify_sample(FtwReader(out), budget=ends)) == 1  # (the padding byte still)
    assert len(verify_sample(FtwReader(out), budget=1 << 30)) == 2 == len(FtwReader(out).verify())


def test_bank_component_in_pieces_equals_concatenated(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    comps = {"w": (torch.float32, (6, 4)), "s": (torch.float32, (6,))}
    parts = [(torch.randn(2, 4, generator=g), torch.randn(4, 4, generator=g), torch.randn(6, generator=g))
             for _ in range(2)]
    dirs = []
    for name, pieces in (("cat", False), ("pieces", True)):
        w = FtwWriter(tmp_path / name)
        bank = w.add_expert_bank("bank", "fp32", 2, comps)
        with pytest.raises(ValueError, match=r"expert 0 w: got torch.float32 \[2, 4\], torch.float32 \[3, 4\]"):
            bank.write_expert(0, {"w": (parts[0][0], parts[0][1][:3]), "s": parts[0][2]})  # 5 rows, not 6
        for e, (a, b, s) in enumerate(parts):
            bank.write_expert(e, {"w": (a, b) if pieces else torch.cat([a, b]), "s": s})
        dirs.append(finish(w, quant={"linears": {}, "experts": "fp32", "source": None}))
    files = [{p.name: p.read_bytes() for p in d.iterdir()} for d in dirs]
    assert files[0] == files[1] and FtwReader(dirs[1]).verify() == []
