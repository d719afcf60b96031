"""CPU side of the expert store: FP4 expert MLPs (NVFP4 or MXFP4 records) computed from host memory.

The kernel is `kernel.c` (plain C + OpenMP; AVX-512, and AVX512-BF16 dot products, where the CPU has them; the
per-scheme weight decode in `fp4_decode.h`, picked once per layout from `c_layout`'s scheme flag), built
with the package for each x86-64 ISA level and picked by this CPU's flags (`build.py`; built here once, into the
user cache, only where no prebuilt library fits) and called through ctypes.
`CpuMoe.__call__` runs it in the calling thread; `CpuMoe.submit` hands it to the library's native worker thread and
returns at once, so the CPU experts run while the calling thread goes on driving the GPU, without a Python thread
that would first have to win the GIL. Where no C compiler is found, `CpuMoe` computes the same function with the
PyTorch reference (much slower; `backend` says which is used). Both refuse record schemes the kernel has no decode
for (`KERNEL_SCHEMES`).
"""

from __future__ import annotations

import ctypes
import os
import time
import weakref

import numpy as np
import torch

from .build import library_path
from ..kernels.moe_reference import expert_forward_ref
from ..record_layout import RecordLayout

KERNEL_SCHEMES = {"nvfp4": 0, "mxfp4": 1}  # `kernel.h` FT_NVFP4 / FT_MXFP4
KERNEL_ACTS = {"silu": 0, "clamped_swiglu": 1, "clamped_silu": 2}  # `kernel.h` FT_SILU, ...


class _Layout(ctypes.Structure):
    """`kernel.h` `ft_layout`: component offsets (-1: absent), then the scheme, activation, alpha and limit."""

    _fields_ = [*((n, ctypes.c_int64) for n in ("hidden", "inter", "gu", "gus", "gus2", "d", "ds", "ds2", "gub",
                                                 "db")),
                ("scheme", ctypes.c_int32), ("act", ctypes.c_int32), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float)]


def c_layout(layout: RecordLayout) -> _Layout:
    """The C kernel's description of `layout`'s records; ValueError for a scheme or activation it has no code for."""
    if layout.scheme not in KERNEL_SCHEMES:
        raise ValueError(f"the CPU expert kernel reads {', '.join(KERNEL_SCHEMES)} records, not {layout.scheme!r}")
    if layout.act not in KERNEL_ACTS:
        raise ValueError(f"the CPU expert kernel computes the {', '.join(KERNEL_ACTS)} activations, "
                         f"not {layout.act!r}")
    lay = layout
    return _Layout(lay.hidden, lay.inter, lay.off_gate_up, lay.off_gate_up_scale, lay.off_gate_up_scale_2,
                   lay.off_down, lay.off_down_scale, lay.off_down_scale_2, lay.off_gate_up_bias, lay.off_down_bias,
                   KERNEL_SCHEMES[lay.scheme], KERNEL_ACTS[lay.act], lay.alpha, lay.limit)


_LIBS: dict[tuple[str, ...], ctypes.CDLL] = {}


def load_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    if extra_flags not in _LIBS:
        path = library_path(extra_flags)
        if path is None:
            return None
        _LIBS[extra_flags] = bind(path)
    return _LIBS[extra_flags]


def bind(path) -> ctypes.CDLL:
    """The kernel library at `path`, its functions' ctypes signatures set."""
    lib = ctypes.CDLL(str(path))
    p = ctypes.c_void_p
    lib.ft_nvfp4_moe.argtypes = [p, ctypes.c_int32, p, p, p, p, ctypes.c_int32, p, p, p, ctypes.c_int32]
    lib.ft_nvfp4_moe.restype = ctypes.c_int
    lib.ft_worker_new.restype = p
    lib.ft_worker_submit.argtypes = [p, p, ctypes.c_int32, p, p, p, p, ctypes.c_int32, p, p, p, ctypes.c_int32]
    lib.ft_worker_submit.restype = ctypes.c_int
    lib.ft_worker_wait.argtypes = [p, ctypes.POINTER(ctypes.c_double)]
    lib.ft_worker_wait.restype = ctypes.c_int
    lib.ft_worker_free.argtypes = [p]
    lib.ft_worker_free.restype = None
    lib.ft_memcpy.argtypes = [p, p, ctypes.c_int64, ctypes.c_int32]
    lib.ft_memcpy.restype = None
    lib.ft_has_avx512.restype = ctypes.c_int
    lib.ft_lane_new.argtypes = [p, p, ctypes.c_int64, ctypes.c_int32, p, p, p, ctypes.c_int32]
    lib.ft_lane_new.restype = p
    lib.ft_lane_free.argtypes = [p]
    lib.ft_lane_free.restype = None
    lib.ft_lane_stats.argtypes = [p, p]
    lib.ft_lane_stats.restype = None
    lib.ft_lane_set_fit_cap.argtypes = [p, ctypes.c_int64, ctypes.c_int64]
    lib.ft_lane_set_fit_cap.restype = None
    lib.ft_lane_rest.argtypes = [p, ctypes.c_int32]
    lib.ft_lane_rest.restype = None
    return lib


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads() -> int:
    """Cores for the CPU expert kernel of the host-planned path: all but five (one drives the GPU, four run the staging
    copies)."""
    return max(1, usable_cores() - 5)


def lane_threads() -> int:
    """Cores for the CPU lane (mode mapped: no staging copies): all but two, one for the thread that drives the GPU
    and one for the OS and the CUDA driver's threads. Its rate per expert grows with threads up to there (beside the
    GPU's copies on the H200 host: 34 GB/s from 11 threads, 44 from 14, no more from 15; tools/bench_cpu_lane.py)."""
    return max(1, usable_cores() - 2)


class CpuMoe:
    """y[T, H] = sum over the given (expert record, pairs) of weight * expert(x[token])."""

    def __init__(self, layout: RecordLayout, *, threads: int | None = None, backend: str = "auto",
                 extra_flags: tuple[str, ...] = ()):
        if backend not in ("auto", "c", "torch"):
            raise ValueError(f"CPU expert backend {backend!r}; supported: auto, c, torch")
        self._clayout = c_layout(layout)  # refuses schemes the kernel cannot read, also for the torch backend
        self.layout = layout
        self.threads = threads or default_threads()
        self.lib = None if backend == "torch" else load_library(extra_flags)
        if backend == "c" and self.lib is None:
            raise RuntimeError("the C expert kernel needs a C compiler (cc/gcc) on PATH or $CC")
        self.backend = "torch" if self.lib is None else ("c-avx512" if self.lib.ft_has_avx512() else "c")
        self._worker = None  # native worker of `submit` (ft_worker *), started on first use
        self._inflight: CpuJob | None = None  # the submitted job whose result() has not been taken

    def __call__(self, records: list[torch.Tensor], group_pairs: list[np.ndarray], pair_tok: np.ndarray,
                 pair_w: np.ndarray, x: torch.Tensor) -> torch.Tensor:
        """records[g] u8 [stride] (CPU); group_pairs[g] = indices into pair_tok/pair_w of expert g's pairs;
        x [T, H] (CPU, any float dtype; rounded to bf16 like the GPU path) -> f32 [T, H]."""
        T, H = x.shape
        xf = x.to(torch.bfloat16).float().contiguous()
        if not records:
            return torch.zeros(T, H, dtype=torch.float32)
        if self.lib is None:
            return self._torch(records, group_pairs, pair_tok, pair_w, xf)
        args, y = self._args(records, group_pairs, pair_tok, pair_w, xf, pinned=False)
        _check(self.lib.ft_nvfp4_moe(*args[:-1], self.threads))
        return y

    def submit(self, records: list[torch.Tensor], group_pairs: list[np.ndarray], pair_tok: np.ndarray,
               pair_w: np.ndarray, x: torch.Tensor, *, pinned: bool = False) -> CpuJob:
        """The same call, started on the native worker; `.result()` -> (y f32 [T, H], seconds of the CPU path: this
        call's own preparation plus the kernel's time on the worker). One job in flight per CpuMoe: a new submit first
        waits for the previous job. `pinned`: y in page-locked memory (for a non-blocking copy to a GPU)."""
        t = time.perf_counter()
        if self.lib is None or not records:
            y = self(records, group_pairs, pair_tok, pair_w, x)
            return CpuJob(None, None, (y.pin_memory() if pinned else y), time.perf_counter() - t)
        if self._inflight is not None:  # one job at a time: finish the previous one (its result stays available)
            self._inflight.result()
        if self._worker is None:
            self._worker = self.lib.ft_worker_new()
            if not self._worker:
                raise RuntimeError("could not start the CPU expert worker thread")
            self._finalizer = weakref.finalize(self, self.lib.ft_worker_free, self._worker)
        xf = x.to(torch.bfloat16).float().contiguous()
        args, y = self._args(records, group_pairs, pair_tok, pair_w, xf, pinned=pinned)
        _check(self.lib.ft_worker_submit(self._worker, *args[:-1], self.threads))
        self._inflight = CpuJob(self, args, y, None, prep_seconds=time.perf_counter() - t)
        return self._inflight

    def _args(self, records, group_pairs, pair_tok, pair_w, xf, *, pinned: bool) -> tuple[tuple, torch.Tensor]:
        """ctypes arguments of one kernel call (the last element keeps their buffers alive) and the output y."""
        T, H = xf.shape
        order = np.concatenate(group_pairs).astype(np.int64)
        tok = np.ascontiguousarray(pair_tok[order], np.int32)
        w = np.ascontiguousarray(pair_w[order], np.float32)
        starts = np.zeros(len(group_pairs) + 1, np.int32)
        starts[1:] = np.cumsum([len(g) for g in group_pairs])
        ptrs = (ctypes.c_void_p * len(records))(*[r.data_ptr() for r in records])
        P = int(starts[-1])
        act = torch.empty(P, self.layout.inter, dtype=torch.float32)
        y = torch.empty(T, H, dtype=torch.float32, pin_memory=pinned)
        keep = (records, tok, w, starts, ptrs, xf, act, y)
        return (ctypes.byref(self._clayout), len(records), ptrs, starts.ctypes.data, tok.ctypes.data, w.ctypes.data,
                T, xf.data_ptr(), act.data_ptr(), y.data_ptr(), keep), y

    def close(self) -> None:
        """Stop the native worker (after its job, if any); a later `submit` starts a new one."""
        if self._inflight is not None:
            self._inflight.result()
        if self._worker is not None:
            self._finalizer()
            self._worker = None

    def _torch(self, records, group_pairs, pair_tok, pair_w, xf):
        y = torch.zeros_like(xf)
        for rec, idx in zip(records, group_pairs):
            tok = torch.from_numpy(np.asarray(pair_tok[idx], np.int64))
            out = expert_forward_ref(rec, self.layout, xf[tok])
            y.index_add_(0, tok, out * torch.from_numpy(np.asarray(pair_w[idx], np.float32))[:, None])
        return y


def _check(rc: int) -> None:
    if rc == -2:
        raise RuntimeError("a CPU expert job is still in flight; wait for its result first")
    if rc != 0:
        raise RuntimeError(f"CPU FP4 expert kernel refused its arguments (code {rc})")


class CpuJob:
    """One `CpuMoe.submit` call: `result()` waits for it (the GIL is released while waiting) and returns
    (y, seconds of the CPU path: the submit's preparation plus the kernel's time on the worker)."""

    def __init__(self, moe: CpuMoe | None, args: tuple | None, y: torch.Tensor, seconds: float | None, *,
                 prep_seconds: float = 0.0):
        self._moe, self._args, self._y, self._seconds, self._prep = moe, args, y, seconds, prep_seconds

    def result(self) -> tuple[torch.Tensor, float]:
        if self._seconds is None:
            secs = ctypes.c_double()
            rc = self._moe.lib.ft_worker_wait(self._moe._worker, ctypes.byref(secs))
            self._seconds, self._args = self._prep + secs.value, None  # the buffers may go now
            self._moe._inflight = None
            _check(rc)
        return self._y, self._seconds

    def __del__(self) -> None:
        # never free the buffers under a running kernel (a caller that dropped the job, e.g. on an exception)
        if self._seconds is None and self._args is not None:
            try:
                self.result()
            except Exception:  # noqa: BLE001 - nothing to report to in a finalizer
                pass


def parallel_copy(dst: torch.Tensor, src: torch.Tensor, threads: int) -> None:
    """dst <- src for two contiguous CPU byte tensors (the staging copy), threaded when the C library exists."""
    n = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() < n:
        raise ValueError("staging buffer smaller than the record")
    lib = load_library()
    if lib is None:
        dst.view(torch.uint8)[:n].copy_(src.view(torch.uint8).reshape(-1))
        return
    lib.ft_memcpy(dst.data_ptr(), src.data_ptr(), n, threads)
