"""The kernels container (formats/kernels.py): round trip, and hostile or damaged containers refused with a V22
error that says what is wrong; adding and replacing kernels/ entries of an FTW (formats/slots.py)."""

from __future__ import annotations

import json
import struct

import pytest
from ftw_testlib import small_ftw

from ft.formats import FtwReader
from ft.formats import errors as E
from ft.formats.kernels import HEADER, Kernel, KernelSet, Launcher, describe, entry_name, pack, read_index, unpack
from ft.formats.slots import update_slot

H64 = "ab" * 32


def _set(**over) -> KernelSet:
    k1 = Kernel("0" * 64, "_rms_norm_kernel", "ft.runtime.gpu.kernels.fused_ops._rms_norm_kernel", "c" * 64,
                {"_rms_norm_kernel.json": b'{"name": "_rms_norm_kernel"}', "_rms_norm_kernel.cubin": b"\x7fELF..."})
    k2 = Kernel("1" * 64, "_gather_kernel", "ft.runtime.gpu.kernels.embedding._gather_kernel", "d" * 64,
                {"_gather_kernel.json": b"{}", "_gather_kernel.cubin": b"\x7fELF" + bytes(range(256))})
    launchers = (Launcher("e" * 64, "__triton_launcher", b"\x7fELF launcher"), Launcher("f" * 64, "cuda_utils", b"u"))
    fields = dict(triton="3.6.0", triton_build=H64, arch=90, backend_key="cd" * 32, kernels=(k1, k2),
                  env={"TRITON_DEBUG": "1"}, launchers=launchers, python=".cpython-312-x86_64-linux-gnu.so",
                  platform="x86_64,Linux,64bit,ELF")
    return KernelSet(**{**fields, **over})


def _index(data: bytes) -> tuple[dict, bytes]:
    (_, _, _, n) = HEADER.unpack_from(data)
    return json.loads(data[HEADER.size:HEADER.size + n]), data[HEADER.size + n:]


def _repack(index: dict, blobs: bytes) -> bytes:
    body = json.dumps(index).encode()
    return HEADER.pack(b"FTKERNEL", index["version"], 0, len(body)) + body + blobs


def test_round_trip_is_deterministic_and_exact():
    ks = _set()
    data = pack(ks)
    assert pack(_set(kernels=tuple(reversed(ks.kernels)))) == data  # sorted: same build, same bytes
    back = unpack(data, "x")
    assert back.triton == "3.6.0" and back.arch == 90 and back.env == {"TRITON_DEBUG": "1"}
    assert {k.name: k.files for k in back.kernels} == {k.name: k.files for k in ks.kernels}
    assert back.launchers == ks.launchers and back.python == ks.python and back.platform == ks.platform
    assert read_index(data, "x")[0]["kernels"][0]["name"] == "_gather_kernel"
    name = entry_name(ks, data)
    assert name.startswith("triton-3.6.0-sm90-") and name.endswith(".ftk")


def _mutate(fn) -> bytes:
    index, blobs = _index(pack(_set()))
    blobs = fn(index, blobs)
    return _repack(index, blobs)


@pytest.mark.parametrize("make, words", [
    (lambda d: d[:10], "shorter than the 24-byte header"),
    (lambda d: b"NOTKERNL" + d[8:], "bad magic"),
    (lambda d: d[:8] + struct.pack("<I", 3) + d[12:], "container version 3"),
    (lambda d: d[:100], "does not fit"),
    (lambda d: d[:-1], "truncated"),
    (lambda d: d + b"\0", "1 bytes after the last blob"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "xxh3"),
    (lambda d: d[:HEADER.size] + b"\xff" + d[HEADER.size + 1:], "not UTF-8 JSON"),
])
def test_damaged_containers_are_refused(make, words):
    with pytest.raises(E.FtwKernelsError, match=words):
        unpack(make(pack(_set())), "kernels/x.ftk")


def _set_kernel(key, value):
    def fn(index, blobs):
        index["kernels"][0][key] = value
        return blobs
    return fn


@pytest.mark.parametrize("fn, words", [
    (_set_kernel("name", "../../evil"), "name an identifier"),
    (_set_kernel("hash", "../" + "0" * 61), "64 lowercase hex"),
    (_set_kernel("function", "os.system"), "must name a kernel of ft.runtime.gpu"),
    (_set_kernel("function", "ft.runtime.gpu.kernels.fused_ops.__init__.x"), "must name a kernel of ft.runtime.gpu"),
    (_set_kernel("files", {"../x.json": [0, 2, "0" * 16], "_gather_kernel.cubin": [2, 260, "0" * 16]}),
     "files must be exactly"),
    (_set_kernel("files", {"_gather_kernel.json": [0, 2, "0" * 16]}), "files must be exactly"),
    (_set_kernel("extra", 1), "wants exactly hash, name"),
    (lambda ix, b: (ix.__setitem__("kernels", [ix["kernels"][0]] * 2), b)[1], "listed twice"),
    (lambda ix, b: (ix.__setitem__("arch", True), b)[1], "wants cuda, an arch"),
    (lambda ix, b: (ix.__setitem__("backend", "hip"), b)[1], "wants cuda"),
    (lambda ix, b: (ix.__setitem__("env", {"bad name": "x"}), b)[1], "environment variable names"),
    (lambda ix, b: (ix.__setitem__("more", 1), b)[1], "index keys"),
    (lambda ix, b: (ix["kernels"][0]["files"]["_gather_kernel.json"].__setitem__(0, 5), b)[1], "expected 0"),
    (lambda ix, b: (ix["kernels"][0]["files"]["_gather_kernel.json"].__setitem__(1, -1), b)[1], r"wants \[offset"),
])
def test_hostile_indexes_are_refused_before_any_blob_is_used(fn, words):
    with pytest.raises(E.FtwKernelsError, match=words):
        unpack(_mutate(fn), "kernels/x.ftk")


def _set_launcher(key, value):
    def fn(index, blobs):
        index["launchers"][0][key] = value
        return blobs
    return fn


@pytest.mark.parametrize("fn, words", [
    (_set_launcher("name", "os"), "name one of"),
    (_set_launcher("key", "../x"), "64 lowercase hex"),
    (_set_launcher("extra", 1), "wants exactly key, name, file"),
    (lambda ix, b: (ix.__setitem__("python", "/../evil.so"), b)[1], "need python"),
    (lambda ix, b: (ix.__setitem__("launchers", [ix["launchers"][0]] * 2), b)[1], "listed twice"),
    (lambda ix, b: (ix["launchers"][1]["file"].__setitem__(0, 0), b)[1], "expected"),
    (lambda ix, b: (ix.__setitem__("version", 1), b)[1], "index keys"),  # a version-1 index has no launchers
])
def test_hostile_launcher_entries_are_refused(fn, words):
    with pytest.raises(E.FtwKernelsError, match=words):
        unpack(_mutate(fn), "kernels/x.ftk")


def test_version_1_containers_are_still_read():
    def v1(index, blobs):
        n = sum(len(m.data) for m in _set().launchers)
        for k in ("python", "platform", "launchers"):
            del index[k]
        index["version"] = 1
        return blobs[:-n]
    back = unpack(_mutate(v1), "kernels/x.ftk")
    assert back.launchers == () and len(back.kernels) == 2 and back.python == ""


def test_slot_entries_are_added_replaced_and_kept_verified(tmp_path):
    d = small_ftw(tmp_path / "m")
    r = FtwReader(d)
    assert r.verify() == [] and r.write_stamp() and FtwReader(d).verified
    data = pack(_set())
    name = entry_name(_set(), data)
    assert update_slot(d, "kernels", {name: data}) == [f"kernels/{name}"]
    r = FtwReader(d)
    assert r.verified and r.verify() == []  # the data files were checked; the new entry's digest is ours
    (info,) = describe(r)
    assert info["kernels"] == 2 and info["arch"] == 90 and info["triton"] == "3.6.0" and info["trusted"] is None
    with pytest.raises(ValueError, match="listed with other bytes"):
        update_slot(d, "kernels", {name: data + b"x"})
    other = pack(_set(arch=120))
    name2 = entry_name(_set(arch=120), other)
    assert update_slot(d, "kernels", {name2: other}, remove={f"kernels/{name}"}) == [f"kernels/{name2}"]
    assert not (d / "kernels" / name).exists() and FtwReader(d).verify() == []
    with pytest.raises(ValueError, match="not a slot entry name"):
        update_slot(d, "kernels", {"../escape": b"x"})
    with pytest.raises(ValueError, match="'weights/x' is not a slot entry name"):
        update_slot(d, "weights", {"x": b"x"})
