"""Benchmark: how well a MoE layer's router, applied to the layer before's residual, guesses the experts it will pick.

    python tools/bench_prefetch_guess.py --ftw DIR [--tokens 256 --seed 0] [--out benchmarks --label NAME]

The expert prefetch (`runtime/gpu/prefetch.py`) copies the guessed experts while the MoE layer before still
computes; it pays off only as far as the guess is right. This runs the FTW's model on the CPU (the runtime's own
layers, experts from the mmapped banks) over `--tokens` random token ids in one forward, with the guess for every MoE
layer but the first (made from the post-attention residual of the MoE layer before it) recorded next to the top-k its
MoE then chose (per token, as a decode step sees it), and reports per guessed MoE layer:
  * recall: of the k experts chosen, the share that were among the k guessed;
  * precision by rank: of each token's j-th best guess, the share the MoE chose (the prefetch takes the best guesses
    without a slot first, so at a cache that holds the hot experts it copies lower-ranked guesses: their precision
    bounds what it can use).
Writes DIR/prefetch_guess.json (appended per --label) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
import torch

from ft.formats import FtwReader
from ft.runtime.experts import CpuExperts
from ft.runtime.model import Segment, load_model


class _Recorder:
    """The experts interface around the CPU experts: records each layer's guess and its chosen ids."""

    def __init__(self, inner) -> None:
        self.inner, self.guessed, self.chosen = inner, {}, {}

    def __call__(self, layer, x, topk_ids, topk_weights):
        self.chosen[layer] = topk_ids.clone()
        return self.inner(layer, x, topk_ids, topk_weights)

    def prefetch(self, layer, x, guess) -> None:
        self.guessed[layer] = guess(x).clone()


def score(guessed: np.ndarray, chosen: np.ndarray) -> dict:
    """guessed, chosen int [T, k] (a token's guesses best first) -> {"recall", "by_rank" [k]}."""
    hit = (guessed[:, :, None] == chosen[:, None, :]).any(-1)  # [T, k]: guess j was chosen
    return {"recall": float(hit.mean()), "by_rank": hit.mean(0).round(4).tolist()}


def measure(ftw: str, tokens: int, seed: int) -> dict:
    reader = FtwReader(ftw)
    cfg = reader.config
    dtype = reader.tensor("embed_tokens.weight").dtype
    rec = _Recorder(CpuExperts(reader, cfg, dtype=dtype))
    model = load_model(reader, experts=rec)
    model.set_prefetch(True)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    state = model.new_state(tokens)
    with torch.inference_mode():
        model.forward(ids, [Segment(state, tokens)])
    rows = [{"layer": layer, **score(rec.guessed[layer].numpy(), rec.chosen[layer].numpy())}
            for layer in sorted(rec.guessed)]
    mean = {"recall": float(np.mean([r["recall"] for r in rows])),
            "by_rank": np.mean([r["by_rank"] for r in rows], 0).round(4).tolist()}
    return {"ftw": Path(ftw).name, "family": cfg.family, "layers": cfg.num_layers, "experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok, "hidden": cfg.hidden_size, "tokens": tokens, "seed": seed,
            "mean": mean, "per_layer": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ftw", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="directory for prefetch_guess.json (appended)")
    ap.add_argument("--label", help="name of this row in the JSON (default: the FTW's directory name)")
    a = ap.parse_args()
    res = measure(a.ftw, a.tokens, a.seed)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")
    cpu = platform.processor() or platform.machine()
    res |= {"label": a.label or Path(a.ftw).name, "date": now,
            "machine": f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}", "command": " ".join(sys.argv)}
    print(f"{res['label']}: {res['family']}, {res['layers']} layers, {res['experts']} experts top-{res['top_k']}, "
          f"{res['tokens']} tokens")
    print("layer  recall  precision of the guesses by rank")
    for r in res["per_layer"] + [{"layer": "mean", **res["mean"]}]:
        print(f"{r['layer']:>5}  {r['recall']:.3f}   {' '.join(f'{v:.3f}' for v in r['by_rank'])}")
    if a.out:
        path = a.out / "prefetch_guess.json"
        rows = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(rows + [res], indent=1) + "\n")


if __name__ == "__main__":
    main()
