"""What the fidelity tests of every family share: transformers' reference model, a random prompt, our logits and
greedy tokens, and transformers' greedy tokens (plain argmax: the synthetic checkpoints' generation_config.json asks
for sampling and a repetition penalty, like the real releases, which are switched off here; no stop on EOS)."""

from __future__ import annotations

import torch

from ft.runtime.model import CausalLM, Segment

TOL = 1e-4          # ours vs transformers, fp32
SELF_TOL = 5e-5     # ours vs ours: chunking / batching only change fp32 summation order (logits ~10)


def reference(hf_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


def prompt(model: CausalLM, n: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def run_all(model: CausalLM, ids: torch.Tensor, chunks: list[int] | None = None) -> torch.Tensor:
    """Logits of every position, feeding `ids` in the given chunk sizes (default: one shot)."""
    state = model.new_state(len(ids) + 8)
    out, pos = [], 0
    for n in chunks or [len(ids)]:
        out += model.forward(ids[pos:pos + n], [Segment(state, n, "all")])
        pos += n
    assert pos == len(ids) and state.length == len(ids)
    return torch.cat(out)


def greedy(model: CausalLM, ids: torch.Tensor, n: int) -> list[int]:
    state = model.new_state(len(ids) + n)
    [logits] = model.forward(ids, [Segment(state, len(ids))])
    tokens = [int(logits[0].argmax())]
    while len(tokens) < n:
        [logits] = model.forward(torch.tensor([tokens[-1]]), [Segment(state, 1)])
        tokens.append(int(logits[0].argmax()))
    return tokens


def reference_logits(ref: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [len(ids), V] of one forward over `ids`."""
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()


def assert_greedy_matches(model: CausalLM, ref: torch.nn.Module, ids: torch.Tensor, n: int, tag: str) -> list[int]:
    """Our `n` greedy tokens after `ids` equal transformers' (the message names the first step that differs);
    returns them."""
    ours, theirs = greedy(model, ids, n), reference_greedy(ref, ids, n)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert ours == theirs, f"{tag}: greedy tokens diverge at step {first}"
    return ours


def reference_greedy(ref: torch.nn.Module, ids: torch.Tensor, n: int) -> list[int]:
    out = ref.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
                       min_new_tokens=0, do_sample=False, repetition_penalty=1.0, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def batched_matches_single(model) -> None:
    """A prefill chunk of one sequence beside the decode token of another, in one forward: each sequence's logits equal
    its own run (per-segment state: caches, selections, compressors)."""
    a, b = prompt(model, 18, seed=4), prompt(model, 12, seed=5)
    want_a, want_b = run_all(model, a)[-1], run_all(model, b)[-1]
    sa, sb = model.new_state(32), model.new_state(32)
    model.forward(a[:17], [Segment(sa, 17)])
    la, lb = model.forward(torch.cat([a[17:], b]), [Segment(sa, 1), Segment(sb, 12)])
    assert (la[0] - want_a).abs().max() < SELF_TOL and (lb[0] - want_b).abs().max() < SELF_TOL
