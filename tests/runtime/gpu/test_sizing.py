"""The VRAM split's arithmetic (`ft.runtime.gpu.sizing`): the byte-count parser behind --vram-budget, the slots that
fit, the default KV budget, the activation reserve of a prefill chunk, the allocator settings, per-sequence state."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.engine import Engine, EngineSettings
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.sizing import (KV_MAX_SHARE, KV_MIN_TOKENS, KV_TARGET_TOKENS, OFFLOADED_PREFILL_CHUNK,
                                   activation_reserve, default_kv_tokens, dequant_transient, parse_bytes, plan_vram,
                                   state_bytes)
from ft.runtime.layers.linear import DEQUANT_TRANSIENT
from ft.runtime.state import SequenceState

GIB = 1 << 30


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * GIB
    assert parse_bytes("12e9") == 12_000_000_000
    assert parse_bytes("12 GB") == 12_000_000_000
    assert parse_bytes("1.5GiB") == 3 * GIB // 2
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes(4096) == 4096
    for bad in ("eight", "8 parsecs", "-1GiB", "0", "0.1"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_plan_vram_math():
    p = plan_vram(10_000, dense=3_000, kv=1_000, stride=100, prefill_slots=2, reserve=500, max_slots=1_000)
    assert p.prefill_buffers == 400 and p.num_slots == (10_000 - 3_000 - 1_000 - 400 - 500) // 100 == 51
    assert plan_vram(10**9, dense=0, kv=0, stride=100, prefill_slots=1, reserve=0, max_slots=7).num_slots == 7
    with pytest.raises(ValueError, match="smaller than the fixed allocations"):
        plan_vram(4_000, dense=3_000, kv=1_000, stride=100, prefill_slots=2, reserve=500, max_slots=10)
    # what the device holds outside the engine's allocations (context, modules) comes off the slots
    q = plan_vram(10_000, dense=3_000, kv=1_000, stride=100, prefill_slots=2, reserve=500, max_slots=1_000,
                  outside=2_000)
    assert q.outside == 2_000 and q.num_slots == 51 - 20
    with pytest.raises(ValueError, match="in use at start"):
        plan_vram(10_000, dense=3_000, kv=1_000, stride=100, prefill_slots=2, reserve=500, max_slots=10,
                  outside=5_500)


def test_default_kv_budget_is_an_agent_context_where_the_budget_allows_it():
    """The real models' numbers at 8 GiB (benchmarks/gpu_full.md, runs 24-26: what the fixed parts leave):
    qwen3.6 (20 KiB of KV per token) gets a 64k context; qwen3moe-35b-geom (80 KiB) half of its room."""
    qwen36_room, geom_room = 8 * GIB - 1_116_536_832 - 3_921_912_832 - 4 * (64 << 20) - 114_032_640 - (GIB // 2), \
        8 * GIB - 990_707_712 - 2_217_394_176 - 114_032_640 - (GIB // 2)
    assert default_kv_tokens(qwen36_room, 20 << 10, 262_144) == KV_TARGET_TOKENS
    geom = default_kv_tokens(geom_room, 80 << 10, 40_960)
    assert KV_MIN_TOKENS < geom < KV_TARGET_TOKENS and geom * (80 << 10) <= KV_MAX_SHARE * geom_room
    assert default_kv_tokens(10**12, 1 << 10, 4096) == 4096  # never past the model's context
    assert default_kv_tokens(5_000 << 10, 1 << 10, 10**6) == KV_MIN_TOKENS  # never below the former default
    assert default_kv_tokens(0, 1 << 10, 1000) == 768 and default_kv_tokens(10**9, 1000, 10**6) % 256 == 0


def test_activation_reserve_follows_the_prefill_chunk(ftw_for):
    """The VRAM plan's activation reserve is the model's for the engine's prefill chunk (given, else the default at
    a budget), and an explicit OffloadConfig.reserve_bytes wins; a DeltaNet model's grows past deltanet.PIECE tokens
    by its projections only, its fp32 rule temporaries being bounded to a piece."""
    from ft.runtime.layers.deltanet import PIECE

    ftw = ftw_for("qwen3_5_moe", "nvfp4")
    cfg = FtwReader(ftw).config
    elem = FtwReader(ftw).tensor("embed_tokens.weight").element_size()
    for chunk in (None, 512):
        eng = Engine(ftw, EngineSettings(device="cpu", vram_budget=64 * GIB, max_prefill_length=chunk),
                     offload=OffloadConfig(mode="resident"))
        plan = eng._experts.vram_plan  # dense linears kept quantized (auto, batches of 4): their dequantization too
        assert plan.dense_quantized and 0 < dequant_transient(FtwReader(ftw)) < DEQUANT_TRANSIENT
        assert plan.reserve == activation_reserve(cfg, chunk or OFFLOADED_PREFILL_CHUNK, elem) + dequant_transient(
            FtwReader(ftw))
        eng.close()
    eng = Engine(ftw, EngineSettings(device="cpu", vram_budget=64 * GIB),
                 offload=OffloadConfig(mode="resident", reserve_bytes=12345))
    assert eng._experts.vram_plan.reserve == 12345
    eng.close()
    # the tiny model's attention (many heads for its width) is its widest layer: narrowed to one head, the DeltaNet
    # layer's temporaries are
    narrow = dataclasses.replace(cfg, num_heads=1, num_kv_heads=1)
    below = activation_reserve(narrow, PIECE, elem) - activation_reserve(narrow, PIECE // 2, elem)
    above = activation_reserve(narrow, 2 * PIECE, elem) - activation_reserve(narrow, 3 * PIECE // 2, elem)
    assert above < below  # past a piece, a token adds no rule temporaries
    assert activation_reserve(cfg, 4096, elem) > activation_reserve(cfg, 2048, elem)


def test_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    from ft.runtime.gpu import sizing

    calls = []
    monkeypatch.setattr(sizing, "_set_allocator_settings", calls.append)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    assert sizing.expandable_segments() and calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    assert not sizing.expandable_segments() and len(calls) == 1


def test_state_bytes_match_a_real_state(ftw_for):
    cfg = FtwReader(ftw_for("qwen3_5_moe", "nvfp4")).config
    per_token, per_seq = state_bytes(cfg, torch.bfloat16)
    assert per_token > 0 and per_seq > 0  # qwen3_5_moe: full-attention KV + DeltaNet state
    for n in (1, 7, 33):
        assert SequenceState(cfg, n, dtype=torch.bfloat16, device=torch.device("cpu")).nbytes == per_seq + n * per_token
