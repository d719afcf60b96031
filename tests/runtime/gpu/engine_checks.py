"""Shared engine-level checks of a family on the GPU expert scheduler (CPU emulation here, CUDA where present)."""

from __future__ import annotations

import torch

from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.gpu.engine_setup import _weight_bytes
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.sizing import LATE_OUTSIDE, state_bytes
from ft.runtime.model import Segment

GIB = 1 << 30
PROMPT = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt_logits(model, prompt):
    """fp32 [len(prompt) + 1, V]: the prompt's logits, then one greedy decode step's."""
    st = model.new_state(len(prompt) + 4)
    out = model.forward(torch.tensor(prompt), [Segment(st, len(prompt), logits="all")])[0]
    nxt = model.forward(torch.tensor([int(out[-1].argmax())]), [Segment(st, 1)])[0]
    return torch.cat([out, nxt])


def resident_then_budget(ftw, prompt, params) -> tuple[int, dict]:
    """Greedy tokens of the engine fully resident, then at a VRAM budget that leaves exactly 5 expert slots (equal
    link and CPU rates), each equal to the CPU engine's. -> (the resident engine's slots, the budget engine's
    MoE counters); asserts the resident run missed nothing and the budget run missed."""
    kw = dict(device="cpu", kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    want = generate(Engine(ftw, EngineSettings(**kw)), prompt, params).token_ids
    eng = Engine(ftw, EngineSettings(vram_budget=64 * GIB, memory_ratio=0.9, **kw),
                 offload=OffloadConfig(mode="resident"))
    slots = eng._experts.num_slots
    assert generate(eng, prompt, params).token_ids == want and eng.stats()["moe"]["misses"] == 0
    eng.close()
    probe = Engine(ftw, EngineSettings(**kw), offload=OffloadConfig(num_slots=1))
    stride, dense = probe._experts.layout.stride, _weight_bytes(probe.model)
    per_token, per_seq = state_bytes(probe.config, probe.model.dtype)
    probe.close()
    budget = dense + 256 * per_token + 2 * per_seq + 2 * 32 * stride + (1 << 20) + 5 * stride + stride // 2
    eng = Engine(ftw, EngineSettings(vram_budget=budget, **kw),
                 offload=OffloadConfig(b_pcie=1e9, b_cpu=1e9, reserve_bytes=1 << 20))
    try:
        assert eng._experts.num_slots == eng._experts.vram_plan.num_slots == 5
        assert generate(eng, prompt, params).token_ids == want
        moe = eng.stats()["moe"]
        assert moe["misses"] > 0 and moe["fetched"] + moe["cpu_experts"] == moe["misses"]
        return slots, moe
    finally:
        eng.close()


def cuda_engine_matches_cpu(ftw, prompt, params) -> None:
    """A bank the GPU expert store has no kernel for (BF16 experts): on CUDA the engine runs the layers on the device
    with the experts on the CPU (no store), and its greedy tokens equal the CPU engine's."""
    kw = dict(kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    want = generate(Engine(ftw, EngineSettings(device="cpu", **kw)), prompt, params).token_ids
    eng = Engine(ftw, EngineSettings(device="cuda", **kw))
    try:
        assert eng._experts is None  # the CPU experts of load_model
        assert generate(eng, prompt, params).token_ids == want
    finally:
        eng.close()


def store_matches_cpu(ftw, prompt, params, *, device: str) -> dict:
    """The GPU expert store with a few slots (CPU emulation on device "cpu"; on CUDA a VRAM budget, decoding eagerly
    where the family's layers are PyTorch ops) gives the CPU engine's greedy tokens. -> the store's counters."""
    kw = dict(kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    want = generate(Engine(ftw, EngineSettings(device="cpu", **kw)), prompt, params).token_ids
    if device == "cpu":
        eng = Engine(ftw, EngineSettings(device="cpu", **kw), offload=OffloadConfig(num_slots=3))
    else:
        probe = Engine(ftw, EngineSettings(device="cuda", memory_ratio=0.5, **kw))  # everything fits: resident
        plan, stride = probe.vram_plan, probe._experts.layout.stride
        probe.close()
        budget = LATE_OUTSIDE + plan.dense + plan.kv + plan.prefill_buffers + plan.reserve + 3 * stride + 4096
        eng = Engine(ftw, EngineSettings(device="cuda", vram_budget=budget, **kw))  # the caller zeroes device_in_use
    try:
        assert eng._experts is not None and eng._experts.num_slots < len(eng._experts.moe_layers) * eng._experts.E
        assert generate(eng, prompt, params).token_ids == want
        eng._experts.settle()
        return eng.stats()["moe"]
    finally:
        eng.close()


def quantized_ftw(hf, out_dir):
    """The family's tiny checkpoint compiled with its routed experts quantized to NVFP4 (`--quantize nvfp4`)."""
    from ft.compiler import compile_checkpoint

    return compile_checkpoint(hf, out_dir / "nvfp4.ftw", quantize="nvfp4", progress=False)
