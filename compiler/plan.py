"""The compile plan: what each FTW tensor or expert bank is made of, in output order.

A family turns (normalized config, checkpoint index) into a list of these items; the executor (`emit.py`) checks the
whole list against the checkpoint headers before writing a byte, then streams it item by item.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.compiler.experts import ExpertSource

# TensorItem kinds: how a non-linear tensor is stored
#   keep     float, follows --dtype (embeddings)
#   conv     [C, 1, K] -> [C, K] (depthwise conv1d, middle dim squeezed), follows --dtype
#   fp32     stored float32 (dt_bias, A_log)
#   norm     RMSNorm weight, stored float32
#   norm_1p  zero-centred RMSNorm weight w, stored as float32(w) + 1 (qwen3_next, qwen3_5_moe)
#   index    integer table (deepseek_v4's tid2eid), stored int32
KINDS = ("keep", "conv", "fp32", "norm", "norm_1p", "index")


@dataclass(frozen=True, eq=False)
class TensorItem:
    name: str  # FTW name
    src: str  # HF tensor name
    shape: tuple[int, ...]  # expected source shape
    kind: str
    perm: torch.Tensor | None = None  # int64 index into dim 0 (glm_moe_dsa's LayerNorm beside a reordered linear)


@dataclass(frozen=True, eq=False)
class LinearItem:
    """FTW linear `name` = rows of `parts` concatenated in order, then reordered by `perm` (if any)."""

    name: str  # FTW module name; tensors are `{name}.weight` (+ quant siblings, `{name}.bias`)
    parts: tuple[tuple[str, int], ...]  # (HF module path, its out_features)
    in_features: int
    perm: torch.Tensor | None = None  # int64 row index into the concatenation
    bias: bool = False
    router: bool = False  # routers keep their source dtype and are never quantized


@dataclass(frozen=True)
class BankItem:
    name: str  # layers.{i}.mlp.experts
    num_experts: int
    intermediate: int  # I
    hidden: int  # H
    source: ExpertSource  # where the experts come from (ft.compiler.experts)


Item = TensorItem | LinearItem | BankItem
