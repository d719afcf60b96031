"""Layer-pipelined prefill at a budget (`prefill_pipeline.py`): every expert without a slot streamed once per forward,
ahead of its layer, without waiting for the routing. On the CPU with the reference (and the Triton kernels under the
interpreter); on CUDA with page-locked banks and the copy stream."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.prefill_pipeline import uses_pipeline
from ft.runtime.gpu.prefill_plan import moe_nvfp4_prefill
from ft.runtime.gpu.store import GpuExperts

from .gpu_fixtures import rel_err, tiny_moe_ftw
from .test_gpu_moe_mapped import _full

E, K, H, I = 8, 4, 64, 32
T = 24  # T * K >= BLIND * E: streamed blind
CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return FtwReader(tiny_moe_ftw(tmp_path_factory.mktemp("pipe") / "m.ftw", experts=E, top_k=K, hidden=H, inter=I))


def _experts(reader, interpret=False, **kw):
    opts = OffloadConfig(mode="mapped", num_slots=5, prefill_slots=2, prefill_tokens=16, **kw)
    ex = GpuExperts(reader, opts, device=DEV, device_plan=True, interpret=interpret)
    ex.allocate()
    ex.wait_pinned(timeout=60)
    ex.cache.tick()  # layer 0 holds experts 1 and 6, layer 2 expert 3; the rest are streamed
    for layer, experts in ((0, [1, 6]), (2, [3])):
        slots, _ = ex.cache.admit_many(layer, np.array(experts))
        for e, s in zip(experts, slots.tolist()):
            ex.uploader.upload(s, reader.bank(f"layers.{layer}.mlp.experts").record(e))
    return ex


def _forward(ex, reader, g, layers=(0, 1, 2)):
    """One forward's MoE calls, in layer order -> [(y, want)]."""
    out = []
    for layer in layers:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        x, w = torch.randn(T, H, generator=g).to(torch.bfloat16), torch.rand(T, K, generator=g) + 0.1
        y = ex(layer, x.to(DEV), ids.to(DEV), w.to(DEV))
        out.append((y, _full(reader, layer, x, ids, w), (layer, x, ids, w)))
    return out


@pytest.mark.parametrize("interpret", [False, True])
def test_pipelined_prefill_streams_every_missing_expert_once_and_computes_every_pair(reader, interpret):
    if interpret and not INTERP:
        pytest.skip("needs Triton's interpreter on a machine without CUDA")
    ex = _experts(reader, interpret=interpret)
    owners = ex.cache.owner.copy()
    assert uses_pipeline(ex, 0, T) and not uses_pipeline(ex, 0, 8)  # too few tokens to route to every expert
    g = torch.Generator().manual_seed(3)
    for _ in range(2):  # two forwards: two schedules
        for y, want, _ in _forward(ex, reader, g):
            assert y.dtype == torch.bfloat16 and rel_err(y.float().cpu(), want) < 1e-2
    s = ex.stats()
    assert s["prefill_calls"] == 6 and s["tokens"] == 6 * T
    missing = 3 * E - 3
    assert s["prefill_streamed"] == 2 * missing  # every expert without a slot, once per forward
    assert s["bytes_h2d"] == 2 * missing * ex.layout.stride
    assert np.array_equal(ex.cache.owner, owners)  # nothing admitted, nothing evicted
    ex.settle()
    assert ex.cache.tokens[[0, 1, 2]].tolist() == [2 * T] * 3  # the routing came back and was counted
    assert ex.cache.counts[:3].sum() == 6 * T * K
    ex.close()


@pytest.mark.skipif(not (INTERP or CUDA), reason="needs the Triton kernels (CUDA or interpreter)")
def test_pipelined_prefill_equals_resident_prefill_bit_for_bit(reader):
    """Hits and each streamed group are separate calls of one plan; each pair's row is still computed once, by the
    tiles of a resident call: the fp32 sums equal the resident device-planned prefill's exactly."""
    ex = _experts(reader, interpret=not CUDA)
    recs = {i: torch.stack([reader.bank(f"layers.{i}.mlp.experts").record(e) for e in range(E)]).to(DEV)
            for i in range(3)}
    g = torch.Generator().manual_seed(8)
    row = torch.arange(E, dtype=torch.int32, device=DEV)  # the resident model's slots: all experts of the layer
    for layer in range(3):  # one forward, calling the pipeline itself for its fp32 sums (before the caller's cast)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEV)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEV)
        w = (torch.rand(T, K, generator=g) + 0.1).to(DEV)
        y = ex.pipeline(layer, x, ids, w)
        assert torch.equal(y, moe_nvfp4_prefill(recs[layer], ex.layout, x, ids, row, w)), layer
    assert ex.stats()["prefill_streamed"] == 3 * E - 3
    ex.close()


def test_a_layer_on_another_path_ends_the_schedule(reader):
    """A layer that takes another path (here: its bank was not verified, so its calls are host-planned) may use the
    prefill buffers itself: the schedule stops before it and starts again after it; every call still computes every
    pair."""
    ex = _experts(reader)
    assert ex.mapped.ready(1)
    del ex.mapped.base[1]
    assert not uses_pipeline(ex, 1, T) and uses_pipeline(ex, 0, T)
    g = torch.Generator().manual_seed(5)
    for y, want, _ in _forward(ex, reader, g):
        assert rel_err(y.float().cpu(), want) < 1e-2
    assert ex.pipeline.expect is None  # layer 2's own schedule has finished
    assert ex.stats()["prefill_calls"] >= 2
    ex.close()


def test_a_forward_stopped_part_way_is_abandoned(reader):
    ex = _experts(reader)
    g = torch.Generator().manual_seed(6)
    _forward(ex, reader, g, layers=(0,))
    assert ex.pipeline.expect == 1  # layer 1's groups are already on their way
    for y, want, _ in _forward(ex, reader, g, layers=(0, 1)):  # a new forward from layer 0: a new schedule
        assert rel_err(y.float().cpu(), want) < 1e-2
    ids = torch.tensor([[0, 1, 2, 3]], device=DEV)
    ex(0, torch.randn(1, H).to(torch.bfloat16).to(DEV), ids, torch.ones(1, K, device=DEV))  # decode: abandons
    assert ex.pipeline.expect is None
    ex.close()


def test_a_bank_left_unpinned_streams_through_the_staging_ring(reader):
    """A verified bank the host-memory allowance did not page-lock (lane-only at decode) stays in the schedule: its
    experts without a slot go through the uploader's staging path record by record, fenced when their compute is
    queued; every pair is still computed, each missing expert streamed once."""
    ex = _experts(reader)
    md = ex.mapped
    assert md.ready(1)  # resolves which banks are mapped: all of them here
    md.base.pop(1)
    md.lane_only.add(1)
    staged = []
    upload = ex.uploader.upload

    def counting(slot, record):
        staged.append(slot)
        upload(slot, record)

    ex.uploader.upload = counting
    assert uses_pipeline(ex, 1, T)
    g = torch.Generator().manual_seed(12)
    for y, want, _ in _forward(ex, reader, g):
        assert rel_err(y.float().cpu(), want) < 1e-2
    assert len(staged) == E  # layer 1's experts, none with a slot: staged one by one; layers 0 and 2 by range
    assert ex.stats()["prefill_streamed"] == 3 * E - 3 and ex.pipeline.expect is None
    ex.close()
