"""Per-sequence state and the segments of a batched forward (re-exported by `ft.runtime.model`).

A `SequenceState` holds, for one sequence of at most `max_tokens` tokens:
* attention layer i (full or sliding window, which keeps every row too): `kv[i] = (k, v)`, each
  `[capacity, nkv, hd]` in the compute dtype; an `mla_attention` layer's pair is (latent, index keys) instead,
  `[capacity, 1, kv_lora_rank + rotary_dim]` and `[capacity, 1, index_head_dim or 0]` (`kv_row_shapes`);
* compressed_attention layer i (deepseek_v4): `compressed[i]`, a `CompressedKV` (its KV rows, the raw compressor
  projections of the last 2m tokens and the pooled entries; `ft.runtime.layers.compressed_attention`), which grows
  with the capacity like the KV buffers; its rings hold no older rows, so it goes back to an earlier length only
  from a snapshot of them (`windows`);
* linear-attention layer i: `conv[i]` `[conv_dim, K-1]` (the last K-1 conv inputs, compute dtype) and
  `recurrent[i]` `[Hv, dk, dv]` fp32 (the DeltaNet state), fixed size.
`length` is the number of tokens already consumed; `forward` appends after it and advances it, and the layers write
KV rows `[length, length + n)` into the buffers as they are, so the buffers must already hold `length + n` rows.
By default `capacity == max_tokens` (everything preallocated: `model.new_state`, VRAM sizing). The engine starts
smaller and calls `ensure_capacity(length + n)` before each forward, so the memory held tracks the actual length.
Invariant: `length <= capacity <= max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ft.formats.config import ModelConfig
from ft.runtime.layers.batch import state_addresses
from ft.runtime.layers.compressed_attention import CompressedKV, spec_for


class SequenceState:
    def __init__(self, config: ModelConfig, max_tokens: int, *, dtype: torch.dtype, device: torch.device,
                 capacity: int | None = None) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        capacity = max_tokens if capacity is None else capacity
        if not 0 <= capacity <= max_tokens:
            raise ValueError(f"capacity must be in [0, max_tokens={max_tokens}], got {capacity}")
        self.config = config
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.length = 0
        self._capacity = capacity
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.compressed: dict[int, CompressedKV] = {}
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
            config.linear_num_value_heads * config.linear_value_head_dim
        rec_shape = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
        for i, kind in enumerate(config.layer_types):
            if kind == "compressed_attention":
                self.compressed[i] = CompressedKV(spec_for(config, i), capacity, dtype=dtype, device=device)
            elif config.is_attention(i):  # rows past `length` are never read: no initialisation
                self.kv[i] = tuple(torch.empty((capacity, *shape), dtype=dtype, device=device)
                                   for shape in kv_row_shapes(config, i))
            else:
                self.conv[i] = torch.zeros(conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(rec_shape, dtype=torch.float32, device=device)
        self._freed = False
        self._addresses: torch.Tensor | None = None

    def addresses(self) -> torch.Tensor:
        """int64 [L, 2]: this state's buffer addresses per layer, a decode batch's `tables` column (see
        `ft.runtime.layers.batch`); they change only when the KV buffers grow."""
        if self._addresses is None:
            self._addresses = state_addresses(self, self.config.num_layers)
        return self._addresses

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def capacity(self) -> int:
        """Tokens the full-attention KV buffers hold now."""
        return self._capacity

    def ensure_capacity(self, num_tokens: int, *, at_most: int | None = None) -> None:
        """Make the KV buffers hold at least `num_tokens` rows: no-op if they do, else grow them to
        min(max(num_tokens, 2 x capacity), max_tokens, at_most), copying the `length` filled rows (one layer at a
        time, so the transient extra memory is one layer's old buffers)."""
        if self._freed:
            raise ValueError("the state was freed")
        if num_tokens <= self._capacity:
            return
        limit = self.max_tokens if at_most is None else min(at_most, self.max_tokens)
        if num_tokens > limit:
            raise ValueError(f"{num_tokens} tokens exceed the state's limit {limit} (max_tokens {self.max_tokens})")
        self.resize(min(max(num_tokens, 2 * self._capacity), limit))

    def resize(self, capacity: int) -> None:
        """KV buffers of `capacity` rows (>= length), the `length` filled rows copied over, one layer at a time (so
        the transient extra memory is one layer's old buffers)."""
        if not self.length <= capacity <= self.max_tokens:
            raise ValueError(f"capacity {capacity} outside [{self.length}, {self.max_tokens}]")
        for i, pair in self.kv.items():
            resized = []
            for old in pair:
                buf = old.new_empty((capacity, *old.shape[1:]))  # rows past `length` are never read
                buf[: self.length] = old[: self.length]
                resized.append(buf)
            self.kv[i] = (resized[0], resized[1])
        for c in self.compressed.values():
            c.resize(capacity, self.length)
        self._capacity = capacity
        self._addresses = None

    def windows(self) -> dict[str, torch.Tensor]:
        """The parts valid at the current `length` only, by name: `conv.i` / `rec.i` (a linear-attention layer's
        last conv inputs and DeltaNet state), `raw.i` / `index_raw.i` (a compressed layer's rings of raw compressor
        projections). Everything else is per-token rows that truncation rewinds (KV rows; a compressed layer's pooled
        entries, `CompressedKV.rows`), so a state goes back to an earlier length given a `snapshot` taken there.
        Empty for attention-only models: they rewind to any length."""
        out = {f"conv.{i}": t for i, t in self.conv.items()} | {f"rec.{i}": t for i, t in self.recurrent.items()}
        for i, c in self.compressed.items():
            out |= {f"{name}.{i}": t for name, t in c.windows().items()}
        return out

    @property
    def rewinds_from_snapshots(self) -> bool:
        """Whether going back to an earlier length needs a snapshot (`windows` is not empty)."""
        return bool(self.conv) or any(c.windows() for c in self.compressed.values())

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Host copies of `windows` (valid at the current `length`); empty for attention-only models. Syncs with the
        device (the forwards that wrote them must be done)."""
        return {name: t.to("cpu", copy=True) for name, t in self.windows().items()}

    def rows(self, length: int) -> dict[str, torch.Tensor]:
        """Views of the per-token parts holding the first `length` tokens, by name: `kv.i.k` / `kv.i.v` (an
        attention layer's two buffers), `cmp.i.kv` / `cmp.i.entries` / `cmp.i.index_entries` (a compressed layer's
        `CompressedKV.rows`)."""
        out = {f"kv.{i}.{n}": t[:length] for i, pair in self.kv.items() for n, t in zip("kv", pair)}
        for i, c in self.compressed.items():
            out |= {f"cmp.{i}.{name}": t for name, t in c.rows(length).items()}
        return out

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Copy `snapshot` (`snapshot` / `windows` of a state of this model) into this state's `windows`."""
        live = self.windows()
        check_parts(snapshot, live, "a snapshot")
        for name, t in snapshot.items():
            live[name].copy_(t)

    def _replace_windows(self, values: dict[str, torch.Tensor]) -> None:
        for name, t in values.items():
            kind, i = name.rsplit(".", 1)
            if kind == "conv":
                self.conv[int(i)] = t
            elif kind == "rec":
                self.recurrent[int(i)] = t
            else:
                self.compressed[int(i)].set_window(kind, t)
        self._addresses = None

    def clone(self, length: int, snapshot: dict[str, torch.Tensor] | None = None, *,
              capacity: int | None = None) -> SequenceState:
        """A new state holding this one's first `length` tokens, with KV buffers of `capacity` rows (default: this
        state's capacity; at least `length`): the per-token rows copied (`rows`), the `windows` copied too, or taken
        from `snapshot` (taken at `length`: `snapshot`), which a model that has them needs unless `length` is the
        current one. This state is left as it is (a kept prefix serves several requests)."""
        if self._freed:
            raise ValueError("the state was freed")
        if not 0 <= length <= self.length:
            raise ValueError(f"can only copy 0..{self.length} tokens, not {length}")
        rewound = self.rewinds_from_snapshots and length != self.length
        if rewound and snapshot is None:
            raise ValueError("a model with recurrent or compressed layers is copied at another length only from a "
                             "snapshot")
        capacity = max(length, self._capacity if capacity is None else capacity)
        dtype = next(iter(self.kv.values()))[0].dtype if self.kv else \
            next(iter(self.compressed.values())).kv.dtype if self.compressed else next(iter(self.conv.values())).dtype
        new = SequenceState(self.config, max(self.max_tokens, capacity), dtype=dtype, device=self.device,
                            capacity=capacity)
        mine = self.rows(length)
        for name, dst in new.rows(length).items():
            dst.copy_(mine[name])
        new.restore(snapshot if rewound else self.windows())
        new.length = length
        return new

    def rewind(self, length: int, snapshot: dict[str, torch.Tensor] | None = None) -> None:
        """Go back to the first `length` tokens: rows past it are stale from now on (never read: a compressed layer
        rewrites an entry when its window completes again); the `windows` are only valid at one length, so a model
        that has them needs `snapshot` taken at `length` unless `length` is the current one."""
        if self._freed:
            raise ValueError("the state was freed")
        if not 0 <= length <= self.length:
            raise ValueError(f"can only rewind to 0..{self.length} tokens, not {length}")
        if self.rewinds_from_snapshots and length != self.length:
            if snapshot is None:
                raise ValueError("a model with recurrent or compressed layers rewinds only to a snapshot of its state")
            self.restore(snapshot)
        self.length = length

    def park(self) -> None:
        """Move the `windows` to host memory (a state kept for reuse holds device memory only for its rows, which
        the KV budget counts); `unpark` brings them back before the state runs again."""
        self._replace_windows({name: t.to("cpu") for name, t in self.windows().items()})

    def unpark(self) -> None:
        """Back on the device, as new tensors: the parked ones may be shared as a snapshot (`PrefixCache.take`)."""
        self._replace_windows({name: t.to(self.device, copy=True) for name, t in self.windows().items()})

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.kv.values() for t in pair] + [*self.conv.values(), *self.recurrent.values()]
        tensors += [t for c in self.compressed.values() for t in c.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def free(self) -> None:
        """Drop the buffers; the state cannot be used afterwards."""
        self.kv, self.conv, self.recurrent, self.compressed = {}, {}, {}, {}
        self._freed = True
        self._addresses = None

    def __repr__(self) -> str:
        status = "freed" if self._freed else f"{self.length}/{self._capacity}/{self.max_tokens} tokens"
        return f"SequenceState({status})"


def kv_row_shapes(config: ModelConfig, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The per-token shapes of an attention layer's two cache buffers: GQA (k, v) `[nkv, hd]` each; mla_attention
    (latent, index keys) `[1, kv_lora_rank + rotary_dim]` (the normed latent and the rotated shared key) and
    `[1, index_head_dim]` on layers with their own indexer, else `[1, 0]` (no bytes)."""
    cfg = config
    if cfg.layer_types[layer] != "mla_attention":
        return (cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)
    own = bool(cfg.indexer_types) and cfg.indexer_types[layer] == "full"
    return (1, cfg.kv_lora_rank + cfg.rotary_dim), (1, cfg.index_head_dim if own else 0)



def check_parts(values: dict[str, torch.Tensor], live: dict[str, torch.Tensor], what: str) -> None:
    """ValueError unless `values` holds exactly the parts of `live` (a state's `rows` / `windows`), shape for shape."""
    if set(values) != set(live):
        raise ValueError(f"{what} has parts {sorted(set(values) ^ set(live))[:4]} that this model's state has not, "
                         "or lacks them")
    for name, t in values.items():
        if t.shape != live[name].shape:
            raise ValueError(f"{what}: part {name} of shape {tuple(t.shape)}, not {tuple(live[name].shape)}")

@dataclass
class Segment:
    """`num_tokens` consecutive tokens of one sequence inside a batched forward; `logits` selects what comes back:
    "last" -> [1, V] for the segment's last token, "all" -> [num_tokens, V]."""

    state: SequenceState
    num_tokens: int
    logits: Literal["last", "all"] = "last"
