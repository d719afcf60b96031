"""The worked example of specs/ftw.md, byte for byte: FtwWriter output == the bytes below == the spec's hexdumps."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch
import xxhash
from ftw_testlib import worked_example

from ft.formats import FtwReader

SPEC = Path(__file__).resolve().parents[2] / "specs" / "ftw.md"

# model.ftw: the 64-byte header ...
HEADER_HEX = (
    "46 54 57 00 0d 0a 1a 0a"  # magic "FTW\0\r\n\x1a\n"
    "01 00 00 00"  # version 1.0 (u16 major, u16 minor)
    "40 00 00 00"  # header_size 64
    "40 00 00 00 00 00 00 00"  # manifest_offset 64
    "ea 04 00 00 00 00 00 00"  # manifest_nbytes 1258
    "86 1e ee 57 8c e6 b7 c8"  # manifest_xxh3 0xc8b7e68c57ee1e86
    + " 00" * 24  # reserved
)
# ... then the manifest, compact JSON, exactly these bytes.
MANIFEST = (
    b'{"format":"ftw","version":[1,0],"alignment":4096,"checksum":"xxh3_64","requires":[],'
    b'"files":[{"name":"data-00000.ftd","nbytes":8192}],'
    b'"tensors":[{"name":"a","dtype":"F32","shape":[2,2],"file":0,"offset":0,"nbytes":16,"xxh3":"a82f522ec4510db4"},'
    b'{"name":"b","dtype":"BF16","shape":[3],"file":0,"offset":4096,"nbytes":6,"xxh3":"07d550776e8062ba"}],'
    b'"expert_banks":[],"assets":[],'
    b'"config":{"family":"qwen3_moe","vocab_size":4,"hidden_size":2,"num_layers":1,"num_heads":1,"num_kv_heads":1,'
    b'"head_dim":2,"rms_norm_eps":1e-06,"rope_theta":10000.0,"rotary_dim":2,"max_position_embeddings":16,'
    b'"layer_types":["full_attention"],"mlp_types":["dense"],"attn_qkv_bias":false,"attn_qk_norm":false,'
    b'"attn_output_gate":false,"num_experts":0,"num_experts_per_tok":0,"moe_intermediate_size":0,'
    b'"norm_topk_prob":false,"shared_expert_intermediate_size":0,"intermediate_size":4,"linear_num_key_heads":0,'
    b'"linear_num_value_heads":0,"linear_key_head_dim":0,"linear_value_head_dim":0,"linear_conv_kernel_dim":0,'
    b'"tie_word_embeddings":true,"bos_token_id":null,"eos_token_ids":[3]},'
    b'"quant":{"linears":{},"experts":null,"source":null},"tokenizer":{},"generation":{},'
    b'"provenance":{"source":"example/tiny","revision":null,"files":{},"compiler":"ft 0.1.0"},'
    b'"plans":[],"kernels":[],"metadata":{}}'
)
# data-00000.ftd: 8192 bytes, zero except for the two tensors.
DATA_SIZE = 8192
DATA_HEX = {
    0x0000: "00 00 80 3f  00 00 00 40  00 00 40 40  00 00 80 40",  # a: F32 1.0 2.0 3.0 4.0
    0x1000: "80 3f  00 c0  00 3f",  # b: BF16 1.0 -2.0 0.5
}


def expected_index() -> bytes:
    return bytes.fromhex(HEADER_HEX) + MANIFEST


def expected_data() -> bytes:
    out = bytearray(DATA_SIZE)
    for off, hx in DATA_HEX.items():
        b = bytes.fromhex(hx)
        out[off:off + len(b)] = b
    return bytes(out)


def hexdump_c(data: bytes) -> str:
    """`hexdump -C` output: 16 bytes a line, repeated lines folded into `*`, the length on the last line."""
    lines, prev, folded = [], None, False
    for off in range(0, len(data), 16):
        row = data[off:off + 16]
        if row == prev and off + 16 <= len(data):
            if not folded:
                lines.append("*")
            folded = True
            continue
        prev, folded = row, False
        hx = " ".join(f"{b:02x}" for b in row[:8]) + "  " + " ".join(f"{b:02x}" for b in row[8:])
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in row)
        lines.append(f"{off:08x}  {hx:<48}  |{text}|")
    lines.append(f"{len(data):08x}")
    return "\n".join(lines)


def parse_hexdump(text: str) -> bytes:
    """Inverse of hexdump_c (reads the hex columns, expands `*`, checks the offsets)."""
    out, last, pending_star = bytearray(), b"", False
    for line in text.strip().splitlines():
        if line == "*":
            pending_star = True
            continue
        m = re.fullmatch(r"([0-9a-f]{8})(?:  ((?:[0-9a-f]{2} ?){1,8})(?: ((?:[0-9a-f]{2} ?){1,8}))? *\|.*\|)?", line)
        assert m, f"not a hexdump line: {line!r}"
        off = int(m.group(1), 16)
        if pending_star:
            assert (off - len(out)) % 16 == 0
            out += last * ((off - len(out)) // 16)
            pending_star = False
        assert off == len(out), f"offset {off:#x} but {len(out):#x} bytes so far"
        if m.group(2):
            last = bytes.fromhex((m.group(2) + " " + (m.group(3) or "")).replace(" ", ""))
            out += last
    return bytes(out)


def spec_block(info: str) -> str:
    m = re.search(rf"^```{re.escape(info)}\n(.*?)^```$", SPEC.read_text(encoding="utf-8"), re.S | re.M)
    assert m, f"no ```{info} block in {SPEC.name}"
    return m.group(1)


def test_writer_reproduces_the_example_byte_for_byte(tmp_path: Path) -> None:
    d = worked_example(tmp_path / "tiny.ftw")
    assert sorted(p.name for p in d.iterdir()) == ["data-00000.ftd", "model.ftw"]
    assert (d / "model.ftw").read_bytes() == expected_index()
    assert (d / "data-00000.ftd").read_bytes() == expected_data()


def test_spec_hexdumps_match_the_bytes() -> None:
    index, data = expected_index(), expected_data()
    assert parse_hexdump(spec_block("hexdump model.ftw")) == index
    assert parse_hexdump(spec_block("hexdump data-00000.ftd")) == data
    assert spec_block("hexdump model.ftw").strip() == hexdump_c(index)  # the ASCII column too
    assert spec_block("hexdump data-00000.ftd").strip() == hexdump_c(data)
    assert json.loads(spec_block("json manifest")) == json.loads(MANIFEST)  # the pretty-printed copy


def test_example_fields_decode_as_annotated(tmp_path: Path) -> None:
    index = expected_index()
    magic, major, minor, hsize, moff, mlen, mhash, reserved = struct.unpack("<8sHHIQQQ24s", index[:64])
    assert (magic, major, minor, hsize, moff, mlen) == (b"FTW\x00\r\n\x1a\n", 1, 0, 64, 64, len(MANIFEST))
    assert mhash == xxhash.xxh3_64_intdigest(MANIFEST) == 0xC8B7E68C57EE1E86 and reserved == bytes(24)
    data = expected_data()
    assert xxhash.xxh3_64_hexdigest(data[0:16]) == "a82f522ec4510db4"
    assert xxhash.xxh3_64_hexdigest(data[4096:4102]) == "07d550776e8062ba"
    r = FtwReader(worked_example(tmp_path / "tiny.ftw"))
    assert torch.equal(r.tensor("a"), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(r.tensor("b"), torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16))
    assert r.verify() == []
