"""CPU side of the hybrid expert path: NVFP4 expert MLPs computed from host memory.

The kernel is `cpu_nvfp4.c` (plain C + OpenMP, AVX-512 when the CPU has it), built once per machine with the system C
compiler into the user cache (`$XDG_CACHE_HOME/ft/kernels` or `~/.cache/ft/kernels`) and called through ctypes, which
releases the GIL, so a Python worker thread can run it while the main thread drives the GPU. Where no C compiler is
found, `CpuMoe` computes the same function with the PyTorch reference (much slower; `backend` says which is used).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from .moe_reference import expert_forward_ref
from .record_layout import RecordLayout

_SRC = Path(__file__).with_name("cpu_nvfp4.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ft"


def _cpu_signature() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
    except OSError:
        flags = platform.processor()
    return flags


def build_library(cc: str | None = None, extra_flags: tuple[str, ...] = ()) -> Path | None:
    """Compile (or reuse) the kernel library for this CPU; None if no C compiler is available.
    `extra_flags` (e.g. "-mno-avx512f" to build the portable path) are appended to the defaults."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    src = _SRC.read_bytes()
    flags = [*_FLAGS, *extra_flags]
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"cpu_nvfp4-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        res = subprocess.run([cc, *flags, "-o", str(tmp_so), str(_SRC), "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building the CPU NVFP4 kernel with {cc} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp_so, out)
    return out


class _Layout(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("hidden", "inter", "gu", "gus", "gus2", "d", "ds", "ds2")]


_LIBS: dict[tuple[str, ...], ctypes.CDLL] = {}


def load_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    if extra_flags not in _LIBS:
        path = build_library(extra_flags=extra_flags)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
        p = ctypes.c_void_p
        lib.ft_nvfp4_moe.argtypes = [p, ctypes.c_int32, p, p, p, p, ctypes.c_int32, p, p, p, p, ctypes.c_int32]
        lib.ft_nvfp4_moe.restype = ctypes.c_int
        lib.ft_memcpy.argtypes = [p, p, ctypes.c_int64, ctypes.c_int32]
        lib.ft_memcpy.restype = None
        lib.ft_has_avx512.restype = ctypes.c_int
        _LIBS[extra_flags] = lib
    return _LIBS[extra_flags]


def default_threads() -> int:
    """Cores for the CPU expert kernel: all but five (one drives the GPU, four run the staging copies); memory
    bandwidth, not core count, limits the kernel long before that on the machines measured."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n - 5)


class CpuMoe:
    """y[T, H] = sum over the given (expert record, pairs) of weight * expert(x[token])."""

    def __init__(self, layout: RecordLayout, *, threads: int | None = None, backend: str = "auto",
                 extra_flags: tuple[str, ...] = ()):
        if backend not in ("auto", "c", "torch"):
            raise ValueError(f"CPU expert backend {backend!r}; supported: auto, c, torch")
        self.layout = layout
        self.threads = threads or default_threads()
        self.lib = None if backend == "torch" else load_library(extra_flags)
        if backend == "c" and self.lib is None:
            raise RuntimeError("the C expert kernel needs a C compiler (cc/gcc) on PATH or $CC")
        self.backend = "torch" if self.lib is None else ("c-avx512" if self.lib.ft_has_avx512() else "c")
        lay = layout
        self._clayout = _Layout(lay.hidden, lay.inter, lay.off_gate_up, lay.off_gate_up_scale,
                                lay.off_gate_up_scale_2, lay.off_down, lay.off_down_scale, lay.off_down_scale_2)

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
        order = np.concatenate(group_pairs).astype(np.int64)
        tok = np.ascontiguousarray(pair_tok[order], np.int32)
        w = np.ascontiguousarray(pair_w[order], np.float32)
        starts = np.zeros(len(group_pairs) + 1, np.int32)
        starts[1:] = np.cumsum([len(g) for g in group_pairs])
        ptrs = (ctypes.c_void_p * len(records))(*[r.data_ptr() for r in records])
        P = int(starts[-1])
        act = torch.empty(P, self.layout.inter, dtype=torch.float32)
        part = torch.empty(P, H, dtype=torch.float32)
        y = torch.empty(T, H, dtype=torch.float32)
        rc = self.lib.ft_nvfp4_moe(ctypes.byref(self._clayout), len(records), ptrs, starts.ctypes.data,
                                   tok.ctypes.data, w.ctypes.data, T, xf.data_ptr(), act.data_ptr(),
                                   part.data_ptr(), y.data_ptr(), self.threads)
        if rc != 0:
            raise RuntimeError(f"CPU NVFP4 kernel refused its arguments (code {rc})")
        return y

    def _torch(self, records, group_pairs, pair_tok, pair_w, xf):
        y = torch.zeros_like(xf)
        for rec, idx in zip(records, group_pairs):
            tok = torch.from_numpy(np.asarray(pair_tok[idx], np.int64))
            out = expert_forward_ref(rec, self.layout, xf[tok])
            y.index_add_(0, tok, out * torch.from_numpy(np.asarray(pair_w[idx], np.float32))[:, None])
        return y


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
