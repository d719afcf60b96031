"""The model runtime driven by the GPU experts scheduler (CPU emulation): same logits as the default CPU experts."""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.store import GpuExperts
from ft.runtime.model import Segment, load_model

from .gpu_fixtures import rel_err


def _logits(model, prompt):
    st = model.new_state(len(prompt) + 4)
    out = model.forward(torch.tensor(prompt), [Segment(st, len(prompt), logits="all")])[0]
    nxt = model.forward(torch.tensor([int(out[-1].argmax())]), [Segment(st, 1)])[0]
    return torch.cat([out, nxt])


def test_load_model_with_scheduler_matches_cpu_experts(ftw_for):
    ftw = ftw_for("qwen3_5_moe", "nvfp4")
    reader = FtwReader(ftw)
    ex = GpuExperts(reader, OffloadConfig(num_slots=5, b_pcie=1e9, b_cpu=1e9, prefill_tokens=4),
                    device="cpu")
    sched = load_model(reader, device="cpu", experts=ex)
    ref = load_model(ftw, device="cpu")
    prompt = [5, 17, 3, 99, 42, 7]
    a, b = _logits(sched, prompt), _logits(ref, prompt)
    assert a.shape == b.shape and torch.isfinite(a).all()
    assert rel_err(a, b) < 3e-2  # bf16 model: CPU experts round dequantized weights to bf16, the kernels do not
    s = ex.stats()
    assert s["prefill_calls"] > 0 and s["calls"] > s["prefill_calls"]  # prompt streamed, next token decoded
    ex.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_gathers_embedding_rows_from_the_host(ftw_for):
    reader = FtwReader(ftw_for("qwen3_5_moe", "nvfp4"))
    model = load_model(reader, device="cuda")
    table = reader.tensor("embed_tokens.weight")
    assert model.embed_tokens.weight.device.type == "cpu"
    batches = [torch.tensor(ids) for ids in ([3, 1, 3], list(range(200)), [7, 7], [9] * 150)]
    outs = [model.embed_tokens(ids) for ids in batches]  # no sync between calls: the buffer grows, then is reused
    for ids, out in zip(batches, outs):
        assert out.device.type == "cuda" and torch.equal(out.cpu(), table[ids])
