"""Mode "mapped": offloaded decode calls that never wait for the host.

The host-planned path (`hybrid.py`) brings every decode call's routing to the host before its kernel can start, one
host sync per MoE layer: the GPU idles while Python plans, and the launches of the next layer's attention are no
longer hidden behind GPU work. Here a decode call (T * k <= MAX_DEVICE_PAIRS) instead runs device-planned kernels
with the layer's bank mapped into the GPU's address space: a routed expert with a VRAM slot is read from the pool;
any other is first copied by `gather_missing` from the page-locked bank in host memory into row num_slots + p of
the pool (the prefill buffers, idle in decode; prefill uploads into them wait for the call's event), then the
resident kernel runs over the pairs' slots. Its bytes cross the bus once, as a fetch would move them, and the copy's
many independent wide reads keep the link busy, which reading records inside the GEMV kernel did not (run L: ~17
GB/s). A call with more pairs than the prefill buffers have rows reads records in place inside the kernel
(`moe_nvfp4_device(host_base=...)`). Nothing waits for the host, so decode steps can be CUDA graphs (`graphs.py`).

The cache is refilled a step later. After the kernel, the call copies its routing and the slots its kernel used
(int32 [2, P]) into a page-locked ring entry, asynchronously, with an event. Each later call first reads back the
entries whose event has completed (`poll`, never blocking unless the ring is full): hits / misses / the trace are
counted from them, and up to `admit_max` of the missed experts, most frequently routed first, are admitted when
their routing frequency beats `admit_margin` x that of the slot's current owner (`ExpertCache` scores; an empty slot always takes
them). An admitted expert's upload is queued after every kernel queued so far (`after_compute`: the evicted expert
may still be read), and its device table entry stays hidden (-1: read from host memory) until the upload's event
has completed, so no kernel ever reads a slot in flight. The evicted expert's entry goes to -1 at once.

Records are read by the GPU without the reader's lazy checksum, so a bank takes this path only after the pinner has
verified all its records (`pin_banks(verify=True)`); other layers (and every layer before the pinner is done) take
the host-planned path, as mode offload. Host-planned calls in between publish every hidden entry after their fence
(`release`), since they read the host table.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from .device_path import MAX_DEVICE_PAIRS, count_call
from .pinning import bank_range, verify_bank

GRAPH_BLOCKS = 8  # replays whose routing is in flight (graphs.py); when all are, the oldest is waited for
RING = 64  # routing records in flight; when all are, the oldest is waited for (bounds the bookkeeping lag)


def uses_mapped(ex, layer: int, num_tokens: int) -> bool:
    m = ex.mapped
    return (m is not None and ex.device_plan and 0 < num_tokens * ex.k <= MAX_DEVICE_PAIRS
            and layer not in ex.opts.cpu_layers and m.ready(layer))


class MappedDecode:
    def __init__(self, ex):
        self.ex = ex
        self.table = ex.cache.device_table(ex.device)
        self.base: dict[int, int] | None = None  # layer -> device address of its verified, mapped bank
        self.records: deque = deque()  # (event, layer, T, ring entry int32 [2, P]) not yet read back
        self.landing: deque = deque()  # (event, layer, experts): uploads whose table entries are hidden
        cuda = ex.device.type == "cuda"
        self.ring = [torch.empty(2, MAX_DEVICE_PAIRS, dtype=torch.int32, pin_memory=cuda) for _ in range(RING)]
        self.next = 0
        # CUDA-graph decode (graphs.py): the captured calls write their routing and slots here, int32 [L, 2, P];
        # after each replay one copy moves all layers' into the next page-locked block, read back like ring entries
        self.graph_buf = torch.zeros(ex.L, 2, MAX_DEVICE_PAIRS, dtype=torch.int32, device=ex.device)
        self.blocks = [torch.empty(ex.L, 2, MAX_DEVICE_PAIRS, dtype=torch.int32, pin_memory=cuda)
                       for _ in range(GRAPH_BLOCKS)]
        self.block_copied: list = [None] * GRAPH_BLOCKS  # event after each block's last copy
        self.next_block = 0
        self.graph_layers: list[int] = []  # the MoE layers the captured graph runs through this path
        self._arange: dict[int, torch.Tensor] = {}
        self.checked = not cuda  # the first CUDA call is compared with the reference once (`_kernel`)

    def ready(self, layer: int) -> bool:
        """Whether `layer`'s bank may be read in place (resolved once, when the pinner has finished)."""
        if self.base is None:
            ex = self.ex
            if ex.pinner is not None and not ex.pinner.done.is_set():
                return False
            ex._pin_finished()  # pin_info, and the split's pinned rate for the host-planned calls
            if ex.pinner is not None:
                verified = set(ex.pin_info.get("verified_banks", ()))
            else:  # nothing pinned: on CUDA no bank is mapped; the CPU emulation reads banks as they are
                verified = {b.name for b in ex.banks.values() if verify_bank(b)} if ex.device.type != "cuda" else ()
            self.base = {}
            for i, bank in ex.banks.items():
                if bank.name in verified:
                    addr = ex.uploader.mapped_address(*bank_range(bank))
                    if addr is not None:
                        self.base[i] = addr
        return layer in self.base

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ex = self.ex
        self.poll()
        T, k = topk_ids.shape
        count_call(ex, T)
        row = self.table.row(layer)
        y = self._kernel(layer, x, topk_ids, row, topk_weights)
        ids = topk_ids.reshape(-1)
        if len(self.records) == RING:  # this call reuses the oldest entry: read it back first
            self._pop(wait=True)
        entry = self.ring[self.next]
        self.next = (self.next + 1) % RING
        entry[0, :T * k].copy_(ids, non_blocking=True)
        entry[1, :T * k].copy_(row[ids.long()], non_blocking=True)  # the slots this kernel read (-1: host memory)
        ev = ex._record_compute()
        self.records.append((ev, layer, T, entry))
        ex._prefill_done[:] = [ev, ev]  # the gather wrote prefill-buffer rows: prefill uploads wait for this call
        return y

    def graph_call(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """A call inside a CUDA graph capture (or its warm-up): the kernel, and the routing + slots into `graph_buf`;
        no host work (the table was synced before; `after_replay` does the bookkeeping)."""
        T, k = topk_ids.shape
        row = self.table.tensor[layer]
        y = self._kernel(layer, x, topk_ids, row, topk_weights)
        ids = topk_ids.reshape(-1)
        self.graph_buf[layer, 0, :T * k].copy_(ids)
        self.graph_buf[layer, 1, :T * k].copy_(row[ids.long()])
        if layer not in self.graph_layers:
            self.graph_layers.append(layer)
        return y

    def after_replay(self, num_tokens: int) -> None:
        """After a replay was queued: one async copy of every captured layer's routing into a page-locked block, read
        back by later polls like ring entries (in layer order)."""
        i = self.next_block
        self.next_block = (i + 1) % GRAPH_BLOCKS
        if self.block_copied[i] is not None:  # the block may still be unread: wait for its copy
            self.block_copied[i].synchronize()
        self.poll()  # reads back every completed record, the block's included
        block = self.blocks[i]
        block.copy_(self.graph_buf, non_blocking=True)
        ev = self.block_copied[i] = self.ex._record_compute()
        self.ex._prefill_done[:] = [ev, ev]  # as in __call__
        for layer in self.graph_layers:
            self.records.append((ev, layer, num_tokens, block[layer]))

    def _kernel(self, layer, x, topk_ids, row, topk_weights) -> torch.Tensor:
        ex = self.ex
        bank = ex.banks[layer]
        if ex.device.type != "cuda" and not ex.interpret:
            return _reference(ex, bank, x, topk_ids, row, topk_weights)
        from .nvfp4_decode import gather_missing, moe_nvfp4_device

        P = topk_ids.numel()
        if P <= 2 * ex.opts.prefill_slots:  # misses gathered into the prefill buffers' rows first (module docstring)
            pair_slot = gather_missing(ex.pool, ex.layout, topk_ids, row, self.base[layer], bank.stride, ex.num_slots)
            got = moe_nvfp4_device(ex.pool, ex.layout, x, self._pairs(P).view(topk_ids.shape), pair_slot,
                                   topk_weights)
        else:
            got = moe_nvfp4_device(ex.pool, ex.layout, x, topk_ids, row, topk_weights, host_base=self.base[layer],
                                   host_stride=bank.stride)
        if not self.checked:  # once: a GPU that misread mapped host memory would compute garbage silently
            want = _reference(ex, bank, x, topk_ids, row, topk_weights)
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not err <= 1e-2:
                raise RuntimeError(f"mapped expert reads disagree with the reference (relative error {err:.2e}); "
                                   "use mode offload")
            self.checked = True
        return got

    def _pairs(self, n: int) -> torch.Tensor:
        """int32 [n] = 0 .. n-1 on the device (made once per n, so none is made during a graph capture)."""
        if n not in self._arange:
            self._arange[n] = torch.arange(n, dtype=torch.int32, device=self.ex.device)
        return self._arange[n]

    def poll(self) -> None:
        """Publish landed uploads, then read back every routing record whose copy has completed (no waiting)."""
        self.publish()
        while self.records and (self.records[0][0] is None or self.records[0][0].query()):
            self._pop(wait=False)

    def publish(self) -> None:
        """Show the table entries of every admitted expert whose upload has landed (the next `sync` uploads them)."""
        while self.landing and (self.landing[0][0] is None or self.landing[0][0].query()):
            _, layer, experts = self.landing.popleft()
            self.table.show(layer, experts)

    def release(self) -> None:
        """Before a host-planned call reads the host table, or counters are read: read back every record, make later
        kernels wait for every upload queued so far, and publish every hidden entry."""
        while self.records:
            self._pop(wait=True)
        if self.landing:
            self.ex._wait(self.ex.uploader.fence())
            self.landing.clear()
            self.table.show()

    def _pop(self, *, wait: bool) -> None:
        """Bookkeeping of the oldest record: counters, trace, recency, then admits (uploads queued, entries hidden)."""
        ev, layer, T, entry = self.records.popleft()
        if wait and ev is not None:
            ev.synchronize()
        ex, cache = self.ex, self.ex.cache
        P = T * ex.k
        ids, seen = entry[0, :P].numpy().astype(np.int64), entry[1, :P].numpy()
        cache.observe(layer, ids, T)
        uniq, first = np.unique(ids, return_index=True)
        hits = int((seen[first] >= 0).sum())
        c = ex.counters
        c["hits"] += hits
        c["misses"] += len(uniq) - hits
        c["bytes_mapped"] += (len(uniq) - hits) * ex.layout.payload_bytes
        ex.per_layer[:2, layer] += (hits, len(uniq) - hits)
        if len(ex.trace) < ex.opts.trace_limit:
            ex.trace.append((layer, uniq))
        slots = cache.lookup(layer, uniq)
        cache.touch(slots[slots >= 0])
        self._admit(layer, uniq[slots < 0])

    def _admit(self, layer: int, missed: np.ndarray) -> None:
        ex, cache = self.ex, self.ex.cache
        n = min(len(missed), ex.opts.admit_max)
        if n == 0 or cache.S == 0:
            return
        freq = cache.frequency(layer * ex.E + missed)
        order = np.argsort(-freq, kind="stable")[:n]
        victims = cache.victims(n)
        owners = cache.owner[victims]
        # candidates most frequent first, victims easiest first: admit up to the first that does not pay
        pays = (owners < 0) | (freq[order[:len(victims)]] > ex.opts.admit_margin * cache.frequency(np.maximum(owners, 0)))
        keep = len(pays) if pays.all() else int(np.argmin(pays))
        if keep == 0:
            return
        experts = missed[order[:keep]]
        ex.uploader.after_compute(ex._record_compute())  # the evicted experts may still be read by queued kernels
        slots, _ = cache.admit_many(layer, experts, victims[:len(experts)])
        admitted = experts[slots >= 0]
        self.table.hide(layer, admitted)
        for e, s in zip(admitted.tolist(), slots[slots >= 0].tolist()):
            ex.uploader.upload(s, ex.banks[layer].record(e))
        ex.counters["fetched"] += len(admitted)
        ex.counters["bytes_h2d"] += len(admitted) * ex.layout.stride
        ex.per_layer[2, layer] += len(admitted)
        self.landing.append((ex.uploader.fence(), layer, admitted))


def _reference(ex, bank, x, topk_ids, row, topk_weights) -> torch.Tensor:
    """The mapped call's result from the reference on the host: a resident expert's record from its pool slot, any
    other from the bank (a sync; the first CUDA call and the CPU emulation only)."""
    from .moe_reference import moe_ref

    ids = topk_ids.reshape(-1).long().cpu()
    slots = row.long().cpu()[ids]
    uniq = torch.unique(ids).tolist()
    where = dict(zip(ids.tolist(), slots.tolist()))
    records = torch.stack([ex.pool[where[e]].cpu() if where[e] >= 0 else bank.record(e) for e in uniq])
    index = {e: i for i, e in enumerate(uniq)}
    pair_slots = torch.tensor([index[e] for e in ids.tolist()]).view(topk_ids.shape)
    return moe_ref(records, ex.layout, x.cpu(), pair_slots, topk_weights.cpu()).to(x.device)
