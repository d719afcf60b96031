"""Full-size gpt_oss checkpoints (gpt-oss-20b / gpt-oss-120b presets), written tensor by tensor in bounded memory.

Names and shapes: transformers' GptOssForCausalLM on the meta device (what save_pretrained writes: gpt_oss has no
weight conversion), with `quant="mxfp4"` each expert weight replaced by the release's `*_blocks` / `*_scales`.
Values follow `synth.gpt_oss.value`'s rules; large Gaussian tensors are windows of the shared normal pool
(`pools.NormalPool`). MXFP4 experts are windows of the E2M1 code pool (`pools.Fp4Pool`, codes of N(0, 1) data) with
one E8M0 scale per tensor, 2^round(log2(std / code std)): the dequantized expert has about the rule's std. The exact
twin (plain layout, [E, in, out]) dequantizes the same window one expert at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from ft.compiler.synth.gpt_oss import (QUANT_CONFIG, _finish_dir, generation_config, gpt_oss_config,
                                       harmony_tokenizer, value, weight_std)
from ft.compiler.synth.pools import Fp4Pool, NormalPool
from ft.compiler.synth.shards import Entry, write_checkpoint
from ft.compiler.synth.tables import TensorSpec, _natural_order
from ft.formats.quant import mxfp4
from ft.formats.quant.nvfp4 import e2m1_values

SMALL = 1 << 20  # tensors below this many elements are computed by `value` itself
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _plain_table(cfg, dtype: torch.dtype) -> list[TensorSpec]:
    from transformers import GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    return _natural_order([TensorSpec(k, tuple(v.shape), dtype) for k, v in model.state_dict().items()])


def _mxfp4_specs(t: TensorSpec) -> tuple[TensorSpec, TensorSpec]:
    E, n_in, n_out = t.shape  # transformers' [E, in, out]; the release stores [E, out, in/32, 16] and [E, out, in/32]
    return (TensorSpec(f"{t.name}_blocks", (E, n_out, n_in // 32, 16), torch.uint8),
            TensorSpec(f"{t.name}_scales", (E, n_out, n_in // 32), torch.uint8))


def gpt_oss_table(preset, keys: dict, dtype: torch.dtype, quant: str, tok_dir: Path) -> list[TensorSpec]:
    """The checkpoint's tensors as `synth` writes them (any preset), without data."""
    from ft.compiler.synth.presets import TINY_RANKS

    tok, keys = harmony_tokenizer(tok_dir, keys, TINY_RANKS if preset.name == "tiny" else None)
    table = _plain_table(gpt_oss_config(keys, tok, dtype), dtype)
    if quant != "mxfp4":
        return table
    return _natural_order([s for t in table for s in (_mxfp4_specs(t) if t.name.endswith(_EXPERTS) else (t,))])


class StreamWriter:
    def __init__(self, seed: int, num_layers: int) -> None:
        self.seed, self.num_layers = seed, num_layers

    @functools.cached_property
    def normal(self) -> NormalPool:
        return NormalPool(self.seed)

    @functools.cached_property
    def fp4(self) -> Fp4Pool:
        return Fp4Pool(self.seed)

    @functools.cached_property
    def code_std(self) -> float:
        return float(e2m1_values(self.fp4.codes[: 1 << 20]).std())

    def std(self, t: TensorSpec) -> float:
        return weight_std(t.name, t.shape, self.num_layers)

    def plain(self, t: TensorSpec) -> Entry:
        def produce() -> Iterator[torch.Tensor]:
            if math.prod(t.shape) < SMALL or t.name.endswith(("norm.weight", "sinks", "bias")):
                yield value(t.name, t.shape, self.num_layers, self.seed).to(t.dtype)
            else:
                std = 1.0 if t.name.endswith("embed_tokens.weight") else self.std(t)
                yield from self.normal.window(self.seed, t.name, math.prod(t.shape), std, t.dtype)
        return Entry(t.name, t.dtype, t.shape, produce)

    def scale_byte(self, t: TensorSpec) -> int:
        return 127 + round(math.log2(self.std(t) / self.code_std))

    def mxfp4(self, t: TensorSpec) -> list[Entry]:
        blocks, scales = _mxfp4_specs(t)
        numel = math.prod(t.shape)
        s = self.scale_byte(t)
        return [Entry(blocks.name, torch.uint8, blocks.shape, lambda: self.fp4.codes_window(self.seed, t.name, numel)),
                Entry(scales.name, torch.uint8, scales.shape,
                      lambda: (torch.full(scales.shape, s, dtype=torch.uint8),))]

    def twin(self, t: TensorSpec) -> Entry:
        """The exact dequantization of `mxfp4(t)` in the plain [E, in, out] layout, one expert at a time."""
        E, n_in, n_out = t.shape
        s = self.scale_byte(t)

        def produce() -> Iterator[torch.Tensor]:
            codes = torch.cat(list(self.fp4.codes_window(self.seed, t.name, math.prod(t.shape))))
            for e in codes.view(E, n_out, n_in // 2):
                w = mxfp4.dequantize(e, torch.full((n_out, n_in // 32), s, dtype=torch.uint8))
                yield w.t().contiguous().to(t.dtype)
        return Entry(t.name, t.dtype, t.shape, produce)


def write_gpt_oss_stream(*, keys: dict, dtype: torch.dtype, quant: str, seed: int, shard: int, out: Path,
                         twin: Path | None, num_ranks: int | None, advance) -> None:
    """Write a full-size checkpoint (and for mxfp4 with a twin directory, its exact plain twin)."""
    tok, keys = harmony_tokenizer(out, keys, num_ranks)
    cfg = gpt_oss_config(keys, tok, dtype)
    table = _plain_table(cfg, dtype)
    w = StreamWriter(seed, cfg.num_hidden_layers)
    main = [e for t in table for e in (w.mxfp4(t) if quant == "mxfp4" and t.name.endswith(_EXPERTS) else [w.plain(t)])]
    gen = generation_config(tok)
    cfg.save_pretrained(out)
    if twin is not None:
        cfg.save_pretrained(twin)
        entries = [w.twin(t) if t.name.endswith(_EXPERTS) else w.plain(t) for t in table]
        write_checkpoint(twin, entries, shard, advance)
        _finish_dir(twin, out, gen, dtype, None)
    write_checkpoint(out, main, shard, advance)
    _finish_dir(out, None, gen, dtype, QUANT_CONFIG if quant == "mxfp4" else None)
