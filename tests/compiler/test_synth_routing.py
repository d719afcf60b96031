"""Expert routing of synthetic checkpoints, measured by running transformers: uniform spreads tokens over every
expert like a trained (load-balanced) MoE; skewed follows the designed per-layer Zipf popularity."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ft.compiler.synth import routing, synth
from ft.compiler.synth.hf_small import load_reference, measure_coverage

MANY_EXPERTS = {"num_experts": 64, "num_experts_per_tok": 8}


def rank(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().double()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([rank(a), rank(b)]))[0, 1])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_uniform_routing_spreads_tokens(tmp_path, arch):
    d = synth(arch, "tiny", tmp_path / arch, overrides=MANY_EXPERTS)
    model = load_reference(d, arch)
    vocab = model.get_input_embeddings().num_embeddings
    cov = measure_coverage(model, vocab, num_tokens=1024)
    assert len(cov) == (2 if arch == "qwen3_moe" else 4)
    for c in cov:
        assert sum(c.counts) == 1024 * 8
        assert c.used_fraction == 1.0, c  # every expert is used
        assert c.max_over_mean < 2.0 and c.entropy_ratio > 0.97, c  # and none dominates


def test_skewed_routing_follows_zipf_popularity(tmp_path):
    d = synth("qwen3_moe", "tiny", tmp_path / "skew", overrides=MANY_EXPERTS, routing="skewed", seed=5)
    model = load_reference(d, "qwen3_moe")
    cov = measure_coverage(model, model.get_input_embeddings().num_embeddings, num_tokens=2048)
    for layer, c in enumerate(cov):
        designed = routing.popularity(5, layer, 64)
        load = torch.tensor(c.counts, dtype=torch.float64)
        assert spearman(designed, load) > 0.75, layer
        assert c.top_decile_share > 0.25 and c.max_over_mean > 3.0, c  # vs 0.1 and ~1 when balanced
        busiest = int(load.argmax())
        assert int(designed.argsort(descending=True)[:3].eq(busiest).sum()) == 1  # one of the 3 most popular
    # different layers favour different experts (per-layer permutation)
    assert int(torch.tensor(cov[0].counts).argmax()) != int(torch.tensor(cov[1].counts).argmax())


def test_same_seed_same_bytes_other_seed_other_values(tmp_path):
    a = synth("mixtral", "tiny", tmp_path / "a", seed=1)
    b = synth("mixtral", "tiny", tmp_path / "b", seed=1)
    c = synth("mixtral", "tiny", tmp_path / "c", seed=2)
    for f in sorted(a.glob("*.safetensors")):
        assert f.read_bytes() == (b / f.name).read_bytes()
    name = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    shard = next(f for f in a.glob("*.safetensors") if name in safe_open(str(f), "pt").keys())
    with safe_open(str(shard), "pt") as x, safe_open(str(c / shard.name), "pt") as y:
        assert not torch.equal(x.get_tensor(name), y.get_tensor(name))
