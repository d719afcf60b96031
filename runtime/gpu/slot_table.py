"""Device mirror of the expert cache's slot table, so kernels can map (layer, expert) -> slot without the host.

`DeviceSlotTable.tensor` is int32 [num_layers, num_experts] on the device, -1 = not resident; row `layer` is what the
device-planned kernel (`nvfp4_decode.py`) reads. The host table `ExpertCache.slot_of` stays the source of truth;
`ExpertCache.version` counts its changes and `sync()` re-uploads the whole table when the count moved since the last
upload (a few KiB to a few hundred KiB: 4 * L * E bytes), else does nothing. So:

* no admit/evict since the last sync -> `sync()` is a host-side integer compare, no device work at all;
* after changes -> one H2D copy on the current stream from one of `STAGING` page-locked host copies, used in turn
  (a pageable source could make the driver wait for the stream; a staging copy is refilled only after its last
  upload's event completed, which it long has unless the host runs `STAGING` uploads ahead of the GPU). Kernels
  queued later on the same stream see the new table; kernels queued earlier see the old one, which is what they
  were planned for.

`hide(layer, experts)` keeps entries at -1 on the device although the host table has them resident: the mapped
decode path (`mapped_path.py`) admits an expert on the host at once but must not let kernels read its slot before
its upload has landed; `show` publishes them (the next `sync()` uploads).

The tensor keeps its address for its whole life (uploads copy into it), so a captured CUDA graph that reads it stays
valid; a sync must not happen during capture (`dirty` says whether one is due).
"""

from __future__ import annotations

import numpy as np
import torch


STAGING = 16  # page-locked host copies of the table (CUDA)


class DeviceSlotTable:
    def __init__(self, cache, device: torch.device | str):
        self.cache = cache  # an ExpertCache: slot_of int64 [L, E] and version
        self.device = torch.device(device)
        L, E = cache.slot_of.shape
        self.tensor = torch.full((L, E), -1, dtype=torch.int32, device=self.device)
        self.version = -1  # (cache version, hidden changes) uploaded last; -1 = never
        self.hidden = np.zeros(tuple(cache.slot_of.shape), bool)  # resident on the host, -1 on the device for now
        self._hidden_changes = 0
        self.uploads = 0
        cuda = self.device.type == "cuda"
        n = STAGING if cuda else 1
        self._staging = [torch.empty((L, E), dtype=torch.int32, pin_memory=cuda) for _ in range(n)]
        self._copied: list = [None] * n  # event after the last upload from each staging copy

    def hide(self, layer: int, experts) -> None:
        self.hidden[layer, np.asarray(experts, np.int64)] = True
        self._hidden_changes += 1

    def show(self, layer: int | None = None, experts=None) -> None:
        """Publish hidden entries: `experts` of `layer`, or all of them (layer None)."""
        if layer is None:
            self.hidden[:] = False
        else:
            self.hidden[layer, np.asarray(experts, np.int64)] = False
        self._hidden_changes += 1

    @property
    def dirty(self) -> bool:
        """True when the host table changed since the last upload (the next `sync()` copies)."""
        return self.version != (self.cache.version, self._hidden_changes)

    def sync(self) -> torch.Tensor:
        """Upload the host table if it changed; returns the int32 [L, E] device tensor (always the same one)."""
        if self.dirty:
            host = self.cache.slot_of
            if host.size and (host.max() >= 2**31):
                raise ValueError(f"slot {int(host.max())} does not fit the int32 device table")
            i = self.uploads % len(self._staging)
            if self._copied[i] is not None:
                self._copied[i].synchronize()  # its previous upload still reads it (done long ago, normally)
            np.copyto(self._staging[i].numpy(), np.where(self.hidden, -1, host), casting="unsafe")
            self.tensor.copy_(self._staging[i], non_blocking=self.device.type == "cuda")
            if self.device.type == "cuda":
                self._copied[i] = torch.cuda.Event()
                self._copied[i].record()
            self.version = (self.cache.version, self._hidden_changes)
            self.uploads += 1
        return self.tensor

    def row(self, layer: int) -> torch.Tensor:
        """int32 [E] view of one layer's expert -> slot map (synced first)."""
        return self.sync()[layer]
