"""Quantized dense linears kept quantized (`keep_quantized`): the same weights, dequantized chunk by chunk per call,
give the results of the linear dequantized once at load; the model holds the stored bytes instead of bf16."""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.layers import linear as linear_mod
from ft.runtime.layers.linear import Linear
from ft.runtime.model import Segment, load_model

OUT, IN = 96, 64


def _tensors(scheme: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    if scheme == "nvfp4":
        return {"weight": torch.randint(0, 256, (OUT, IN // 2), dtype=torch.uint8, generator=g),
                "weight_scale": (torch.rand(OUT, IN // 16, generator=g) + 0.5).to(torch.float8_e4m3fn),
                "weight_scale_2": torch.rand(OUT, generator=g) * 0.01 + 0.001}
    return {"weight": (torch.randn(OUT, IN, generator=g) * 8).to(torch.float8_e4m3fn),
            "weight_scale": torch.rand(OUT, generator=g) * 0.1 + 0.01}


def _linear(scheme: str, keep: bool, bias: bool, dtype: torch.dtype, device: str = "cpu") -> Linear:
    g = torch.Generator().manual_seed(7)
    op = Linear()
    for k, v in _tensors(scheme, g).items():
        setattr(op, k, v)
    op.bias = torch.randn(OUT, generator=g) if bias else None
    op.prepare("l", scheme, dtype, torch.device(device), keep_quantized=keep)
    return op


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8_row"])
@pytest.mark.parametrize("chunk_rows", [None, 7])  # one chunk; several, the last one short
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_quantized_linear_equals_the_dequantized_one(scheme, chunk_rows, dtype, monkeypatch):
    if chunk_rows is not None:
        monkeypatch.setattr(linear_mod, "CHUNK_BYTES", chunk_rows * 4 * IN)
    ref, kept = _linear(scheme, False, True, dtype), _linear(scheme, True, True, dtype)
    assert kept.stays_quantized and not ref.stays_quantized
    assert kept.weight.dtype in (torch.uint8, torch.float8_e4m3fn) and ref.weight.dtype == dtype
    assert kept.weight_shape == ref.weight_shape == (OUT, IN)
    x = torch.randn(3, 5, IN).to(dtype)
    want, got = ref(x), kept(x)
    assert got.shape == want.shape == (3, 5, OUT) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["nvfp4", "fp8_row"])
def test_a_kept_quantized_prefill_projection_never_blocks_the_host(scheme):
    """A prompt's projection dequantizes on the GPU without a host sync: one (a constant table copied to the device
    on each call) made the host wait for the GPU's queue 5 times a layer and left prefill copies unqueued."""
    op = _linear(scheme, True, True, torch.bfloat16, "cuda")
    x = torch.randn(300, IN, device="cuda", dtype=torch.bfloat16)  # prefill-sized: the dequantizing path
    want = op(x)  # first call: one-time set-up may copy
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = op(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


def test_kept_quantized_linear_refuses_what_the_dequantizing_one_refuses():
    op = Linear()
    op.weight, op.weight_scale = torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.ones(3)
    with pytest.raises(ValueError, match="fp8_row wants weight_scale"):
        op.prepare("m.proj", "fp8_row", torch.float32, torch.device("cpu"), keep_quantized=True)


def test_model_with_quantized_dense_weights_gives_the_same_logits(ftw_for):
    reader = FtwReader(ftw_for("qwen3_5_moe", "nvfp4"))
    quantized = reader.quant["linears"]
    assert set(quantized.values()) >= {"nvfp4", "fp8_row"}  # the ModelOpt mixed layout: both schemes occur
    ref, kept = load_model(reader), load_model(reader, keep_quantized=True)
    lm = kept.lm_head if "lm_head" in quantized else None
    assert lm is None or (lm.stays_quantized and lm.weight.dtype == torch.uint8)

    def weight_bytes(model) -> int:
        total = [0]
        model.map_weights(lambda n, t: total.__setitem__(0, total[0] + t.nbytes) or t)
        return total[0]

    assert weight_bytes(kept) < weight_bytes(ref)
    prompt = torch.tensor([5, 17, 3, 99, 42, 7])
    outs = []
    for model in (ref, kept):
        st = model.new_state(8)
        outs.append(model.forward(prompt, [Segment(st, len(prompt), logits="all")])[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
