"""What every layer of one forward needs to know about the flattened batch.

A forward runs N tokens that belong to several segments (a prefill chunk or one decode token each), concatenated in
order. Token-wise work (projections, norms, MoE) runs once over all N rows; sequence mixing (attention, DeltaNet)
runs per segment on its rows `[start, start + num_tokens)`, continuing the segment's state at position `past`.

Decode batches (`tables` set; CUDA, or the Triton interpreter in tests): every segment is one token, B = N rows, and
the sequence-mixing layers run fused decode kernels that find each sequence's buffers through `tables` and its
position through `positions`, both on the device. Nothing they launch depends on host values (lengths, addresses), so
one captured CUDA graph per batch size serves every set of sequences at every length (`ft.runtime.gpu.graphs`): the
host only rewrites the tables and positions before a replay.

    tables int64 [L, 2, B] (L = the model's layer count; row i belongs to layer i):
      full-attention layer i:   tables[i, 0, b] = k buffer address, tables[i, 1, b] = v buffer address of sequence b
                                (each buffer [capacity, nkv, hd] contiguous, compute dtype; row p at + p * nkv * hd)
      linear-attention layer i: tables[i, 0, b] = conv state address ([conv_dim, K-1], compute dtype),
                                tables[i, 1, b] = recurrent state address ([Hv, dk, dv] fp32)
    positions int64 [B]: the token's position (tokens already in its sequence); the layer writes the token's k/v /
      state there and attends over rows 0..position inclusive.
Padded rows (a graph of batch 8 replayed for 5 sequences) point at a scratch state and position 0: their outputs are
computed and ignored. A captured graph's segments name the states of its capture (the scratch state): kernels on the
decode path must read `tables` and `positions` only, never `SegmentRows.state` or `past`.
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
    tables: torch.Tensor | None = None            # decode batch: int64 [L, 2, N] buffer addresses (module docstring)
    # DSA (ft.runtime.layers.mla): segment index -> bool [num_tokens, past + num_tokens], the keys the last full
    # indexer layer of this forward selected for each query (shared layers reuse it)
    selection: dict[int, torch.Tensor] = field(default_factory=dict)
    input_ids: torch.Tensor | None = None          # [N] the tokens (deepseek_v4's hash routing reads them)

    @property
    def decode(self) -> bool:
        return self.tables is not None


def decode_inputs(buf: torch.Tensor, n: int, num_layers: int, *, ids: bool) -> tuple[torch.Tensor | None,
                                                                                   torch.Tensor, torch.Tensor]:
    """The one int64 buffer a decode step of n sequences is copied to the device in, split into its views:
    [ids n (a CUDA graph's, with `ids`) | positions n | tables L*2*n] -> (ids [n] or None, positions [n],
    tables [L, 2, n]). One layout for the eager step (`CausalLM._plan`), the graphs (`ft.runtime.gpu.graphs`) and
    the kernels build, which replays launches on these views: their strides (n, 1) and their offsets (8 bytes off
    16-byte alignment for odd n: the positions of a graph, every layer's tables of an eager step) are what Triton
    specializes the decode kernels on."""
    head, size = (2 if ids else 1) * n, decode_inputs_size(n, num_layers, ids=ids)
    if buf.dtype != torch.int64 or tuple(buf.shape) != (size,):
        raise ValueError(f"decode inputs of {n} sequences and {num_layers} layers need int64 [{size}], "
                         f"got {buf.dtype} {tuple(buf.shape)}")
    return (buf[:n] if ids else None), buf[head - n:head], buf[head:].view(num_layers, 2, n)


def decode_inputs_size(n: int, num_layers: int, *, ids: bool) -> int:
    """Elements of `decode_inputs`' buffer."""
    return (2 if ids else 1) * n + 2 * num_layers * n


def state_addresses(state: Any, num_layers: int) -> torch.Tensor:
    """int64 [L, 2]: the (k, v) or (conv, recurrent) buffer addresses of one SequenceState, per layer (0 for a layer
    without either). A decode batch's `tables` is these, stacked over its sequences along the last dim."""
    out = torch.zeros(num_layers, 2, dtype=torch.int64)
    for i, (k, v) in state.kv.items():
        out[i, 0], out[i, 1] = k.data_ptr(), v.data_ptr()
    for i, conv in state.conv.items():
        out[i, 0], out[i, 1] = conv.data_ptr(), state.recurrent[i].data_ptr()
    return out
