"""Round trips through FtwWriter/FtwReader: every dtype, every scheme's expert-record layout, sharding, zero copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ftw_testlib import finish, moe_config, small_ftw

from ft.formats import FtwReader, FtwWriter
from ft.formats.dtypes import DTYPES
from ft.formats.layout import ALIGN, COMPONENT_ALIGN, align_up
from ft.formats.quant import fp8, nvfp4

G = torch.Generator().manual_seed(1234)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bitwise comparison, NaN-safe)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=G) * 3).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=G, dtype=torch.int64).to(dtype)


def file_offset(addr: int) -> tuple[str, int]:
    """(backing file, offset in it) of a virtual address, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return (parts[5].strip() if len(parts) > 5 else ""), int(parts[2], 16) + addr - lo
    raise AssertionError(f"address {addr:#x} is not mapped")


SHAPES = [(), (0, 3), (5,), (3, 4), (2, 3, 5)]


def test_every_dtype_round_trips_bitwise(tmp_path: Path) -> None:
    w = FtwWriter(tmp_path / "m")
    want = {}
    for name, (dtype, itemsize) in DTYPES.items():
        for shape in SHAPES:
            t = sample(dtype, shape)
            key = f"{name}.{'x'.join(map(str, shape)) or 'scalar'}"
            w.add_tensor(key, t)
            want[key] = (t, name, itemsize)
    finish(w)
    r = FtwReader(tmp_path / "m")
    assert sorted(DTYPES) == sorted({"F32", "F16", "BF16", "F8_E4M3", "U8", "I8", "I32", "I64"})
    assert r.tensor_names() == list(want)
    recs = {t["name"]: t for t in r.manifest["tensors"]}
    for key, (t, name, itemsize) in want.items():
        got = r.tensor(key)
        assert got.dtype == t.dtype and got.shape == t.shape, key
        assert torch.equal(bits(got), bits(t)), key
        assert recs[key]["dtype"] == name and recs[key]["nbytes"] == t.numel() * itemsize
        assert recs[key]["offset"] % ALIGN == 0
    assert r.verify() == []


def _bank_components(scheme: str, H: int, I: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    if scheme == "nvfp4":
        return {"gate_up": (torch.uint8, (2 * I, H // 2)), "gate_up_scale": (torch.float8_e4m3fn, (2 * I, H // 16)),
                "gate_up_scale_2": (torch.float32, (2 * I,)), "down": (torch.uint8, (H, I // 2)),
                "down_scale": (torch.float8_e4m3fn, (H, I // 16)), "down_scale_2": (torch.float32, (H,))}
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[scheme]
    return {"gate_up": (dt, (2 * I, H)), "down": (dt, (H, I))}


def _expert_parts(comps: dict) -> dict[str, torch.Tensor]:
    parts = {}
    for cname, (dtype, shape) in comps.items():
        if dtype == torch.uint8:
            parts[cname] = torch.randint(0, 256, shape, generator=G, dtype=torch.uint8)
        elif dtype == torch.float8_e4m3fn:
            parts[cname] = (torch.rand(shape, generator=G) * 4 + 0.25).to(dtype)  # positive block scales
        else:
            parts[cname] = sample(dtype, shape)
    return parts


@pytest.mark.parametrize("scheme", ["bf16", "fp16", "fp32", "nvfp4"])
def test_expert_bank_layout_round_trips(tmp_path: Path, scheme: str) -> None:
    H, I, E = 32, 16, 3
    comps = _bank_components(scheme, H, I)
    w = FtwWriter(tmp_path / "m")
    w.add_tensor("before", torch.ones(5))  # the bank does not start at offset 0
    bank = w.add_expert_bank("layers.0.mlp.experts", scheme, E, comps)
    experts = [_expert_parts(comps) for _ in range(E)]
    for e, parts in enumerate(experts):
        bank.write_expert(e, parts)
    finish(w, moe_config(num_experts=E, num_experts_per_tok=1),
           quant={"linears": {}, "experts": scheme, "source": None})

    r = FtwReader(tmp_path / "m")
    b = r.bank("layers.0.mlp.experts")
    # Independent statement of the layout rule: components packed in declaration order at 256-aligned offsets.
    off, layout = 0, {}
    for cname, (dtype, shape) in comps.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        layout[cname] = (off, n)
        off = -(-(off + n) // COMPONENT_ALIGN) * COMPONENT_ALIGN
    used = max(o + n for o, n in layout.values())
    assert b.scheme == scheme and b.num_experts == E
    assert b.stride == -(-used // 4096) * 4096 and b.offset % 4096 == 0 and b.offset > 0
    assert {k: (c.offset, c.nbytes) for k, c in b.components.items()} == layout
    raw = (tmp_path / "m" / b.file.name).read_bytes()
    for e, parts in enumerate(experts):
        rec = b.record(e)
        assert rec.dtype == torch.uint8 and rec.shape == (b.stride,)
        assert bytes(rec.numpy()) == raw[b.offset + e * b.stride:b.offset + (e + 1) * b.stride]  # one contiguous range
        assert not rec[used:].any()  # zero padding up to the stride
        for cname, t in parts.items():
            got = b.expert(e, cname)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(bits(got), bits(t)), (e, cname)
            assert torch.equal(bits(rec[layout[cname][0]:layout[cname][0] + layout[cname][1]]), bits(t))
    for cname in comps:
        stacked = b.stacked(cname)
        assert stacked.shape == (E, *comps[cname][1])
        assert torch.equal(bits(stacked), bits(torch.stack([p[cname] for p in experts])))
    if scheme == "nvfp4":
        for e, p in enumerate(experts):
            got = nvfp4.dequantize(b.expert(e, "down"), b.expert(e, "down_scale"), b.expert(e, "down_scale_2"))
            assert torch.equal(got, nvfp4.dequantize(p["down"], p["down_scale"], p["down_scale_2"]))
    assert r.verify() == []


def test_fp8_row_linear_round_trips(tmp_path: Path) -> None:
    weight = (torch.randn(8, 32, generator=G) * 10).to(torch.float8_e4m3fn)
    scale = torch.rand(8, generator=G) + 0.1  # f32 per output row
    w = FtwWriter(tmp_path / "m")
    w.add_tensor("layers.0.self_attn.o_proj.weight", weight)
    w.add_tensor("layers.0.self_attn.o_proj.weight_scale", scale)
    finish(w, quant={"linears": {"layers.0.self_attn.o_proj": "fp8_row"}, "experts": None, "source": None})
    r = FtwReader(tmp_path / "m")
    assert r.quant["linears"] == {"layers.0.self_attn.o_proj": "fp8_row"}
    got_w, got_s = r.tensor("layers.0.self_attn.o_proj.weight"), r.tensor("layers.0.self_attn.o_proj.weight_scale")
    assert got_w.dtype == torch.float8_e4m3fn and got_s.dtype == torch.float32 and got_s.shape == (8,)
    assert torch.equal(fp8.dequantize(got_w, got_s), fp8.dequantize(weight, scale))


def test_regions_larger_than_a_data_file_get_their_own_file(tmp_path: Path) -> None:
    big = torch.randn(5000, generator=G)  # 20000 bytes > shard_bytes
    w = FtwWriter(tmp_path / "m", shard_bytes=8192)
    w.add_tensor("small0", torch.arange(10, dtype=torch.int32))
    w.add_tensor("big", big)
    w.add_tensor("small1", torch.arange(3, dtype=torch.int64))
    bank = w.add_expert_bank("bank", "fp32", 3, {"w": (torch.float32, (40, 40))})  # 3 x 8192 > shard_bytes
    ws = [torch.randn(40, 40, generator=G) for _ in range(3)]
    for e in range(3):
        bank.write_expert(e, {"w": ws[e]})
    finish(w, moe_config(num_experts=3, num_experts_per_tok=1))
    r = FtwReader(tmp_path / "m")
    files = r.manifest["files"]
    assert [f["name"] for f in files] == [f"data-{i:05d}.ftd" for i in range(len(files))]
    where = {t["name"]: t["file"] for t in r.manifest["tensors"]}
    assert where == {"small0": 0, "big": 1, "small1": 2}
    assert r.manifest["expert_banks"][0]["file"] == 3 and files[1]["nbytes"] == align_up(20000)
    for f in files:
        assert f["nbytes"] % ALIGN == 0 and (tmp_path / "m" / f["name"]).stat().st_size == f["nbytes"]
    assert torch.equal(r.tensor("big"), big)
    assert torch.equal(r.tensor("small0"), torch.arange(10, dtype=torch.int32))
    assert all(torch.equal(r.bank("bank").expert(e, "w"), ws[e]) for e in range(3))
    assert r.verify() == []


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_tensors_are_zero_copy_views_of_the_mapped_file(tmp_path: Path) -> None:
    d = small_ftw(tmp_path / "m")
    r = FtwReader(d)
    data = str((d / "data-00000.ftd").resolve())
    for rec in r.manifest["tensors"]:
        t = r.tensor(rec["name"])
        assert file_offset(t.data_ptr()) == (data, rec["offset"])  # the bytes ARE the file's page cache
        assert r.tensor(rec["name"]).data_ptr() == t.data_ptr()  # no copy on a second call either
    b = r.bank("bank")
    for e in range(b.num_experts):
        assert file_offset(b.record(e).data_ptr()) == (data, b.offset + e * b.stride)
        assert file_offset(b.expert(e, "s").data_ptr()) == (data, b.offset + e * b.stride + b.components["s"].offset)
    stacked = b.stacked("s")
    assert file_offset(stacked.data_ptr()) == (data, b.offset + b.components["s"].offset)
    assert stacked.stride(0) * 4 == b.stride


def test_writer_output_is_deterministic(tmp_path: Path) -> None:
    a, b = small_ftw(tmp_path / "a"), small_ftw(tmp_path / "b")
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    assert names == ["data-00000.ftd", "model.ftw", "plans/tiny.plan", "tokenizer.json"]
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    assert str(tmp_path) not in (a / "model.ftw").read_bytes().decode("utf-8", "replace")  # no absolute paths


def test_assets_and_slots(tmp_path: Path) -> None:
    d = small_ftw(tmp_path / "m")
    r = FtwReader(d)
    assert r.asset("tokenizer.json") == b'{"version": "1.0"}'
    assert r.asset_path("tokenizer.json") == d / "tokenizer.json"
    assert [p["name"] for p in r.manifest["plans"]] == ["plans/tiny.plan"] and r.manifest["kernels"] == []
    assert (d / "plans" / "tiny.plan").read_bytes() == b"plan-bytes"


def test_writer_refuses_bad_input_without_leaving_stray_bytes(tmp_path: Path) -> None:
    w = FtwWriter(tmp_path / "m")
    w.add_tensor("x", torch.ones(3))
    with pytest.raises(ValueError, match="no FTW id"):
        w.add_tensor("y", torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="duplicate"):
        w.add_tensor("x", torch.ones(3))
    for bad in ("../t.json", "a/b", "model.ftw", "data-00001.ftd", "plans", ".hidden", "t.json\n"):
        with pytest.raises(ValueError, match="asset name"):
            w.add_asset(bad, b"{}")
    with pytest.raises(ValueError, match="unknown scheme"):
        w.add_expert_bank("bank", "int3", 2, {"w": (torch.float32, (2,))})
    bank = w.add_expert_bank("bank", "fp32", 2, {"w": (torch.float32, (2,))})
    with pytest.raises(ValueError, match="expected expert 0"):
        bank.write_expert(1, {"w": torch.ones(2)})
    with pytest.raises(ValueError, match="declared"):
        bank.write_expert(0, {"w": torch.ones(3)})
    with pytest.raises(RuntimeError, match="still being written"):
        w.add_tensor("z", torch.ones(1))
    with pytest.raises(RuntimeError, match="incomplete"):
        finish(w, moe_config(num_experts=2, num_experts_per_tok=1))
    bank.write_expert(0, {"w": torch.ones(2)})
    bank.write_expert(1, {"w": torch.zeros(2)})
    finish(w, moe_config(num_experts=2, num_experts_per_tok=1))
    r = FtwReader(tmp_path / "m")
    assert r.tensor_names() == ["x"] and r.verify() == []
    with pytest.raises(FileExistsError):
        FtwWriter(tmp_path / "m")


def test_force_replaces_an_existing_ftw(tmp_path: Path) -> None:
    small_ftw(tmp_path / "m")
    w = FtwWriter(tmp_path / "m", force=True)
    w.add_tensor("only", torch.arange(4, dtype=torch.int32))
    finish(w)
    r = FtwReader(tmp_path / "m")
    assert r.tensor_names() == ["only"] and not (tmp_path / "m" / "tokenizer.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp or old directories left behind
