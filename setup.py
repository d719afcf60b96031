"""Builds the CPU expert kernel for each x86-64 ISA level with the package (runtime/gpu/cpu/build.py), so that a
server never compiles it at start. Everything else is declared in pyproject.toml."""

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py


class PlatformDistribution(Distribution):
    def has_ext_modules(self):  # the wheel holds native libraries: tag it for this platform, not py3-none-any
        return True


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        source = Path(__file__).parent / "runtime/gpu/cpu/build.py"
        spec = importlib.util.spec_from_file_location("ft_cpu_build", source)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        editable = getattr(self, "editable_mode", False)
        dest = mod.prebuilt_dir() if editable else Path(self.build_lib) / "ft/runtime/gpu/cpu/prebuilt"
        try:
            built = mod.build_prebuilt(dest)
        except Exception as e:  # noqa: BLE001 - the runtime builds it on first use instead
            self.warn(f"CPU expert kernel not prebuilt ({e}); it will be built on first use")
            return
        self.announce(f"prebuilt CPU expert kernels: {', '.join(p.name for p in built) or 'none'}", level=2)


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=PlatformDistribution)
