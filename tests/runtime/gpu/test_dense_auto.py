"""--dense-weights auto: an FTW's quantized dense linears stay quantized on the GPU when every decode batch fits the
dequantizing GEMV, or when the budget cannot hold every expert with them dequantized; else they are dequantized. The
engine and `ft plan` resolve it the same way."""

from __future__ import annotations

import pytest

from ft.formats import FtwReader
from ft.runtime.engine import Engine, EngineSettings
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.sizing import dense_weight_bytes, resolve_dense
from ft.runtime.layers.linear import GEMV_MAX_TOKENS


@pytest.fixture(scope="module")
def reader(ftw_for):
    r = FtwReader(ftw_for("qwen3_moe", "nvfp4"))
    assert r.quant.get("linears")  # attention linears stored as NVFP4
    return r


def _everything_dequantized(reader) -> int:
    nonlayer, per_layer = dense_weight_bytes(reader, keep_quantized=False)
    banks = [reader.bank(n) for n in reader.bank_names()]
    assert banks and nonlayer > 0
    return nonlayer + sum(per_layer.values()) + sum(b.num_experts * b.stride for b in banks)


def test_auto_keeps_them_quantized_for_batches_the_gemv_takes(reader):
    for budget in (None, 1, 64 << 30):
        assert resolve_dense(reader, "auto", budget, GEMV_MAX_TOKENS) == "quantized"
        assert resolve_dense(reader, "auto", budget, 1) == "quantized"


def test_for_bigger_batches_auto_keeps_them_quantized_when_the_experts_compete_with_them_for_the_budget(reader):
    edge, big = _everything_dequantized(reader), GEMV_MAX_TOKENS + 1
    assert resolve_dense(reader, "auto", edge - 1, big) == "quantized"
    assert resolve_dense(reader, "auto", edge, big) == "dequantized"
    assert resolve_dense(reader, "auto", None, big) == "dequantized"  # no budget: nothing to share
    for choice in ("dequantized", "quantized"):  # explicit choices pass through
        assert resolve_dense(reader, choice, edge - 1, 1) == choice
        assert resolve_dense(reader, choice, edge, big) == choice


def test_auto_dequantizes_an_ftw_without_quantized_dense_linears(ftw_for):
    assert resolve_dense(FtwReader(ftw_for("qwen3_moe", "none")), "auto", 1, 1) == "dequantized"


def test_the_engine_applies_it(reader):
    tight = _everything_dequantized(reader) - 1
    kw = dict(device="cpu", kv_reserve_tokens=16)
    for budget, batch, want in ((tight, 9, True), (64 << 30, 9, False), (64 << 30, 4, True)):
        eng = Engine(reader, EngineSettings(vram_budget=budget, max_running_requests=batch, **kw),
                     offload=OffloadConfig(num_slots=2, reserve_bytes=0, prefill_slots=1))
        assert eng._experts.vram_plan.dense_quantized is want and eng._experts.opts.dense == (
            "quantized" if want else "dequantized")
        eng.close()
    with pytest.raises(ValueError, match="--dense-weights 'fp4'; use auto, dequantized or quantized"):
        EngineSettings(dense_weights="fp4")
