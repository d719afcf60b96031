"""Which CPU expert kernel library is loaded (`cpu/build.py`): the prebuilt one of the best ISA level this CPU has,
for exactly these sources; otherwise one built here (never a library built from other sources)."""

from __future__ import annotations

import platform

import pytest

from ft.runtime.gpu.cpu import build as cpu_build

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ISA levels are x86-64's")


def _best_level() -> str:
    have = cpu_build.cpu_flags()
    return next(name for name, need, _ in cpu_build.LEVELS if set(need) <= have)


def test_the_best_supported_prebuilt_level_for_these_sources_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_build, "prebuilt_dir", lambda: tmp_path)
    digest = cpu_build.source_hash()
    for name, _, _ in cpu_build.LEVELS:
        (tmp_path / f"cpu_nvfp4-{name}-{digest}.so").write_bytes(b"")
    assert cpu_build.library_path() == tmp_path / f"cpu_nvfp4-{_best_level()}-{digest}.so"


def test_a_library_from_other_sources_is_never_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_build, "prebuilt_dir", lambda: tmp_path / "prebuilt")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    stale = tmp_path / "prebuilt" / f"cpu_nvfp4-{_best_level()}-{'0' * 16}.so"
    stale.parent.mkdir()
    stale.write_bytes(b"")
    if cpu_build.compiler() is None:
        assert cpu_build.library_path() is None
        return
    got = cpu_build.library_path()
    assert got != stale and got.parent == tmp_path / "cache" / "ft" / "kernels" and got.stat().st_size > 0


def test_build_prebuilt_writes_one_library_per_level(tmp_path):
    if cpu_build.compiler() is None:
        pytest.skip("no C compiler")
    built = cpu_build.build_prebuilt(tmp_path)
    names = {p.name.split("-")[1] for p in built}
    assert "baseline" in names and names <= {name for name, _, _ in cpu_build.LEVELS}
    assert all(p.name.endswith(f"-{cpu_build.source_hash()}.so") and p.stat().st_size > 0 for p in built)
