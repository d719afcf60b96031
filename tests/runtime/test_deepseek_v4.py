"""deepseek_v4 end to end on the CPU: a transformers-written tiny checkpoint -> FTW -> our runtime, against
transformers' forward at fp32 on the same weights.

The tiny preset is DeepSeek-V4-like at toy size: layers sliding, CSA, HCA, CSA (a window of 8, entries of 4 and 8
tokens, an indexer top-k of 4), YaRN on the compressed layers' rope, 4 hyper-connection streams, a hash-routed first
MoE layer, sqrtsoftplus routers and a clamped shared expert. Prompts exceed the window, the top-k and several
compressed windows, so every part of the attention is exercised (each shown to matter below).
"""

from __future__ import annotations

import pytest
import torch

from ft.formats import FtwReader
from ft.runtime.model import Segment, load_model

from fidelity_lib import (
    SELF_TOL, TOL, assert_greedy_matches, batched_matches_single, prompt, reference, reference_logits, run_all,
)

GEN = 48


@pytest.fixture(scope="module")
def pair(ftw_for, hf_for):
    return load_model(ftw_for("deepseek_v4")), reference(hf_for("deepseek_v4"))


def test_prompt_logits_match_transformers(pair):
    model, ref = pair
    ids = prompt(model, 40)
    theirs = reference_logits(ref, ids)
    diff = (run_all(model, ids) - theirs).abs().max().item()
    print(f"\ndeepseek_v4: max |dlogit| over {len(ids)} positions = {diff:.2e}")
    assert diff < TOL and float(theirs.std()) > 0.1


@pytest.mark.parametrize("change", ["hca entries", "csa entries", "indexer top-k", "hash table"])
def test_each_part_matters(pair, change):
    """Turning one part off moves the logits away from transformers': the equality above depends on all of them."""
    model, ref = pair
    ids = prompt(model, 40)
    theirs = reference_logits(ref, ids)
    attn = [layer.self_attn for layer in model.layers]
    target, attr, value = {
        "hca entries": (attn[2].compressor, "position_bias", torch.zeros_like(attn[2].compressor.position_bias)),
        "csa entries": (attn[1].compressor, "position_bias", torch.zeros_like(attn[1].compressor.position_bias)),
        "indexer top-k": (attn[1].compressor.indexer, "_topk", 1000),
        "hash table": (model.layers[0].mlp, "tid2eid", model.layers[0].mlp.tid2eid.roll(1, dims=0)),
    }[change]
    old = getattr(target, attr)
    try:
        setattr(target, attr, value)
        assert (run_all(model, ids) - theirs).abs().max() > 100 * TOL
    finally:
        setattr(target, attr, old)


def test_48_greedy_tokens_match_transformers(pair):
    model, ref = pair
    ids = prompt(model, 24, seed=1)
    ours = assert_greedy_matches(model, ref, ids, GEN, "deepseek_v4")
    assert len(set(ours)) > 3  # not a degenerate repetition
    full = torch.tensor(ids.tolist() + ours[:-1])
    diff = (run_all(model, full) - reference_logits(ref, full)).abs().max().item()
    print(f"\ndeepseek_v4: {GEN} greedy tokens equal; max |dlogit| over prompt + generation = {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("chunks", [[1] * 30, [5, 7, 8, 10], [3, 17, 1, 1, 8], [9, 21]])
def test_chunked_prefill_and_decode_match_one_shot(pair, chunks):
    model, _ = pair
    ids = prompt(model, 30, seed=3)
    assert (run_all(model, ids, chunks) - run_all(model, ids)).abs().max() < SELF_TOL


def test_batched_segments_match_single(pair):
    batched_matches_single(pair[0])


def test_state_grows_and_copies_at_its_length(pair):
    """A state that starts small and grows, and a copy taken mid-sequence, continue exactly like a full one; a copy
    at an earlier length needs a snapshot (the compressors keep only the last windows' raw rows)."""
    model, _ = pair
    ids = prompt(model, 30, seed=6)
    want = run_all(model, ids)[-1]
    st = model.new_state(64, capacity=4)
    model.forward(ids[:3], [Segment(st, 3)])
    st.ensure_capacity(21)
    model.forward(ids[3:21], [Segment(st, 18)])
    copy = st.clone(21)
    with pytest.raises(ValueError, match="only from a snapshot"):
        st.clone(20)
    for s in (st, copy):
        s.ensure_capacity(30)
        [got] = model.forward(ids[21:], [Segment(s, 9)])
        assert (got[0] - want).abs().max() < SELF_TOL
    assert st.nbytes > model.new_state(8).nbytes > 0


@pytest.mark.parametrize("at", [13, 16])
def test_a_state_rewinds_to_a_snapshot(pair, at):
    """Snapshotted at `at` (mid-window for both rates 4 and 8, or at a multiple of both), a state that went on to 26
    tokens goes back there: its rows truncated are bit for bit those of a state that stopped at `at` (no complete
    pooled entry reads a later token), the rings come from the snapshot, and it continues like a one-shot forward.
    Rings of another length (the state's own at 26) continue wrongly: the snapshot is what makes it exact."""
    model, _ = pair
    ids = prompt(model, 30, seed=7)
    want = run_all(model, ids)[-1]
    stopped, st = model.new_state(32), model.new_state(32)
    for s in (stopped, st):
        model.forward(ids[:at], [Segment(s, at)])
    snap = st.snapshot()
    assert set(snap) == {"raw.1", "index_raw.1", "raw.2", "raw.3", "index_raw.3"}  # sliding layer 0: none
    model.forward(ids[at:26], [Segment(st, 26 - at)])
    late = st.snapshot()
    assert any(not torch.equal(late[k], v) for k, v in snap.items())
    copy, wrong = st.clone(at, snap), st.clone(at, late)
    st.rewind(at, snap)
    kept = stopped.rows(at)
    for name, t in st.rows(at).items():
        assert torch.equal(t, kept[name]), name
    for s in (st, copy, wrong):
        [got] = model.forward(ids[at:], [Segment(s, 30 - at)])
        off = (got[0] - want).abs().max()
        assert off > 100 * SELF_TOL if s is wrong else off < SELF_TOL


def test_gpu_paths_name_what_the_family_lacks(ftw_for):
    from ft.compiler.kernels.build import build_kernel_set
    from ft.runtime.gpu.engine_setup import eager_reason

    reader = FtwReader(ftw_for("deepseek_v4"))
    why = eager_reason(reader.config)  # decode runs eagerly: no CUDA graphs for its PyTorch-op layers
    assert why is not None and "deepseek_v4" in why and "compressed_attention" in why
    with pytest.raises(ValueError, match="deepseek_v4 has no prebuilt GPU kernels yet"):
        build_kernel_set(reader, 90)


def _serve(engine, prompt_ids: list[int], params) -> tuple[list[int], list[float], int]:
    """(output ids, their logprobs, prompt tokens the engine took from its prefix cache) of one request."""
    engine.add_request(f"r{engine.stats()['requests_total']}", prompt_ids, params)
    out, logprobs, cached = [], [], None
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out.append(ev.token_id)
                logprobs.append(ev.logprob)
            cached = ev.num_cached_tokens
    return out, logprobs, cached


def test_engine_resumes_a_kept_conversation_at_a_snapshot(ftw_for, tmp_path):
    """The CPU engine's prefix cache resumes a deepseek_v4 conversation at the kept state's own length or at the last
    prefill chunk end before the prompt diverges (the state rewound to its snapshot there), not at all before the
    first chunk end; tokens and logprobs equal a fresh engine's; the disk store keeps the state and its snapshots,
    and a restarted engine resumes from them the same way."""
    from ft.runtime.engine import Engine, EngineSettings, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    first = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21, 13]  # chunks of 8 + 7 tokens: snapshots at 8 and 15
    kw = dict(device="cpu", kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    eng = Engine(ftw_for("deepseek_v4"), EngineSettings(prefix_cache_entries=4, prefix_cache_dir=str(tmp_path), **kw))
    out, _, cached = _serve(eng, first, params)
    assert cached == 0 and set(eng.prefix.entries[0].snapshots) == {8, 15}
    prompts = {"follow": first + out + [6, 1, 30], "rerendered": first + [50, 51, 52], "branch": first[:10] + [77, 78],
               "early": first[:6] + [77, 78, 79]}
    expect = {"follow": len(first) + len(out) - 1, "rerendered": 15, "branch": 8, "early": 0}
    fresh = Engine(ftw_for("deepseek_v4"), EngineSettings(**kw))
    for name, p in prompts.items():
        got, logprobs, cached = _serve(eng, p, params)
        want, want_logprobs, _ = _serve(fresh, p, params)
        assert cached == expect[name] and got == want, name
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4), name
    assert eng.persist_prefixes() >= 1
    eng.close()
    again = Engine(ftw_for("deepseek_v4"), EngineSettings(prefix_cache_entries=4, prefix_cache_dir=str(tmp_path), **kw))
    assert again.stats()["prefix_cache"]["entries"] >= 1
    got, logprobs, cached = _serve(again, first[:12] + [90, 91], params)
    want, want_logprobs, _ = _serve(fresh, first[:12] + [90, 91], params)
    assert cached == 8 and got == want and logprobs == pytest.approx(want_logprobs, abs=1e-4)
    again.close()
    fresh.close()


@pytest.mark.parametrize("damage", ["snapshot part missing", "ring of another shape"])
def test_the_disk_store_skips_a_state_whose_rings_do_not_fit(ftw_for, tmp_path, caplog, damage):
    """A saved deepseek_v4 state whose snapshot lacks a ring, or whose ring has another shape, is not loaded (a
    rewind from it would restore part of the state only): the file is named in the log and removed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ft.runtime.engine import Engine, EngineSettings, SamplingParams

    kw = dict(device="cpu", kv_reserve_tokens=256, max_prefill_length=8, prefix_cache_entries=4,
              prefix_cache_dir=str(tmp_path))
    eng = Engine(ftw_for("deepseek_v4"), EngineSettings(**kw))
    _serve(eng, [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8], SamplingParams(max_tokens=2, temperature=0.0))
    eng.close()
    (path,) = tmp_path.glob("prefix-*.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    assert {"snap.8.raw.1", "snap.8.index_raw.1", "raw.2", "cmp.2.entries", "cmp.1.index_entries"} <= set(t)
    if damage == "snapshot part missing":
        del t["snap.8.raw.1"]
    else:
        t["raw.2"] = t["raw.2"][1:]
    save_file(t, str(path), metadata=meta)
    again = Engine(ftw_for("deepseek_v4"), EngineSettings(**kw))
    assert again.stats()["prefix_cache"]["entries"] == 0 and path.name in caplog.text and not path.exists()
    again.close()
