"""NVFP4 / FP8 byte definitions (ft.formats.quant) and ModelOpt quantization (ft.compiler.quant), checked against
reference formulas written out here element by element, independently of the vectorised code."""

from __future__ import annotations

import math

import pytest
import torch

from ft.compiler.quant import fp8 as fp8_quant
from ft.compiler.quant import nvfp4 as nvfp4_quant
from ft.formats.quant import fp8, nvfp4

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_value(code: int) -> float:
    """E2M1 by its bit fields: sign bit 3; exponent bits 1-2; mantissa bit 0 (exponent 0 = subnormal, step 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
    return sign * mag


def ref_dequantize(weight: torch.Tensor, scale: torch.Tensor, scale_2) -> torch.Tensor:
    """ModelOpt: per_block_scale = float32(e4m3) * scale_2, then value * per_block_scale; loops, float32 math."""
    out_f, half = weight.shape
    w = torch.empty(out_f, half * 2, dtype=torch.float32)
    s2 = scale_2.reshape(-1).tolist()
    for o in range(out_f):
        g = torch.tensor(s2[o] if len(s2) > 1 else s2[0], dtype=torch.float32)
        for j in range(half):
            byte = int(weight[o, j])
            for k, code in enumerate((byte & 0xF, byte >> 4)):  # low nibble = even element
                i = 2 * j + k
                block = scale[o, i // 16].float() * g
                w[o, i] = torch.tensor(ref_value(code), dtype=torch.float32) * block
    return w


def ref_code(x: float) -> int:
    """Nearest E2M1 magnitude, ties to the even mantissa (code bit 0 clear), saturating at 6; sign from x < 0."""
    a = abs(x)
    best = min(range(8), key=lambda c: (abs(MAGNITUDES[c] - a), c & 1))
    return best | (8 if x < 0 else 0)


def test_lut_matches_bit_fields():
    assert nvfp4.E2M1_LUT.tolist() == [ref_value(c) for c in range(16)]


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = nvfp4.pack_nibbles(codes)
    assert packed.shape == (5, 32)
    assert torch.equal(packed & 0xF, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(nvfp4.unpack_nibbles(packed), codes)
    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(nvfp4.pack_nibbles(nvfp4.unpack_nibbles(every)), every)


@pytest.mark.parametrize("per_row", [False, True])
def test_dequantize_equals_modelopt_definition(per_row):
    g = torch.Generator().manual_seed(3)
    weight = torch.randint(0, 256, (6, 24), dtype=torch.uint8, generator=g)
    scale = (torch.rand(6, 3, generator=g) * 300 + 0.01).to(torch.float8_e4m3fn)
    s2 = torch.rand(6 if per_row else (), generator=g, dtype=torch.float32) * 1e-3 + 1e-5  # arbitrary fp32 mantissas
    got = nvfp4.dequantize(weight, scale, s2)
    assert got.dtype == torch.float32 and got.shape == (6, 48)
    assert torch.equal(got, ref_dequantize(weight, scale, s2))


def test_dequantize_batched_and_shape_errors():
    weight = torch.randint(0, 256, (2, 3, 8), dtype=torch.uint8)
    scale = torch.ones(2, 3, 1).to(torch.float8_e4m3fn)
    s2 = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 1.0]])
    got = nvfp4.dequantize(weight, scale, s2)
    for e in range(2):
        assert torch.equal(got[e], ref_dequantize(weight[e], scale[e], s2[e]))
    with pytest.raises(ValueError, match="do not match"):
        nvfp4.dequantize(weight, torch.ones(2, 3, 2).to(torch.float8_e4m3fn), s2)
    with pytest.raises(ValueError, match="scalar or per row"):
        nvfp4.dequantize(weight, scale, torch.ones(4))
    with pytest.raises(ValueError, match="dtypes"):
        nvfp4.dequantize(weight.float(), scale, s2)


def test_quantize_matches_modelopt_recipe():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g) * 0.03
    w[0, :16] = 0.0  # an all-zero block gets scale 1.0
    q, bs, s2 = nvfp4_quant.quantize(w)
    assert q.dtype == torch.uint8 and q.shape == (8, 32)
    assert bs.dtype == torch.float8_e4m3fn and bs.shape == (8, 4)
    assert s2.dtype == torch.float32 and s2.shape == ()
    assert float(s2) == pytest.approx(float(w.abs().max()) / 2688, rel=1e-6)
    assert float(bs[0, 0].float()) == 1.0
    codes = nvfp4.unpack_nibbles(q)
    for o in range(8):
        for b in range(4):
            blk = w[o, 16 * b: 16 * b + 16]
            amax = float(blk.abs().max())
            want_scale = torch.tensor(amax / (6 * float(s2)) if amax else 1.0).to(torch.float8_e4m3fn)
            assert bs[o, b].view(torch.uint8) == want_scale.view(torch.uint8)
            denom = torch.tensor(float(bs[o, b].float()), dtype=torch.float32) * s2
            for i in range(16):
                x = float(blk[i] / denom)
                assert int(codes[o, 16 * b + i]) == ref_code(x) or (x == 0 and int(codes[o, 16 * b + i]) in (0, 8))


def test_quantize_ties_round_half_to_even():
    # with s2 = 1 and a block amax of 6, block scale 1.0: the values below are exact E2M1 midpoints
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -3.5, -5.5, 0.0, 0.1, 1.0, 4.5, 5.5])
    q, bs, _ = nvfp4_quant.quantize(row.reshape(1, 16), torch.tensor(1.0))
    assert float(bs.float()) == 1.0
    got = nvfp4.dequantize(q, bs, torch.tensor(1.0))[0].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, -6.0, 0.0, 0.0, 1.0, 4.0, 6.0]


def test_quantize_error_and_requantize_fixpoint():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    q, bs, s2 = nvfp4_quant.quantize(w)
    deq = nvfp4.dequantize(q, bs, s2)
    rel = float((deq - w).norm() / w.norm())
    assert 0.05 < rel < 0.13  # ~9.5% on Gaussian weights
    q2, bs2, s22 = nvfp4_quant.quantize(deq, s2)
    assert torch.equal(bs2.view(torch.uint8), bs.view(torch.uint8))
    c1, c2 = nvfp4.unpack_nibbles(q), nvfp4.unpack_nibbles(q2)
    same = (c1 == c2) | ((c1 & 7) == 0) & ((c2 & 7) == 0)  # -0 and +0 may swap
    assert bool(same.all())


def test_gate_up_share_the_joint_global():
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g) * 3
    s2 = nvfp4_quant.joint_global_scale(gate, up)
    assert float(s2) == pytest.approx(max(float(gate.abs().max()), float(up.abs().max())) / 2688, rel=1e-6)
    _, bs_g, s2_g = nvfp4_quant.quantize(gate, s2)
    _, _, s2_u = nvfp4_quant.quantize(up, s2)
    assert float(s2_g) == float(s2_u) == float(s2)
    assert float(bs_g.float().max()) < 448  # the smaller tensor's blocks get smaller scales


def test_quantize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="in % 16"):
        nvfp4_quant.quantize(torch.ones(4, 24))


def test_fp8_per_tensor_and_per_row():
    w = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    q, s = fp8_quant.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == () and float(s) == pytest.approx(float(w.abs().max()) / 448)
    deq = fp8.dequantize(q, s)
    assert torch.equal(deq, q.float() * s)
    assert float((deq - w).abs().max()) <= float(w.abs().max()) * 2 ** -4  # 3 mantissa bits: half-ulp <= 1/16
    rows = torch.tensor([1.0, 2.0, 0.5, 4.0, 0.25])
    got = fp8.dequantize(q, rows)
    for o in range(5):
        assert torch.equal(got[o], q[o].float() * rows[o])
    with pytest.raises(ValueError):
        fp8.dequantize(q, torch.ones(3))


def test_two_significant_bit_globals_make_bf16_exact():
    from ft.compiler.synth.nvfp4_checkpoint import two_bit_scale

    for x in (1e-5, 0.3, 1.0, 1.2, 1.5, 1.7, 3.0, 2688.0 / 7):
        s = two_bit_scale(x)
        m, _ = math.frexp(s)
        assert s >= x and m in (0.5, 0.75) and s <= 1.5 * x
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    q, bs, s2 = nvfp4_quant.quantize(w, two_bit_scale(float(w.abs().max()) / 2688))
    deq = nvfp4.dequantize(q, bs, s2)
    assert torch.equal(deq.to(torch.bfloat16).float(), deq)
