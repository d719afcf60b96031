"""Which prebuilt kernels engine start uses, and the one line it logs (runtime/gpu/prebuilt.py), without a GPU: no
entry, another arch, another Triton, another build of this Triton, a tampered file, an untrusted one, a trusted one.
The containers hold placeholder bytes; the real build and a cache-hit replay: tests/compiler/test_kernels_build.py.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from ftw_testlib import patch_bytes, small_ftw

from ft.formats import FtwReader, kernel_trust
from ft.formats.kernels import Kernel, KernelSet, Launcher, entry_name, pack
from ft.formats.slots import update_slot

from ft.runtime.gpu import prebuilt, triton_cache

WANT = {"triton": "3.6.0", "triton_build": "ab" * 32, "arch": 90, "backend_key": "cd" * 32, "env": {}}


def _cand(**over) -> prebuilt.Candidate:
    f = dict(name="kernels/a.ftk", triton="3.6.0", triton_build="ab" * 32, arch=90, backend_key="cd" * 32, env={})
    return prebuilt.Candidate(**{**f, **over})


def test_choose_names_the_first_mismatch():
    assert prebuilt.choose([], WANT)[1:] == ("none", "none in this FTW (ft kernels build makes them)")
    c, decision, why = prebuilt.choose([_cand(arch=80), _cand(arch=120)], WANT)
    assert c is None and decision == "other-arch" and why == "built for sm_120, sm_80, not for this GPU's sm_90"
    c, decision, why = prebuilt.choose([_cand(triton="3.5.1"), _cand(arch=80)], WANT)
    assert decision == "other-triton" and why == "built for sm_90 with Triton 3.5.1, this is Triton 3.6.0"
    assert "another build of Triton 3.6.0" in prebuilt.choose([_cand(triton_build="ef" * 32)], WANT)[2]
    assert "another ptxas" in prebuilt.choose([_cand(backend_key="ef" * 32)], WANT)[2]
    assert "Triton environment {'TRITON_DEBUG': '1'}" in prebuilt.choose([_cand(env={"TRITON_DEBUG": "1"})], WANT)[2]
    good = _cand(name="kernels/good.ftk")
    assert prebuilt.choose([_cand(triton_build="ef" * 32), good], WANT) == (good, "installed", "")


def _kernel_set(key: dict, **over) -> KernelSet:
    fn = "ft.runtime.gpu.kernels.embedding._gather_kernel"
    k = Kernel("0" * 64, "_gather_kernel", fn, "e" * 64,
               {"_gather_kernel.json": b"{}", "_gather_kernel.cubin": b"\x7fELF" + bytes(64)})
    fields = dict(triton=key["triton"], triton_build=key["triton_build"], arch=key["arch"],
                  backend_key=key["backend_key"], env=key["env"], kernels=(k,))
    return KernelSet(**{**fields, **over})


@pytest.fixture()
def env(tmp_path, monkeypatch):
    # imported here, not at collection: triton must first see the interpreter setting of tests/runtime/gpu
    pytest.importorskip("triton.backends.nvidia.compiler")
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    return tmp_path


def _with(tmp_path, ks: KernelSet | None):
    d = small_ftw(tmp_path / "m")
    if ks is not None:
        data = pack(ks)
        update_slot(d, "kernels", {entry_name(ks, data): data})
        return d, data
    return d, None


def _decide(d, caplog, arch=90):
    with caplog.at_level(logging.INFO, logger="ft.gpu"):
        status = prebuilt.use_prebuilt(FtwReader(d), arch)
    lines = [r for r in caplog.records if r.name == "ft.gpu" and r.getMessage().startswith("kernels: ")]
    assert len(lines) == 1, lines
    return status, lines[0]


def test_decisions_and_their_log_lines(env, caplog):
    key = triton_cache.target_key(90)
    status, line = _decide(_with(env / "none", None)[0], caplog)
    assert status.decision == "none" and line.levelno == logging.INFO and "Triton compiles" in line.getMessage()
    caplog.clear()
    status, line = _decide(_with(env / "arch", _kernel_set(key, arch=80))[0], caplog)
    assert status.decision == "other-arch" and "built for sm_80, not for this GPU's sm_90" in line.getMessage()
    assert line.levelno == logging.WARNING
    caplog.clear()
    status, line = _decide(_with(env / "ver", _kernel_set(key, triton="0.0.1"))[0], caplog)
    assert status.decision == "other-triton" and "with Triton 0.0.1, this is Triton" in line.getMessage()
    caplog.clear()
    status, _ = _decide(_with(env / "build", _kernel_set(key, triton_build="f" * 64))[0], caplog)
    assert status.decision == "other-build"
    caplog.clear()

    d, data = _with(env / "ok", _kernel_set(key))
    status, line = _decide(d, caplog)  # matching and intact, but nobody vouched for it here
    assert status.decision == "untrusted" and "is not trusted on this machine" in line.getMessage()
    caplog.clear()
    kernel_trust.trust(kernel_trust.digest(data), "built on this machine (ft kernels build)")
    status, line = _decide(d, caplog)
    # its one kernel claims another source key than this runtime's: left out (its launches compile), said so
    assert status.decision == "installed" and (status.installed, status.stale) == (0, 1)
    assert "0 prebuilt for sm_90" in line.getMessage() and "1 from other kernel sources" in line.getMessage()
    assert "built on this machine" in line.getMessage() and status.stats()["prebuilt"] == "installed"
    caplog.clear()

    tampered = env / "tampered"
    shutil.copytree(d, tampered)
    (entry,) = FtwReader(tampered).records.slots["kernels"]
    patch_bytes(tampered / entry.name, entry.nbytes - 3, b"\x55")  # inside the cubin: same size, other bytes
    status, line = _decide(tampered, caplog)
    assert status.decision == "tampered" and line.levelno == logging.ERROR
    assert "does not match the manifest's size and digest: refused" in line.getMessage()


def test_a_container_that_does_not_parse_is_refused_even_if_listed_and_trusted(env, caplog):
    key = triton_cache.target_key(90)
    d, data = _with(env / "m", _kernel_set(key))
    (entry,) = FtwReader(d).records.slots["kernels"]
    bad = data[:-1] + bytes([data[-1] ^ 1])  # a blob that no longer matches its own digest ...
    update_slot(d, "kernels", {"re.ftk": bad}, remove={entry.name})  # ... listed with the manifest's digest of it
    kernel_trust.trust(kernel_trust.digest(bad), "test")
    status, line = _decide(d, caplog)
    assert status.decision == "tampered" and "V22 kernels entry" in line.getMessage()


def test_launchers_are_installed_only_for_this_python_and_platform(env, caplog):
    """The entry's host launchers land in Triton's cache as `<name><this suffix>` under their key (a trusted entry
    built for this process' Python ABI and platform); built for another Python, none is installed and the line
    says Triton builds them."""
    from triton.runtime.cache import get_cache_manager

    key = triton_cache.target_key(90)
    suffix, platform = triton_cache.launcher_target()
    for where, python, want, digit in (("same", suffix, 2, "1"), ("other", ".cpython-39-other.so", 0, "2")):
        mods = (Launcher(digit * 64, "__triton_launcher", b"\x7fELF 1"), Launcher("a" + digit * 63, "cuda_utils", b"u"))
        caplog.clear()
        d, data = _with(env / where, _kernel_set(key, launchers=mods, python=python, platform=platform))
        kernel_trust.trust(kernel_trust.digest(data), "test")
        status, line = _decide(d, caplog)
        assert status.decision == "installed" and status.launchers == want, line.getMessage()
        assert status.stats()["launchers_installed"] == want
        for m in mods:
            path = get_cache_manager(m.key).get_file(f"{m.name}{suffix}")
            assert (path is not None and Path(path).read_bytes() == m.data) == (want > 0)
        if not want:
            assert f"launchers built for {python}" in line.getMessage() and "Triton builds them" in line.getMessage()
