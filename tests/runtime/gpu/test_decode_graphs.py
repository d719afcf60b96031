"""CUDA-graph decode (`graphs.py`): decode steps replay one captured forward per batch size.

On the CPU the decode batch runs eagerly (`capture=False`): device-side positions and tables, padding rows, the
experts' graph calls and their bookkeeping after each step are all checked against plain eager decoding; the capture
itself is checked on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.gpu.graphs import DecodeGraphs, graph_ready
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.store import GpuExperts
from ft.runtime.layers.batch import decode_inputs, decode_inputs_size
from ft.runtime.model import Segment, load_model

from .gpu_fixtures import still_pinning

CUDA = torch.cuda.is_available()
PROMPT = [3, 17, 5, 99, 42, 7, 61, 23, 11]


@pytest.fixture(scope="module")
def ftw(ftw_for):
    return ftw_for("qwen3_5_moe", "nvfp4")  # full attention + DeltaNet + MoE with a shared expert


def _model(ftw, opts, device="cpu", graphs=False, capture=None, keep_quantized=False, sizes=(1,)):
    reader = FtwReader(ftw)
    ex = GpuExperts(reader, opts, device=device, device_plan=True)
    model = load_model(reader, device=device, experts=ex, keep_quantized=keep_quantized)
    if graphs:
        model.graphs = DecodeGraphs(model, ex, capture=capture, batch_sizes=sizes)
    return model, ex


def _decode(model, n, *, capacity=None, poison=False):
    """Greedy: prefill PROMPT, then n one-token steps -> (tokens, per-step fp32 logits [V])."""
    state = model.new_state(len(PROMPT) + n + 4, capacity=capacity)
    if poison:  # rows past the length hold garbage; a masked read of NaN would still poison the output
        for k, v in state.kv.values():
            k.fill_(float("nan"))
            v.fill_(float("nan"))
    logits = model.forward(torch.tensor(PROMPT), [Segment(state, len(PROMPT))])[0][-1]
    toks, steps = [int(logits.argmax())], []
    for _ in range(n):
        state.ensure_capacity(state.length + 1)
        logits = model.forward(torch.tensor([toks[-1]]), [Segment(state, 1)])[0][-1]
        steps.append(logits.float().cpu())
        toks.append(int(logits.argmax()))
    assert state.length == len(PROMPT) + n
    return toks, steps


def _close(a, b):
    for x, y in zip(a, b):
        assert torch.isfinite(x).all()
        assert (x - y).abs().max() <= 2e-2 * y.abs().max() + 1e-3


@pytest.mark.parametrize("mode", ["resident", "mapped"])
def test_static_decode_matches_eager(ftw, mode):
    opts = OffloadConfig(mode=mode, num_slots=None if mode == "resident" else 3, trace_limit=1000)
    eager, ex0 = _model(ftw, opts)
    want_toks, want = _decode(eager, 10)
    model, ex = _model(ftw, opts, graphs=True, capture=False)
    got_toks, got = _decode(model, 10, poison=True)
    assert got_toks == want_toks
    _close(got, want)
    c = model.graphs.counters
    assert c["replays"] == 10 and c["captures"] == 1 and c["eager_steps"] == 0
    ex.settle()
    s, s0 = ex.stats(), (ex0.settle(), ex0.stats())[1]
    assert s["calls"] == s0["calls"] and s["tokens"] == s0["tokens"]  # every MoE call of every step is counted
    if mode == "mapped":  # routing read back after the steps: hits, misses, admits, the trace
        assert s["hits"] + s["misses"] > 0 and s["bytes_mapped"] > 0 and s["fetched"] > 0
        assert s["hits"] + s["misses"] == sum(len(np.unique(u)) for _, u in ex.trace)
    for e in (ex, ex0):
        e.close()


def test_a_grown_state_replays_the_same_graph(ftw):
    model, ex = _model(ftw, OffloadConfig(mode="resident"), graphs=True, capture=False)
    eager, ex0 = _model(ftw, OffloadConfig(mode="resident"))
    toks, got = _decode(model, 12, capacity=len(PROMPT) + 1)  # KV buffers reallocated while decoding
    want_toks, want = _decode(eager, 12, capacity=len(PROMPT) + 1)
    assert toks == want_toks
    _close(got, want)
    assert model.graphs.counters["captures"] == 1 and model.graphs.counters["replays"] == 12
    for e in (ex, ex0):
        e.close()


def _decode_together(model, prompts, n):
    """Prefill each prompt alone, then n steps decoding all sequences in one forward -> tokens per sequence."""
    states, toks = [], []
    for p in prompts:
        st = model.new_state(len(p) + n + 2)
        states.append(st)
        toks.append([int(model.forward(torch.tensor(p), [Segment(st, len(p))])[0][-1].argmax())])
    for _ in range(n):
        out = model.forward(torch.tensor([t[-1] for t in toks]), [Segment(st, 1) for st in states])
        for t, lg in zip(toks, out):
            assert lg.shape[0] == 1 and torch.isfinite(lg).all()
            t.append(int(lg[-1].argmax()))
    return toks


# fused kernels on CPU tensors only run under the interpreter, which conftest.py turns on where there is no CUDA
@pytest.mark.parametrize("device,fused", [("cpu", False), ("cuda", True) if CUDA else ("cpu", True)])
def test_batched_decode_replays_padded_graphs(ftw, device, fused):
    """Three sequences of different lengths decode together through the graph of batch 4 (one padding row) and get
    the tokens each gets decoding alone (PyTorch reference ops); two sequences take the graph of batch 2; one graph
    per size, no more. Fused on the CPU: the decode kernels under the interpreter, through the tables."""
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:] + PROMPT]
    opts = OffloadConfig(mode="resident")
    eager, ex0 = _model(ftw, opts, device=device)
    eager.set_fused(False)
    want = [_decode_together(eager, [p], 6)[0] for p in prompts]
    model, ex = _model(ftw, opts, device=device, graphs=True, sizes=(1, 2, 4))
    model.set_fused(fused)
    assert _decode_together(model, prompts, 6) == want
    assert _decode_together(model, prompts[:2], 6) == want[:2]
    c = model.graphs.counters
    assert c["replays"] == 12 and c["captures"] == 2 and c["eager_steps"] == 0
    for e in (ex, ex0):
        e.close()


def test_a_failed_capture_falls_back_to_eager_decoding(ftw, monkeypatch):
    model, ex = _model(ftw, OffloadConfig(mode="resident"), graphs=True, capture=False)
    eager, ex0 = _model(ftw, OffloadConfig(mode="resident"))

    def broken(*a, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(model.graphs, "_capture", broken)
    toks, got = _decode(model, 4)
    want_toks, want = _decode(eager, 4)
    assert toks == want_toks
    _close(got, want)
    c = model.graphs.counters
    assert c["replays"] == 0 and c["eager_steps"] == 4 and "stream is capturing" in c["capture_error"]
    for e in (ex, ex0):
        e.close()


def test_host_planned_calls_decode_eagerly(ftw):
    model, ex = _model(ftw, OffloadConfig(num_slots=3, b_pcie=1e9, b_cpu=1e9), graphs=True, capture=False)
    ex.allocate()
    still_pinning(ex)  # before the banks are page-locked and verified, every MoE call is planned on the host
    _decode(model, 3)
    c = model.graphs.counters
    assert c["replays"] == 0 and c["captures"] == 0 and c["eager_steps"] == 3
    ex.close()


def test_quantized_dense_linears_decode_statically(ftw):
    assert FtwReader(ftw).quant.get("linears")  # the case is only meaningful with quantized dense linears
    opts = OffloadConfig(mode="resident")
    eager, ex0 = _model(ftw, opts, keep_quantized=True)
    want_toks, want = _decode(eager, 6)
    model, ex = _model(ftw, opts, graphs=True, capture=False, keep_quantized=True)
    got_toks, got = _decode(model, 6)
    assert got_toks == want_toks and model.graphs.counters["replays"] == 6
    _close(got, want)
    for e in (ex, ex0):
        e.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode,keep_quantized", [("resident", False), ("mapped", False), ("mapped", True)])
def test_cuda_graph_decode_matches_eager(ftw, mode, keep_quantized):
    opts = OffloadConfig(mode=mode, num_slots=None if mode == "resident" else 3)
    eager, ex0 = _model(ftw, opts, device="cuda", keep_quantized=keep_quantized)
    ex0.wait_pinned()
    want_toks, want = _decode(eager, 16)
    model, ex = _model(ftw, opts, device="cuda", graphs=True, keep_quantized=keep_quantized)
    ex.wait_pinned()
    trace, step = [], model.graphs.step  # per step: (replayed, graph_ready before it): why a step ran eagerly

    def traced(ids, states):
        ready = graph_ready(ex, len(states))
        out = step(ids, states)
        trace.append((out is not None, ready))
        return out

    model.graphs.step = traced
    got_toks, got = _decode(model, 16, poison=True)
    assert got_toks == want_toks
    _close(got, want)
    c = model.graphs.counters
    # mode mapped may decode a step eagerly until its banks' verification has landed (graph_ready), never more
    assert c["replays"] + c["eager_steps"] == 16 and c["replays"] >= 15, (c, trace)
    assert c["captures"] == 1 and c["capture_s"] > 0
    for e in (ex, ex0):
        e.close()


def test_decode_inputs_are_views_of_one_buffer():
    """The layout the graphs, the eager step and the kernels build share: [ids | positions | tables], no copies."""
    buf = torch.arange(decode_inputs_size(3, 2, ids=True))
    ids, pos, tables = decode_inputs(buf, 3, 2, ids=True)
    assert ids.tolist() == [0, 1, 2] and pos.tolist() == [3, 4, 5]
    assert tables[1, 0].tolist() == [12, 13, 14] and tables.stride() == (6, 3, 1)
    assert tables.data_ptr() == buf.data_ptr() + 6 * 8  # the offset Triton specializes a decode kernel on
    none, pos, tables = decode_inputs(torch.arange(decode_inputs_size(1, 2, ids=False)), 1, 2, ids=False)
    assert none is None and pos.tolist() == [0] and tables[0].stride() == (1, 1) and tables[1, 1].tolist() == [4]
    with pytest.raises(ValueError, match=r"need int64 \[18\]"):
        decode_inputs(torch.zeros(16, dtype=torch.int64), 3, 2, ids=True)
    with pytest.raises(ValueError, match="int32"):
        decode_inputs(torch.zeros(18, dtype=torch.int32), 3, 2, ids=True)
