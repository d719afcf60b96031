"""Which values each synthetic tensor gets, keyed by its on-disk name (shared by the small and full-size writers).

Default transformers init (std 0.02 everywhere) gives a random model whose residual stream is dominated by attention
outputs that average over the context, so every token ends up routed to the same few experts. Synthetic checkpoints
instead keep the token's own embedding dominant, like the token-dependent routing of a trained MoE:
  * every input projection (q/k/v, gate/up, in_proj_*, routers' random part) has std 1/sqrt(fan_in), so its outputs
    have unit scale on the normalized (unit-RMS) input;
  * every projection that writes into the residual stream (o_proj, down_proj / w2, linear_attn.out_proj) has std
    `ALPHA / sqrt(num_layers) * EMBED_STD / sqrt(fan_in)`: the L layers together add less than the embedding itself;
  * norms are their identity value (1, or 0 for zero-centred `(1 + w)` norms) plus N(0, NORM_NOISE), so a consumer
    that confuses the two conventions is caught;
  * routers and embeddings are built by `routing` (uniform or Zipf-skewed expert popularity).

Fused expert tensors (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) are the concatenation of the
per-expert tensors of the same layer (`pieces`), so both Qwen3.5 layouts of one seed hold identical values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ft.compiler.synth import routing
from ft.compiler.synth.routing import name_seed

EMBED_STD = 0.02
ALPHA = 0.5
NORM_NOISE = 0.05
LOGIT_STD = 2.5  # std of lm_head logits on a unit-RMS final hidden state
ZERO_CENTRED = ("qwen3_next", "qwen3_5_moe")  # families whose RMSNorms (except linear_attn.norm) store w in (1 + w)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_OUTPUT_PROJ = ("o_proj.weight", "down_proj.weight", "w2.weight", "out_proj.weight", "experts.down_proj", "wo_b.weight")
_ROUTER = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".ffn.gate.weight")


@dataclass(frozen=True)
class ValueContext:
    arch: str
    hidden_size: int
    num_layers: int
    seed: int
    routing: str  # "uniform" | "skewed"
    num_experts: int = 0  # hash routers' tables (deepseek_v4 `tid2eid`) pick among these


@dataclass(frozen=True)
class Spec:
    """kind: normal (mean 0, std), const (value), noise (value + N(0, std)), alog, router, embedding, hash."""

    kind: str
    std: float = 0.0
    value: float = 0.0
    layer: int = -1  # router: layer index (num_layers for the MTP layer)


def layer_of(name: str, num_layers: int) -> int:
    m = _LAYER.search(name)
    if m is None:
        return -1
    return num_layers if name.startswith("mtp.") else int(m.group(1))


def spec_for(name: str, shape: tuple[int, ...], ctx: ValueContext) -> Spec:
    """The value rule of one canonical (per-expert) tensor."""
    fan_in = shape[-1] if shape else 1
    if name.startswith("model.visual."):  # vision tower: never compiled or run by ft; plain transformers-like init
        if name.endswith(".bias"):
            return Spec("const", value=0.0)
        return Spec("const", value=1.0) if "norm" in name else Spec("normal", std=0.02)
    if name.endswith("embed_tokens.weight"):
        return Spec("embedding", std=EMBED_STD)
    if name == "lm_head.weight":
        return Spec("normal", std=LOGIT_STD / math.sqrt(fan_in))
    if name.endswith(_ROUTER):
        return Spec("router", layer=layer_of(name, ctx.num_layers))
    if name.endswith("e_score_correction_bias"):  # of the order of the sigmoid scores' spread: changes selections
        return Spec("normal", std=0.1)
    if name.endswith("tid2eid"):  # hash routing: k distinct experts per token id
        return Spec("hash")
    if name.endswith("A_log"):
        return Spec("alog")
    if name.endswith("dt_bias"):
        return Spec("noise", value=1.0, std=0.1)
    if name.endswith("norm.bias"):  # LayerNorm bias (GLM-5's DSA indexer)
        return Spec("normal", std=0.1)
    if len(shape) == 1 and "norm" in name:
        centred = ctx.arch in ZERO_CENTRED and "linear_attn.norm" not in name
        return Spec("noise", value=0.0 if centred else 1.0, std=NORM_NOISE)
    if name.endswith(".bias"):
        return Spec("normal", std=0.1)
    if name.endswith("conv1d.weight"):
        return Spec("normal", std=1.0 / math.sqrt(fan_in))
    if name.endswith(_OUTPUT_PROJ):
        return Spec("normal", std=ALPHA / math.sqrt(ctx.num_layers) * EMBED_STD / math.sqrt(fan_in))
    return Spec("normal", std=1.0 / math.sqrt(fan_in))


def pieces(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Canonical per-expert pieces whose row-major concatenation is the tensor `name` (itself when not fused)."""
    m = _FUSED.match(name)
    if m is None or len(shape) != 3:
        return [(name, shape)]
    prefix, kind = m.groups()
    num_experts, rows, cols = shape
    if kind == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", (rows, cols)) for e in range(num_experts)]
    half = rows // 2  # gate rows first, then up rows
    return [(f"{prefix}.{e}.{p}.weight", (half, cols)) for e in range(num_experts) for p in ("gate_proj", "up_proj")]


def materialize_piece(name: str, shape: tuple[int, ...], ctx: ValueContext) -> torch.Tensor:
    """float32 values of one canonical piece, from a generator seeded by (seed, name)."""
    spec = spec_for(name, shape, ctx)
    gen = torch.Generator().manual_seed(name_seed(ctx.seed, name))
    if spec.kind == "normal":
        return torch.randn(shape, generator=gen) * spec.std
    if spec.kind == "const":
        return torch.full(shape, spec.value)
    if spec.kind == "noise":
        return spec.value + torch.randn(shape, generator=gen) * spec.std
    if spec.kind == "alog":  # A = exp(A_log) in [1, 16), like transformers' init
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
    if spec.kind == "router":
        return routing.router_weight(ctx.seed, spec.layer, shape[0], shape[1], ctx.routing, gen)
    if spec.kind == "hash":
        if ctx.num_experts < shape[1]:
            raise ValueError(f"{name}: a hash table of {shape[1]} experts per token needs num_experts >= {shape[1]}")
        return torch.rand(shape[0], ctx.num_experts, generator=gen).argsort(dim=-1)[:, :shape[1]]
    if spec.kind == "embedding":
        return routing.embedding_rows(ctx.seed, torch.randn(shape, generator=gen) * spec.std, ctx.routing, spec.std)
    raise AssertionError(spec.kind)


def materialize(name: str, shape: tuple[int, ...], dtype: torch.dtype, ctx: ValueContext) -> torch.Tensor:
    """The tensor `name` in `dtype` (fused expert tensors assembled from their per-expert pieces)."""
    parts = pieces(name, shape)
    if len(parts) == 1:
        return materialize_piece(name, shape, ctx).to(dtype)
    flat = torch.cat([materialize_piece(n, s, ctx).to(dtype).reshape(-1) for n, s in parts])
    return flat.reshape(shape)
