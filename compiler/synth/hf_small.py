"""Tiny / small / demo checkpoints: names from transformers' own save_pretrained, values from `weights`.

The model class of the architecture (for qwen3_5_moe: Qwen3_5MoeForConditionalGeneration with a small vision tower)
is saved by `save_pretrained` (per-expert tensors, or the fused 3-D layout with save_original_format=False); the
tensor table read back from those files plus the fake MTP head is then filled with synthetic values in memory.
`measure_coverage` runs transformers on a written checkpoint and reports how tokens spread over experts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ft.compiler.synth.routing import Coverage, coverage_from_ids
from ft.compiler.synth.tables import TensorSpec, model_class, mtp_table, quiet_transformers, saved_table
from ft.compiler.synth.weights import ValueContext, materialize


def build_table(arch: str, cfg, dtype: torch.dtype, fused: bool) -> list[TensorSpec]:
    return saved_table(arch, cfg, dtype, fused) + mtp_table(arch, cfg, dtype, fused)


def build_state(table: list[TensorSpec], ctx: ValueContext) -> dict[str, torch.Tensor]:
    """Every tensor of the table with its synthetic values (in table order)."""
    return {t.name: materialize(t.name, t.shape, t.dtype, ctx) for t in table}


def load_reference(model_dir: Path, arch: str, dtype: torch.dtype = torch.float32):
    """transformers model of a synthetic (or twin) checkpoint with eager attention and experts, in eval mode."""
    cls = model_class(arch)
    with quiet_transformers():
        model = cls.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager",
                                    experts_implementation="eager")
    return model.eval()


def measure_coverage(model, vocab_size: int, *, num_tokens: int = 1024, seed: int = 0,
                     input_ids: torch.Tensor | None = None) -> list[Coverage]:
    """Run `model` on random tokens (4 sequences) and count, per MoE layer, how often each expert is chosen."""
    routers = [m for name, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no TopKRouter modules")
    chosen: dict[int, torch.Tensor] = {}
    hooks = [r.register_forward_hook(lambda mod, args, out, i=i: chosen.__setitem__(i, out[2].detach()))
             for i, r in enumerate(routers)]
    if input_ids is None:
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab_size, (4, max(1, num_tokens // 4)), generator=gen)
    try:
        with torch.no_grad(), quiet_transformers():
            model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return coverage_from_ids([chosen[i] for i in range(len(routers))], routers[0].num_experts)
