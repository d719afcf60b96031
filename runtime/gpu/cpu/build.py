"""Building the CPU expert kernel (`kernel.c` + `lane.c`, NVFP4 and MXFP4 records): one library per x86-64 ISA
level built with the
package, the best one this CPU supports picked at load; a build for this CPU only where none fits.

`setup.py` calls `build_prebuilt` when the package is built (wheel or editable install): it writes
`prebuilt/cpu_nvfp4-<level>-<source hash>.so` for each level of `LEVELS` the compiler accepts. `library_path` takes
the best level whose CPU flags /proc/cpuinfo lists and whose library exists for these exact sources (a library
built from other sources is never loaded); otherwise (another architecture, no compiler at install time, a CPU below
every level) it builds once with -march=native into the user cache and logs that it did. Standard library only: the
build step imports this file before the package is installed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ft.formats.home import cache_home

log = logging.getLogger("ft.gpu")

HERE = Path(__file__).resolve().parent
SOURCES = ("kernel.c", "lane.c", "kernel.h", "fp4_decode.h")
BASE_FLAGS = ("-O3", "-fopenmp", "-pthread", "-shared", "-fPIC", "-std=c11")
# name, the /proc/cpuinfo flags it needs, compiler flags; best first. The BF16 level runs vdpbf16ps (`kernel.c`).
LEVELS = (
    ("avx512bf16", ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
     ("-march=x86-64-v4", "-mavx512bf16")),
    ("avx512", ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"), ("-march=x86-64-v4",)),
    ("avx2", ("avx2", "fma", "f16c", "bmi2"), ("-march=x86-64-v3",)),
    ("baseline", (), ("-march=x86-64",)),
)


def prebuilt_dir() -> Path:
    return HERE / "prebuilt"


def source_hash() -> str:
    return hashlib.sha256(b"".join((HERE / n).read_bytes() for n in SOURCES)).hexdigest()[:16]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler(cc: str | None = None) -> str | None:
    return cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(out: Path, flags: tuple[str, ...], cc: str) -> Path:
    """Compile the sources with BASE_FLAGS + flags into `out` (written under a temporary name, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        sources = [str(HERE / n) for n in SOURCES if n.endswith(".c")]
        res = subprocess.run([cc, *BASE_FLAGS, *flags, "-o", str(tmp_so), *sources, "-lm"], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building the CPU NVFP4 kernel with {cc} {' '.join(flags)} failed:\n"
                               f"{res.stderr[-2000:]}")
        os.replace(tmp_so, out)
    return out


def build_prebuilt(dest: Path, cc: str | None = None) -> list[Path]:
    """One library per ISA level into `dest` (x86-64 only; levels the compiler refuses are skipped)."""
    cc = compiler(cc)
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        return []
    built, digest = [], source_hash()
    for name, _, flags in LEVELS:
        try:
            built.append(build(dest / f"cpu_nvfp4-{name}-{digest}.so", flags, cc))
        except RuntimeError as e:
            log.warning("%s", e)
    return built


def library_path(extra_flags: tuple[str, ...] = (), cc: str | None = None) -> Path | None:
    """The library to load: the prebuilt one of the best level this CPU supports, else one built here with
    -march=native (cached per sources, flags and CPU); None without a compiler. `extra_flags` (tests: e.g.
    "-mno-avx512f") always build here."""
    if not extra_flags:
        have = cpu_flags()
        level = next((name for name, need, _ in LEVELS if set(need) <= have), None)
        if level is not None and platform.machine() in ("x86_64", "AMD64"):
            path = prebuilt_dir() / f"cpu_nvfp4-{level}-{source_hash()}.so"
            if path.exists():
                return path
    cc = compiler(cc)
    if cc is None:
        return None
    flags = ("-march=native", *extra_flags)
    key = hashlib.sha256((source_hash() + " ".join(flags) + " ".join(sorted(cpu_flags()))).encode()).hexdigest()[:16]
    out = cache_home() / "kernels" / f"cpu_nvfp4-{key}.so"
    if not out.exists():
        log.info("no prebuilt CPU expert kernel fits this CPU and these sources: building one with %s", cc)
        build(out, flags, cc)
    return out
