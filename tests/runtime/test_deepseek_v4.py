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
    at another length is refused (the compressors keep only the last windows' raw rows)."""
    model, _ = pair
    ids = prompt(model, 30, seed=6)
    want = run_all(model, ids)[-1]
    st = model.new_state(64, capacity=4)
    model.forward(ids[:3], [Segment(st, 3)])
    st.ensure_capacity(21)
    model.forward(ids[3:21], [Segment(st, 18)])
    copy = st.clone(21)
    with pytest.raises(ValueError, match="copied only at its current length"):
        st.clone(20)
    for s in (st, copy):
        s.ensure_capacity(30)
        [got] = model.forward(ids[21:], [Segment(s, 9)])
        assert (got[0] - want).abs().max() < SELF_TOL
    assert st.nbytes > model.new_state(8).nbytes > 0


def test_gpu_paths_name_what_the_family_lacks(ftw_for):
    from ft.compiler.kernels.build import build_kernel_set
    from ft.runtime.gpu.engine_setup import eager_reason

    reader = FtwReader(ftw_for("deepseek_v4"))
    why = eager_reason(reader.config)  # decode runs eagerly: no CUDA graphs for its PyTorch-op layers
    assert why is not None and "deepseek_v4" in why and "compressed_attention" in why
    with pytest.raises(ValueError, match="deepseek_v4 has no prebuilt GPU kernels yet"):
        build_kernel_set(reader, 90)


def test_engine_reuses_a_kept_prefix_only_at_its_length(ftw_for, tmp_path):
    """The CPU engine serves the family; its prefix cache resumes a conversation at the kept state's own length (an
    earlier common prefix is not reusable: the state cannot be rewound), the disk store keeps no such state, and the
    tokens equal a fresh engine's."""
    from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
    from ft.runtime.prefix_store import save

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = [5, 17, 3, 99, 42, 7, 11, 2, 9, 4, 31, 8, 60, 21, 13]
    kw = dict(device="cpu", kv_reserve_tokens=256, max_prefill_length=8, max_running_requests=2)
    eng = Engine(ftw_for("deepseek_v4"), EngineSettings(prefix_cache_entries=4, **kw))
    out = generate(eng, first, params).token_ids
    follow = first + out + [6, 1, 30]
    branch = first[:10] + [77, 78, 79]
    got = [generate(eng, p, params).token_ids for p in (follow, branch)]
    assert eng.prefix is not None and save(eng.prefix, tmp_path, "k") == 0
    eng.close()
    fresh = Engine(ftw_for("deepseek_v4"), EngineSettings(**kw))
    assert got == [generate(fresh, p, params).token_ids for p in (follow, branch)]
    fresh.close()
