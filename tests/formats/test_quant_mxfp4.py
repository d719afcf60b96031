"""MXFP4 (gpt-oss experts): exact dequantization against a per-element reference and against transformers' own
dequantization; the synthetic encoder's output is reproduced exactly."""

from __future__ import annotations

import pytest
import torch

from ft.formats.quant import mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element by element, straight from the format: element j of block g of row r is nibble j % 2 (low first) of
    byte blocks[r, g * 16 + j // 2], times 2^(scale - 127)."""
    rows, half = blocks.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    for r in range(rows):
        for i in range(half * 2):
            byte = int(blocks[r, i // 2])
            code = byte & 0xF if i % 2 == 0 else byte >> 4
            mag = E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
            out[r, i] = mag * 2.0 ** (int(scales[r, i // 32]) - 127)
    return out


def test_every_byte_and_scale_matches_the_reference():
    blocks = torch.arange(256, dtype=torch.uint8).repeat(2, 1)            # [2, 256]: every byte, 512 elements/row
    scales = torch.tensor([[0, 1, 100, 127, 128, 150, 200, 254, 126, 125, 3, 64, 190, 240, 252, 253]] * 2,
                          dtype=torch.uint8)
    got = mxfp4.dequantize(blocks, scales)
    assert got.dtype == torch.float32 and got.shape == (2, 512)
    # exact: float32 subnormals (scale 2^-127) included; beyond float32's range (6 * 2^127) it is inf, like transformers
    assert torch.equal(got, reference(blocks, scales).float())
    assert torch.isinf(got).any() and (got[got != 0].abs().min() == 2.0 ** -128)


def test_matches_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)    # [E, out, in/32, 16]
    scales = torch.randint(100, 140, (3, 40, 4), dtype=torch.uint8, generator=gen)      # [E, out, in/32]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)          # [E, in, out]
    ours = mxfp4.dequantize(blocks.flatten(-2), scales)                               # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_encoder_round_trip_is_exact_after_one_pass():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 0.03
    w[3, :32] = 0.0                                                       # an all-zero block: scale 2^0, codes 0
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (64, 48) and scales.shape == (64, 3) and int(scales[3, 0]) == 127
    deq = mxfp4.dequantize(blocks, scales)
    assert (deq - w).abs().max() <= w.abs().max() / 4                    # E2M1 spacing at the top of a block
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(deq)), deq)       # representable values stay put
    assert torch.equal(deq.bfloat16().float(), deq)                      # exact in bf16 (the twin's dtype)


@pytest.mark.parametrize("blocks, scales, match", [
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "do not match"),
    (torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8), "must be uint8"),
    (torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), "do not match"),
])
def test_bad_shapes_are_refused(blocks, scales, match):
    with pytest.raises(ValueError, match=match):
        mxfp4.dequantize(blocks, scales)
