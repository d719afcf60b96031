"""tools/bench_prefetch_guess.py: the guess each decoder layer hands the expert prefetch, against the MoE's choice."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_prefetch_guess  # noqa: E402


def test_score_counts_chosen_guesses_by_rank():
    chosen = np.array([[3, 1, 7], [2, 0, 5]])
    assert bench_prefetch_guess.score(chosen[:, ::-1], chosen) == {"recall": 1.0, "by_rank": [1.0, 1.0, 1.0]}
    guessed = np.array([[1, 4, 9], [5, 2, 6]])  # token 0: 1 chosen; token 1: 5 and 2 chosen
    assert bench_prefetch_guess.score(guessed, chosen) == {"recall": 0.5, "by_rank": [1.0, 0.5, 0.0]}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_every_moe_layer_guesses_far_better_than_chance(ftw_for, arch):
    """Over the tiny synthetic models' layers (full attention, and DeltaNet for qwen3_5_moe) a MoE layer's router on
    the residual of the layer before names most of what its MoE picks: a guess from the wrong layer's router or the
    wrong input would land near chance (k / E). Every MoE layer but the first gets a guess."""
    res = bench_prefetch_guess.measure(str(ftw_for(arch)), tokens=32, seed=1)
    k, E = res["top_k"], res["experts"]
    assert [r["layer"] for r in res["per_layer"]] == list(range(1, res["layers"])) and all(len(r["by_rank"]) == k for r in res["per_layer"])
    assert min(r["recall"] for r in res["per_layer"]) > max(0.75, 2 * k / E), res["per_layer"]
