"""Upload paths: bank ranges for page-locking, the pinning allowance, and (on CUDA) the staging thread and direct
DMA from registered memory landing byte-identical records in their slots."""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.gpu.pinning import BackgroundPinner, bank_range, pin_banks, prefault
from ft.runtime.gpu.transfer import HostUploader

from .gpu_fixtures import tiny_moe_ftw


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return FtwReader(tiny_moe_ftw(tmp_path_factory.mktemp("xfer") / "m.ftw", experts=8, top_k=2, hidden=64))


def test_bank_range_covers_exactly_the_records(reader):
    bank = reader.bank("layers.1.mlp.experts")
    base, nbytes = bank_range(bank)
    assert base == bank.record(0).data_ptr() and nbytes == bank.num_experts * bank.stride
    assert bank.record(bank.num_experts - 1).data_ptr() + bank.stride == base + nbytes


class _Recorder(HostUploader):
    """Accepts registrations (to test the allowance logic without a GPU)."""

    def __init__(self, accept: bool):
        super().__init__(torch.empty(0, 1, dtype=torch.uint8))
        self.accept, self.ranges = accept, []

    def register(self, base: int, nbytes: int, view=None) -> bool:
        if self.accept:
            self.ranges.append((base, nbytes, view))
        return self.accept


def test_pin_banks_respects_the_allowance(reader):
    banks = [reader.bank(f"layers.{i}.mlp.experts") for i in range(3)]
    size = bank_range(banks[0])[1]
    rec = _Recorder(True)
    info = pin_banks(rec, banks, allowance=2 * size + 1)
    assert info["pinned_banks"] == 2 and info["pinned_bytes"] == 2 * size and len(rec.ranges) == 2
    assert pin_banks(_Recorder(True), banks, allowance=0)["pinned_bytes"] == 0
    refused = pin_banks(_Recorder(False), banks, allowance=None)
    assert refused["pin_refused"] and refused["pinned_bytes"] == 0
    # verification covers the banks left unregistered too (mode mapped's CPU lane computes their misses)
    names = [b.name for b in banks]
    assert pin_banks(_Recorder(True), banks, allowance=size, verify=True)["verified_banks"] == names
    assert pin_banks(_Recorder(False), banks, allowance=None, verify=True)["verified_banks"] == names


def test_background_pinner_registers_the_banks_off_the_calling_thread(reader):
    banks = [reader.bank(f"layers.{i}.mlp.experts") for i in range(3)]
    threads = []

    class _Where(_Recorder):
        def register(self, base, nbytes, view=None):
            threads.append(threading.current_thread().name)
            return super().register(base, nbytes, view)

    rec = _Where(True)
    pinner = BackgroundPinner(rec, banks, allowance=None)
    info = pinner.wait(timeout=30)
    times = ("read_s", "register_s", "verify_s", "seconds")  # where the pinning's time went, for start-up reports
    same = pin_banks(_Recorder(True), banks, allowance=info["pin_allowance"])
    assert {k: v for k, v in info.items() if k not in times} == {k: v for k, v in same.items() if k not in times}
    assert 0 <= info["read_s"] + info["register_s"] + info["verify_s"] <= info["seconds"]
    assert info["pinned_banks"] == 3 and len(rec.ranges) == 3 and set(threads) == {"ft-pin"}
    pinner.stop()  # after it finished: a no-op


def test_background_pinner_stops_between_banks(reader):
    banks = [reader.bank(f"layers.{i}.mlp.experts") for i in range(3)]
    entered, release = threading.Event(), threading.Event()

    class _Slow(_Recorder):
        def register(self, base, nbytes, view=None):
            entered.set()
            release.wait(10)  # the first bank takes "long"
            return super().register(base, nbytes, view)

    rec = _Slow(True)
    pinner = BackgroundPinner(rec, banks, allowance=None)
    assert entered.wait(10) and pinner.wait(timeout=0) == {}  # still running: no result yet
    threading.Timer(0.2, release.set).start()
    pinner.stop()  # returns only once the bank in progress is done; nothing is registered after it
    assert pinner.done.is_set() and len(rec.ranges) == 1 and pinner.info["pinned_banks"] == 1


def test_background_pinner_reports_a_failure_and_finishes(reader):
    class _Broken(_Recorder):
        def register(self, base, nbytes, view=None):
            raise OSError("cudaHostRegister: out of memory")

    pinner = BackgroundPinner(_Broken(True), [reader.bank("layers.0.mlp.experts")], allowance=None)
    info = pinner.wait(timeout=30)
    assert info["pinned_bytes"] == 0 and "out of memory" in info["pin_error"]


def test_gpu_experts_adopt_the_pinned_copy_rate_once_pinning_finished(reader):
    from ft.runtime.gpu.offload_config import OffloadConfig
    from ft.runtime.gpu.store import GpuExperts

    profile = {"b_pcie": 10e9, "b_cpu": 20e9, "gbs": {"h2d_expert_pinned": 50.0}}
    ex = GpuExperts(reader, OffloadConfig(num_slots=4, b_cpu=1.0), device="cpu", profile=profile)
    ex.allocate()
    staged = ex.split.t_fetch

    class _Done:  # a pinner that has finished
        done, info = threading.Event(), {"pinned_banks": 3, "pinned_bytes": 3 << 20, "pin_refused": False}
        wait = stop = lambda self, *a: None

    ex.pinner = _Done()
    x = torch.randn(1, 64).to(torch.bfloat16)
    ex(0, x, torch.tensor([[1, 2]]), torch.rand(1, 2))
    assert ex.pin_info == {} and ex.split.t_fetch == staged  # still pinning: the staged rate
    ex.pinner.done.set()
    ex(0, x, torch.tensor([[3, 4]]), torch.rand(1, 2))
    assert ex.pin_info["pinned_banks"] == 3 and ex.stats()["pin_refused"] is False
    assert ex.split.t_fetch == pytest.approx(staged / 5)  # 50 GB/s instead of 10
    ex.close()


def _mapping_perms(addr: int) -> str:
    """rwxp/rwxs permissions of the mapping that holds `addr` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1]
    raise AssertionError(f"{addr:#x} is not mapped")


def test_pin_banks_registers_a_shared_read_only_mapping_of_the_bank(reader):
    # The reader's mapping is private and writable (copy-on-write): a long-term pin there makes the kernel copy every
    # page (minutes per bank on the GPU VM). What gets page-locked must be a shared, read-only mapping of the same
    # bytes.
    assert _mapping_perms(bank_range(reader.bank("layers.0.mlp.experts"))[0]).endswith("p")
    banks = [reader.bank(f"layers.{i}.mlp.experts") for i in range(2)]
    rec = _Recorder(True)
    pin_banks(rec, banks, allowance=None)
    for bank, (base, nbytes, view) in zip(banks, rec.ranges, strict=True):
        assert (base, nbytes) == bank_range(bank) and view.numel() == nbytes
        assert _mapping_perms(view.data_ptr()) == "r--s"
        assert torch.equal(view[bank.stride:2 * bank.stride], bank.record(1))
        assert torch.equal(view[-bank.stride:], bank.record(bank.num_experts - 1))


def _resident(base: int, nbytes: int) -> float:
    """Share of the pages of [base, base + nbytes) that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = base - base % 4096
    vec = np.zeros((nbytes + base - start + 4095) // 4096, np.uint8)
    assert libc.mincore(start, nbytes + base - start, vec.ctypes.data) == 0, os.strerror(ctypes.get_errno())
    return float((vec & 1).mean())


def _evict(path) -> None:
    """Drop a file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _ResidentCheck(HostUploader):
    """Records the resident share of each range at the moment it is registered."""

    def __init__(self):
        super().__init__(torch.empty(0))
        self.seen: list[float] = []

    def register(self, base: int, nbytes: int, view=None) -> bool:
        self.seen.append(_resident(view.data_ptr(), nbytes))
        return True


def test_pin_banks_faults_cold_file_pages_in_before_registering(tmp_path):
    # cudaHostRegister faulted cold file pages in one at a time: minutes per bank on the GPU VM, where a freshly
    # compiled (O_DIRECT) or copied bundle has none of its pages cached. pin_banks must read them in first.
    path = tiny_moe_ftw(tmp_path / "cold.ftw", experts=64, top_k=2, hidden=128)
    for f in path.rglob("*"):
        if f.is_file():
            _evict(f)
    r = FtwReader(path)
    banks = [r.bank(f"layers.{i}.mlp.experts") for i in range(2)]
    if max(_resident(*bank_range(b)) for b in banks) > 0.5:
        pytest.skip("this filesystem keeps the pages cached (fadvise DONTNEED had no effect)")
    rec = _ResidentCheck()
    assert pin_banks(rec, banks, allowance=None)["pinned_banks"] == 2
    assert rec.seen == [1.0, 1.0]


def test_prefault_reads_an_unaligned_range_in(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(1 << 20))
    _evict(f)
    arr = np.memmap(f, dtype=np.uint8, mode="r")
    base = arr.ctypes.data + 1000  # not page aligned, like a bank inside a data file
    if _resident(base, (1 << 20) - 5000) > 0.5:
        pytest.skip("this filesystem keeps the pages cached (fadvise DONTNEED had no effect)")
    assert prefault(base, (1 << 20) - 5000) in ("populate", "touch")
    assert _resident(base, (1 << 20) - 5000) == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uploads_staged_and_direct_are_exact(reader):
    from ft.runtime.gpu.transfer import CudaUploader

    bank = reader.bank("layers.0.mlp.experts")
    other = reader.bank("layers.2.mlp.experts")
    pool = torch.zeros(2 * bank.num_experts, bank.stride, dtype=torch.uint8, device="cuda")
    up = CudaUploader(pool, num_staging=2, copy_threads=2)
    registered = bool(pin_banks(up, [bank], allowance=None)["pinned_banks"])  # the shared read-only mapping
    for e in range(bank.num_experts):
        up.upload(e, bank.record(e))
        up.upload(bank.num_experts + e, other.record(e))
    torch.cuda.current_stream().wait_event(up.fence())
    for e in range(bank.num_experts):
        assert torch.equal(pool[e].cpu(), bank.record(e))
        assert torch.equal(pool[bank.num_experts + e].cpu(), other.record(e))
    assert up.direct_copies == (bank.num_experts if registered else 0)
    n, seconds = up.timing()
    assert n <= 2 * bank.num_experts and seconds >= 0
    up.close()
    assert up.pinned_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uploads_into_one_slot_keep_their_order(reader):
    """Direct copies issued on the caller's thread and staged ones queued behind them land in call order."""
    from ft.runtime.gpu.transfer import CudaUploader

    bank, other = reader.bank("layers.0.mlp.experts"), reader.bank("layers.2.mlp.experts")
    pool = torch.zeros(2, bank.stride, dtype=torch.uint8, device="cuda")
    up = CudaUploader(pool, num_staging=2, copy_threads=2)
    up.register(*bank_range(bank))  # the reader's own pages (no separate view)
    for e in range(bank.num_experts):
        up.upload(0, bank.record(e))  # direct when registered and nothing is queued
        up.upload(1, other.record(e))  # staged
        up.upload(0 if e % 2 else 1, (other if e % 2 else bank).record(e))  # the other path into the same slot
        done = torch.cuda.Event()
        done.record()
        up.after_compute(done)
    torch.cuda.current_stream().wait_event(up.fence())
    last = bank.num_experts - 1
    # odd e: slot 0 gets bank then other, slot 1 other; even e: slot 0 bank, slot 1 other then bank
    want0 = other.record(last) if last % 2 else bank.record(last)
    want1 = other.record(last) if last % 2 else bank.record(last)
    assert torch.equal(pool[0].cpu(), want0) and torch.equal(pool[1].cpu(), want1)
    up.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_upload_ranges_land_runs_of_records_and_refuse_before_issuing(reader):
    """One call, several runs of consecutive records (a prefill group's DMAs): each lands in its rows; a call with a
    range outside the page-locked banks or the pool is refused whole, nothing of it issued."""
    from ft.runtime.gpu.transfer import CudaUploader

    bank = reader.bank("layers.0.mlp.experts")
    pool = torch.zeros(bank.num_experts, bank.stride, dtype=torch.uint8, device="cuda")
    up = CudaUploader(pool, num_staging=2, copy_threads=2)
    base, nbytes = bank_range(bank)
    if not up.register(base, nbytes):
        pytest.skip("the driver refused to page-lock the bank")
    s = bank.stride
    up.upload_ranges([(0, base + 1 * s, 2 * s), (3, base + 4 * s, s)])  # records 1, 2 -> rows 0, 1; 4 -> row 3
    torch.cuda.current_stream().wait_event(up.fence())
    for row, e in ((0, 1), (1, 2), (3, 4)):
        assert torch.equal(pool[row].cpu(), bank.record(e))
    assert not pool[2].any() and up.direct_copies == 3
    outside = torch.zeros(s, dtype=torch.uint8)  # pageable memory: not inside any registered range
    for bad in ([(2, base, s), (5, outside.data_ptr(), s)], [(2, base, s), (bank.num_experts, base, s)],
                [(2, base, s // 2)]):
        with pytest.raises(ValueError, match="upload_ranges"):
            up.upload_ranges(bad)
    torch.cuda.synchronize()
    assert not pool[2].any() and up.direct_copies == 3
    up.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_locked_address_is_the_page_locked_view_of_the_same_bytes(reader):
    """After `pin_banks` (a shared read-only view registered), a record's locked address holds the record's bytes in
    the view, not the reader's mapping; an unregistered range has none."""
    from ft.runtime.gpu.transfer import CudaUploader

    bank, other = reader.bank("layers.0.mlp.experts"), reader.bank("layers.2.mlp.experts")
    pool = torch.zeros(1, bank.stride, dtype=torch.uint8, device="cuda")
    up = CudaUploader(pool, num_staging=2, copy_threads=2)
    if not pin_banks(up, [bank], allowance=None)["pinned_banks"]:
        pytest.skip("the driver refused to page-lock the bank")
    base, _ = bank_range(bank)
    e = bank.num_experts - 1
    addr = up.locked_address(base + e * bank.stride, bank.stride)
    assert addr is not None and addr != base + e * bank.stride  # the view's own pages
    got = torch.frombuffer((ctypes.c_uint8 * bank.stride).from_address(addr), dtype=torch.uint8).clone()
    assert torch.equal(got, bank.record(e))
    assert up.locked_address(bank_range(other)[0], other.stride) is None
    up.close()
