"""glm_moe_dsa end to end on the CPU: a transformers-written tiny checkpoint -> FTW -> our runtime, against
transformers' forward at fp32 on the same weights.

The tiny preset is GLM-5-like at toy size: MLA (q/kv low-rank projections with norms, 4 rope dims of a 16-wide query,
value heads of 16), the DSA indexer with `index_topk` 8 on layers full, full, shared, full (GLM-5.2's IndexShare), one
dense layer then three MoE layers with the sigmoid group-limited router and the ungated shared expert, plus an MTP
layer the compiler skips. Prompts are longer than the top-k, so each query's sparse selection matters (checked by
turning it off: the logits then leave transformers').
"""

from __future__ import annotations

import pytest
import torch

from ft.runtime.layers.mla import Indexer, MlaAttention
from ft.runtime.model import load_model
from ft.runtime.state import kv_row_shapes

from fidelity_lib import (
    SELF_TOL, TOL, assert_greedy_matches, batched_matches_single, prompt, reference, reference_logits, run_all,
)

GEN = 48


@pytest.fixture(scope="module")
def pair(ftw_for, hf_for):
    return load_model(ftw_for("glm_moe_dsa")), reference(hf_for("glm_moe_dsa"))


def test_prompt_logits_match_transformers(pair):
    model, ref = pair
    ids = prompt(model, 40)
    assert len(ids) > model.config.index_topk
    ours = run_all(model, ids)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    print(f"\nglm_moe_dsa: max |dlogit| over {len(ids)} positions = {diff:.2e}")
    assert diff < TOL and float(theirs.std()) > 0.1


def test_sparse_selection_matters(pair):
    """With the indexer's top-k lifted (every causal key attended) the logits leave transformers' from the first
    position whose past exceeds the top-k: the selection is what makes them equal above."""
    model, ref = pair
    ids = prompt(model, 40)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0].float()
    indexers = [op for _, op in model.named_ops() if isinstance(op, Indexer)]
    assert len(indexers) == 3
    topk = indexers[0]._topk
    try:
        for op in indexers:
            op._topk = 10_000
        dense = run_all(model, ids)
    finally:
        for op in indexers:
            op._topk = topk
    k = model.config.index_topk
    assert (dense[:k] - theirs[:k]).abs().max() < TOL           # up to the top-k every key is selected anyway
    assert (dense[k:] - theirs[k:]).abs().max() > 100 * TOL


def test_48_greedy_tokens_match_transformers(pair):
    model, ref = pair
    ids = prompt(model, 24, seed=1)
    ours = assert_greedy_matches(model, ref, ids, GEN, "glm_moe_dsa")
    assert len(set(ours)) > 3  # not a degenerate repetition
    full = torch.tensor(ids.tolist() + ours[:-1])
    diff = (run_all(model, full) - reference_logits(ref, full)).abs().max().item()
    print(f"\nglm_moe_dsa: {GEN} greedy tokens equal; max |dlogit| over prompt + generation = {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("chunks", [[1] * 20, [5, 7, 8], [9, 11]])
def test_chunked_prefill_matches_one_shot(pair, chunks):
    model, _ = pair
    ids = prompt(model, 20, seed=3)
    assert (run_all(model, ids, chunks) - run_all(model, ids)).abs().max() < SELF_TOL


def test_batched_segments_match_single(pair):
    """Two sequences in one forward (a prefill chunk beside a decode token) give each its own logits: the indexer's
    selection is kept per segment, and a shared layer reuses its own segment's."""
    batched_matches_single(pair[0])


def test_cache_holds_the_latent_and_index_keys(pair):
    """KV bytes per token: the latent + rope key per layer, the index keys only on layers with their own indexer."""
    model, _ = pair
    cfg = model.config
    st = model.new_state(10)
    latent = cfg.kv_lora_rank + cfg.rotary_dim
    assert [kv_row_shapes(cfg, i) for i in range(cfg.num_layers)] == [
        ((1, latent), (1, cfg.index_head_dim if t == "full" else 0)) for t in cfg.indexer_types]
    per_token = sum(latent + (cfg.index_head_dim if t == "full" else 0) for t in cfg.indexer_types) * 4
    assert st.nbytes == 10 * per_token
    assert isinstance(model.layers[2].self_attn, MlaAttention) and not hasattr(model.layers[2].self_attn, "indexer")
