"""The host launchers of prebuilt kernels: Triton 3.6 builds, with a C compiler, one small Python extension module per
kernel signature (`__triton_launcher`) the first time a process launches a kernel of that signature, and one
`cuda_utils` module per process, and keeps them in its cache under sha256(C source + platform key)
(`triton.runtime.build.compile_module_from_src`). A cold start with ~100 signatures spent most of its time in gcc.

    lb = LauncherBuilder.for_this_triton()      # None (with the reason in `why_not`) where nothing can be prebuilt
    lb.add(compiled_kernel)                     # for each kernel the build compiled
    lb.launchers                                # -> [formats.kernels.Launcher], built once per distinct key

The C source and the cache key are Triton's own: `CudaLauncher` generates the source (with its module-level
`compile_module_from_src` pointed at `_Capture`), and the real `compile_module_from_src` computes the key and files the
module in a temporary cache, building it through `knobs.build.impl` with Triton's compiler flags. The one change is
the link: the build machine may have no GPU driver, so `libcuda.so.1` is an empty stub of that name, linked with
--no-as-needed so the module still names libcuda.so.1, which the serving machine's loader resolves to its driver (as
Triton's own build does). Nothing is loaded here. A module is valid for one Python ABI and platform: the container
records the interpreter's extension suffix and Triton's platform key, and the runtime installs launchers only where
both are its own. Triton versions whose launcher is one generic module built from paths of the machine (3.9: the
key covers the library and include directories) have nothing that can be prebuilt.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from ft.formats.kernels import LAUNCHER_MODULES, Launcher


class _Capture:
    """Stands in for the compiled module Triton would load: what `CudaLauncher.__init__` reads of it."""

    def __init__(self, path: str):
        self.path = path
        self.launch = None


class LauncherBuilder:
    """Builds the launchers of compiled kernels (module docstring); `launchers` holds one per distinct cache key."""

    def __init__(self, cc: str, python_include: str, cache_dir: str | None = None):
        from triton.runtime.build import platform_key

        self.cc, self.python_include = cc, python_include
        self.builds = 0  # modules compiled (a module already in the cache is read, not compiled)
        self.python = sysconfig.get_config_var("EXT_SUFFIX")
        self.platform = platform_key()
        self.launchers: dict[str, Launcher] = {}
        self.errors: list[str] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="ft-launchers-")
        self.cache_dir = cache_dir or os.path.join(self._tmp.name, "cache")
        self._stub = self._make_stub()

    @staticmethod
    def why_not() -> str | None:
        """Why this machine or this Triton cannot prebuild launchers, or None."""
        try:
            from triton.backends.nvidia import driver as nv
        except ImportError as e:
            return f"this Triton has no CUDA driver module ({e})"
        if not hasattr(nv, "make_launcher") or not hasattr(nv, "CudaUtils"):
            return ("this Triton launches through one generic launcher built from this machine's paths: nothing to "
                    "prebuild (it is built once per process)")
        if _cc() is None:
            return "no C compiler (set CC, or install gcc or clang)"
        if not (Path(_python_include()) / "Python.h").is_file():
            return f"no Python headers ({_python_include()}/Python.h: install python3-dev)"
        return None

    @classmethod
    def for_this_triton(cls, cache_dir: str | None = None) -> "LauncherBuilder | None":
        """A builder (None where `why_not`) filing modules in `cache_dir` (default: a temporary directory)."""
        return None if cls.why_not() else cls(_cc(), _python_include(), cache_dir)

    def close(self) -> None:
        self._tmp.cleanup()

    def _make_stub(self) -> str:
        d = Path(self._tmp.name) / "stub"
        d.mkdir()
        (d / "stub.c").write_text("/* stands in for the driver's libcuda.so.1 at link time only */\n")
        subprocess.run([self.cc, str(d / "stub.c"), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                        str(d / "libcuda.so.1")], check=True, capture_output=True)
        return str(d)

    def _build(self, name, src, srcdir, library_dirs, include_dirs, libraries):
        """`knobs.build.impl`: Triton's `_build` command, linking libraries from the stub directory."""
        from triton import knobs

        so = os.path.join(srcdir, f"{name}{self.python}")
        incs = [*include_dirs, srcdir, self.python_include, *getattr(knobs.build, "backend_dirs", ())]
        libs = [f"-l:{lib}" if ".so" in lib or lib.endswith(".a") else f"-l{lib}" for lib in libraries]
        cmd = [self.cc, src, "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", so, *[f"-I{d}" for d in incs if d],
               f"-L{self._stub}", "-Wl,--no-as-needed", *libs]
        subprocess.run(cmd, check=True, capture_output=True)
        self.builds += 1
        return so

    def _compile(self, src: str, name: str, library_dirs=None, include_dirs=None, libraries=None, ccflags=None):
        """Triton's `compile_module_from_src` into a temporary cache, built by `_build`, not loaded."""
        from triton import knobs
        from triton.runtime import build

        with knobs.cache.scope(), knobs.build.scope(), _patched(build, "_load_module_from_path",
                                                                 lambda n, path: _Capture(path)):
            knobs.cache.dir = self.cache_dir
            knobs.build.impl = self._build
            mod = build.compile_module_from_src(src=src, name=name, library_dirs=[], include_dirs=include_dirs,
                                                libraries=libraries)
        path = Path(mod.path)
        key = base64.b32decode(path.parent.name + "=" * (-len(path.parent.name) % 8)).hex()  # get_cache_manager's dir
        if name not in LAUNCHER_MODULES or not path.name == f"{name}{self.python}":
            raise RuntimeError(f"Triton filed launcher {name} as {path.name}; expected {name}{self.python}")
        if key not in self.launchers:
            self.launchers[key] = Launcher(key, name, path.read_bytes())
        return mod

    def add_utils(self) -> None:
        """The `cuda_utils` module every process builds first (`CudaUtils`: driver.c)."""
        from triton.backends.nvidia import driver as nv

        self._guarded("cuda_utils", lambda: self._compile(Path(nv.dirname, "driver.c").read_text(), "cuda_utils",
                                                          include_dirs=nv.include_dirs, libraries=nv.libraries))

    def add(self, kernel) -> None:
        """The launcher of one compiled kernel (`CompiledKernel`), as `CudaLauncher` makes it at its first launch."""
        from triton.backends.nvidia import driver as nv

        def make():
            with _patched(nv, "compile_module_from_src", self._compile), _patched(nv, "library_dirs", lambda: []):
                nv.CudaLauncher(kernel.src, kernel.metadata)

        self._guarded(getattr(kernel, "name", "?"), make)

    def _guarded(self, what: str, fn) -> None:
        try:
            fn()
        except (subprocess.CalledProcessError, OSError, RuntimeError) as e:  # reported; that launcher is built later
            detail = e.stderr.decode(errors="replace")[-300:] if isinstance(e, subprocess.CalledProcessError) else e
            self.errors.append(f"launcher of {what}: {type(e).__name__}: {detail}"[:600])


@contextlib.contextmanager
def _patched(obj, name: str, value):
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


def _cc() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def _python_include() -> str:
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
