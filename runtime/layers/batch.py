"""What every layer of one forward needs to know about the flattened batch.

A forward runs N tokens that belong to several segments (a prefill chunk or one decode token each), concatenated in
order. Token-wise work (projections, norms, MoE) runs once over all N rows; sequence mixing (attention, DeltaNet)
runs per segment on its rows `[start, start + num_tokens)`, continuing the segment's state at position `past`.

`static` (a decode step captured in a CUDA graph, `ft.runtime.gpu.graphs`): every segment is one token, and its
position is read from `positions` on the device at replay time, never from `past` (a Python int frozen at capture);
attention then covers the whole KV buffer with a mask instead of slicing it to the current length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SegmentRows:
    start: int          # first row of this segment in the flattened batch
    num_tokens: int     # rows of this segment
    past: int           # tokens already in the state (absolute position of the first row)
    state: Any          # the segment's SequenceState (kv / conv / recurrent buffers, by layer index)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.num_tokens)


@dataclass
class ForwardBatch:
    segments: list[SegmentRows]
    positions: torch.Tensor                       # [N] int64 absolute positions
    rope: dict[str, torch.Tensor] = field(default_factory=dict)   # cos/sin [N, rotary_dim], set by the model
    static: bool = False                          # see the module docstring
