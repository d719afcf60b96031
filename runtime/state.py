"""Per-sequence state and the segments of a batched forward (re-exported by `ft.runtime.model`).

A `SequenceState` owns, for one sequence, preallocated buffers for `max_tokens` tokens:
* full-attention layer i: `kv[i] = (k, v)`, each `[max_tokens, nkv, hd]` in the compute dtype;
* linear-attention layer i: `conv[i]` `[conv_dim, K-1]` (the last K-1 conv inputs, compute dtype) and
  `recurrent[i]` `[Hv, dk, dv]` fp32 (the DeltaNet state).
`length` is the number of tokens already consumed; `forward` appends after it and advances it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ft.formats.config import ModelConfig


class SequenceState:
    def __init__(self, config: ModelConfig, max_tokens: int, *, dtype: torch.dtype, device: torch.device) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.config = config
        self.max_tokens = max_tokens
        self.length = 0
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        kv_shape = (max_tokens, config.num_kv_heads, config.head_dim)
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
            config.linear_num_value_heads * config.linear_value_head_dim
        rec_shape = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
        for i, kind in enumerate(config.layer_types):
            if kind == "full_attention":
                # Rows past `length` are never read, so the KV buffers need no initialisation.
                self.kv[i] = (torch.empty(kv_shape, dtype=dtype, device=device),
                              torch.empty(kv_shape, dtype=dtype, device=device))
            else:
                self.conv[i] = torch.zeros(conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(rec_shape, dtype=torch.float32, device=device)
        self._freed = False

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.kv.values() for t in pair] + [*self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def free(self) -> None:
        """Drop the buffers; the state cannot be used afterwards."""
        self.kv, self.conv, self.recurrent = {}, {}, {}
        self._freed = True

    def __repr__(self) -> str:
        status = "freed" if self._freed else f"{self.length}/{self.max_tokens} tokens"
        return f"SequenceState({status})"


@dataclass
class Segment:
    """`num_tokens` consecutive tokens of one sequence inside a batched forward; `logits` selects what comes back:
    "last" -> [1, V] for the segment's last token, "all" -> [num_tokens, V]."""

    state: SequenceState
    num_tokens: int
    logits: Literal["last", "all"] = "last"
