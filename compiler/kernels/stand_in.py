"""Compile the runtime's Triton kernels for a CUDA target on a machine without a GPU.

Inside `cuda_target(arch)`, Triton's active driver is a stand-in that reports a CUDA target (device 0, stream 0;
nothing is ever loaded or launched), Triton's cache is a fresh temporary directory, and every `kernel[grid](...)` of
the runtime's launchers is a warmup (compile, no launch) recorded by a `Recorder`. The launchers are called with CPU
tensors of the real shapes, so each kernel is compiled with the specialization (dtypes, 16-byte alignment of
pointers, integers equal to 1 or divisible by 16), constexprs and options of the same call on the GPU, which gives it
the cache key that launch computes (`ft.runtime.gpu.triton_cache`). The few switches the launchers set for Triton's
CPU interpreter (CPU tensors) are set to their CUDA values here (`cuda_kwargs`), and PDL to what a GPU of that arch
gets (`ft.runtime.gpu.kernels.pdl`: sm_90 and up).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field

import torch

# launch switches of the interpreter path -> their value on CUDA (see the launchers in ft.runtime.gpu)
CUDA_FALSE = ("RNE_BITS", "BITS", "INTERP", "F32", "ROUND_BF16", "UPCAST")
CUDA_TRUE = ("ASM", "FENCE")


class _TargetOnly:
    """Triton driver stand-in: a CUDA target, device 0, stream 0; nothing is ever loaded or launched."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def pdl_for(arch: int) -> bool:
    """Whether a GPU of this arch launches with PDL (`ft.runtime.gpu.kernels.pdl._supported`: capability 9 and up, and a
    Triton with the griddepcontrol instructions)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return arch >= 90


def cuda_kwargs(kwargs: dict, args: tuple, arch: int) -> dict:
    """The launch's keyword arguments as a CUDA launch on sm_`arch` passes them."""
    out = dict(kwargs)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    fp32 = first is not None and first.dtype == torch.float32
    for k in out:
        if k in CUDA_FALSE:
            out[k] = False
        elif k in CUDA_TRUE:
            out[k] = True
        elif k == "DOT_F32":  # decode attention: fp32 inputs; the tile kernels: never (their first tensor is u8)
            out[k] = fp32
        elif k == "PRECISION":  # dense_gemv: ieee for fp32 inputs, else tf32
            out[k] = "ieee" if fp32 else "tf32"
    if "PDL" in out:
        out["PDL"] = pdl_for(arch)
        if out["PDL"]:
            out["launch_pdl"] = True
    return out


@dataclass
class Built:
    """One compiled kernel: Triton's cache key and name, the runtime function, and the case that launched it."""
    hash: str
    name: str
    function: str
    case: str
    kernel: object = field(repr=False)


class Recorder:
    """Compiles every intercepted launch for the target; `built` holds each distinct kernel once, `errors` one
    message per specialization that failed to compile."""

    def __init__(self, arch: int, on_kernel=None):
        self.arch = arch
        self.case = ""
        self.built: dict[tuple[str, str], Built] = {}
        self.errors: dict[tuple, str] = {}
        self.on_kernel = on_kernel or (lambda b: None)
        self.touched: set = set()

    def run(self, fn, grid, args, kwargs):
        from triton.runtime.jit import JITFunction

        self.touched.add(fn)
        kwargs = cuda_kwargs(kwargs, args, self.arch)
        key = (fn, tuple(map(_spec, args)), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
        if key in self.errors:  # a failed compile is not cached by Triton: do not retry it
            return None
        try:
            k = JITFunction.run(fn, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - one kernel failing to build is reported, the others go on
            msg = " | ".join(str(e).strip().splitlines()[-3:])
            self.errors[key] = f"{fn.fn.__name__} ({self.case}): {type(e).__name__}: {msg}"[:600]
            return None
        if (k.hash, k.name) not in self.built:
            b = Built(k.hash, k.name, f"{fn.fn.__module__}.{fn.fn.__name__}", self.case, k)
            self.built[(k.hash, k.name)] = b
            self.on_kernel(b)
        return None


def _spec(v):
    """What Triton specializes a launch argument on (dtype and alignment, integer classes), or the value itself."""
    if isinstance(v, (torch.Tensor, int)) and not isinstance(v, bool):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        return native_specialize_impl(CUDABackend, v, False, True, True)
    return repr(v)


@contextlib.contextmanager
def cuda_target(arch: int, on_kernel=None, cache_dir: str | None = None):
    """Yields a Recorder; inside, kernel launches compile for sm_`arch` into a temporary Triton cache (module
    docstring), or into `cache_dir` (where kernels already there are loaded, not compiled). Everything is restored
    on exit."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: the runtime's kernels are interpreted functions that cannot be "
                           "compiled; build kernels in a process without it")
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from ft.runtime.gpu.triton_cache import settle_source_keys

    settle_source_keys()  # the source keys the runtime computes at start, whatever is launched first here
    rec = Recorder(arch, on_kernel)
    patched = JITFunction.__getitem__
    active = driver._active  # None until first use; restored as it was (no GPU: no default driver to reset to)
    with tempfile.TemporaryDirectory(prefix="ft-kernels-") as tmp, knobs.cache.scope():
        driver.set_active(_TargetOnly(arch))
        knobs.cache.dir = cache_dir or tmp
        JITFunction.__getitem__ = lambda self, grid: (lambda *a, **kw: rec.run(self, grid, a, kw))
        try:
            yield rec
        finally:
            JITFunction.__getitem__ = patched
            driver._active = active
            for fn in rec.touched:  # the in-memory kernels are for the stand-in's target: forget them
                fn.device_caches.clear()
