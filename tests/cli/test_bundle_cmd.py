"""`ft bundle` and `ft trust` end to end: keygen, a signed pack, trust, unpack (verified FTW), a tampered bundle."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ft.cli.main import app

runner = CliRunner()


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".ft-verified"}  # a machine-local note, not part of the FTW


def test_signed_bundle_round_trip_and_trust(ftw_for, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    ftw = ftw_for("qwen3_moe", "nvfp4")
    res = runner.invoke(app, ["trust", "keygen", str(tmp_path / "key")])
    assert res.exit_code == 0, res.output
    pub = (tmp_path / "key.pub").read_text().strip()
    res = runner.invoke(app, ["bundle", "pack", str(ftw), str(tmp_path / "m.ftb"), "--sign", str(tmp_path / "key")])
    assert res.exit_code == 0 and f"signed by {pub}" in res.output and "total" in res.output, res.output
    res = runner.invoke(app, ["bundle", "verify", str(tmp_path / "m.ftb")])
    assert res.exit_code == 0 and "does not trust" in res.output, res.output
    assert runner.invoke(app, ["trust", "add", pub]).exit_code == 0
    assert runner.invoke(app, ["trust", "list"]).output.split() == [pub]
    res = runner.invoke(app, ["bundle", "unpack", str(tmp_path / "m.ftb"), str(tmp_path / "out")])
    assert res.exit_code == 0 and "FTW verified" in res.output and f"trusted key {pub}" in res.output, res.output
    assert _files(tmp_path / "out") == _files(ftw)
    blob = bytearray((tmp_path / "m.ftb").read_bytes())
    blob[len(blob) // 3] ^= 0x40  # a flipped bit in some chunk
    (tmp_path / "bad.ftb").write_bytes(bytes(blob))
    res = runner.invoke(app, ["bundle", "verify", str(tmp_path / "bad.ftb")])
    assert res.exit_code == 1 and "FAIL" in res.output
    res = runner.invoke(app, ["trust", "add", "not-a-key"])
    assert res.exit_code == 1 and "64 hex" in res.output


def test_unpack_trusts_kernels_only_under_a_trusted_signature(ftw_for, tmp_path, monkeypatch):
    import shutil

    from ft.formats import kernel_trust
    from ft.formats.kernels import Kernel, KernelSet, entry_name, pack
    from ft.formats.slots import update_slot

    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    ftw = tmp_path / "m"
    shutil.copytree(ftw_for("qwen3_moe", "nvfp4"), ftw)
    k = Kernel("0" * 64, "_gather_kernel", "ft.runtime.gpu.kernels.embedding._gather_kernel", "e" * 64,
               {"_gather_kernel.json": b"{}", "_gather_kernel.cubin": b"\x7fELF" + bytes(32)})
    ks = KernelSet(triton="3.6.0", triton_build="ab" * 32, arch=90, backend_key="cd" * 32, kernels=(k,))
    data = pack(ks)
    update_slot(ftw, "kernels", {entry_name(ks, data): data})
    digest = kernel_trust.digest(data)
    assert runner.invoke(app, ["trust", "keygen", str(tmp_path / "key")]).exit_code == 0
    pub = (tmp_path / "key.pub").read_text().strip()
    for name, sign in (("unsigned.ftb", []), ("signed.ftb", ["--sign", str(tmp_path / "key")])):
        assert runner.invoke(app, ["bundle", "pack", str(ftw), str(tmp_path / name), *sign]).exit_code == 0
    for name in ("unsigned.ftb", "signed.ftb"):  # the key is not trusted yet: neither bundle vouches for its kernels
        res = runner.invoke(app, ["bundle", "unpack", str(tmp_path / name), str(tmp_path / f"out-{name}")])
        assert res.exit_code == 0 and "1 of its 1 kernels entries are NOT trusted here" in res.output, res.output
    assert kernel_trust.trusted(digest) is None
    res = runner.invoke(app, ["verify", str(tmp_path / "out-signed.ftb")])
    assert res.exit_code == 0 and "not trusted on this machine" in res.output, res.output
    assert runner.invoke(app, ["trust", "add", pub]).exit_code == 0
    res = runner.invoke(app, ["bundle", "verify", str(tmp_path / "signed.ftb")])
    assert res.exit_code == 0 and "1 kernels entries are trusted" in res.output, res.output
    res = runner.invoke(app, ["bundle", "unpack", str(tmp_path / "signed.ftb"), str(tmp_path / "out2")])
    assert res.exit_code == 0 and "its 1 kernels entries are trusted here" in res.output, res.output
    assert kernel_trust.trusted(digest) == f"unpacked from a bundle signed by trusted key {pub}"
    res = runner.invoke(app, ["verify", str(tmp_path / "out2")])
    assert res.exit_code == 0 and f"trusted: unpacked from a bundle signed by trusted key {pub}" in res.output
    res = runner.invoke(app, ["bundle", "verify", str(tmp_path / "unsigned.ftb")])
    assert res.exit_code == 0 and "NOT trusted (unsigned, or not by a trusted key)" in res.output
    res = runner.invoke(app, ["bundle", "unpack", str(tmp_path / "unsigned.ftb"), str(tmp_path / "out3")])
    assert res.exit_code == 0 and "its 1 kernels entries are trusted here" in res.output  # trusted by the signed unpack
