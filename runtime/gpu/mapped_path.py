"""Mode "mapped": offloaded decode calls that never wait for the host.

The host-planned path (`store.py`) brings every decode call's routing to the host before its kernel can start, one
host sync per MoE layer: the GPU idles while Python plans. Here a decode call (T * k <= MAX_DEVICE_PAIRS) runs device
kernels only, with the layer's bank page-locked and mapped into the GPU's address space (`gather.py`): a routed expert
with a VRAM slot is read from the pool; any other is copied from host memory by the GPU itself into a staging row of
the (idle in decode) prefill buffers, and the resident kernel runs over the pairs' rows. Each miss crosses the bus
once. Nothing waits for the host, so decode steps can be CUDA graphs (`graphs.py`). A call with more pairs than the
prefill buffers have rows reads records in place inside the kernel (`moe_nvfp4_device(host_base=...)`).

The host follows a step later. After the kernels, the call copies its routing record (int32 [3, 64]: the expert ids,
the rows its pairs read and how each was served, as `gather.py`'s plan kernel wrote it) into a page-locked ring
entry, asynchronously, with an event (graph replays: one copy of every layer's record); later calls read back the
entries whose event has completed (`poll`, never blocking unless the ring entry is needed again): hits / misses /
the trace are counted (`mapped_readback.py`), and up to `admit_max` of the missed experts per call, most frequently
routed first, are uploaded into victim slots when their routing frequency beats `admit_margin` x that of the slot's
owner; their table entries stay hidden (-1) until the upload lands, so no kernel reads a slot in flight.

The CPU lane (`cpu/lane.py`, on unless `OffloadConfig.cpu_lane` is off or no C compiler exists) computes part of
each call's staged misses on the host's cores at the same time as the GPU copies the rest, split by the measured
costs of both paths; it is made with the mapped banks (`ready`) and answers inside graph replays.

Records are read without the reader's lazy checksum, so a bank takes this path only after the pinner has verified
all its records (`pin_banks(verify=True)`; every layer before the pinner is done takes the host-planned path). A
verified bank the host-memory allowance left un-page-locked has no GPU mapping: the lane computes all of its layer's
misses (`lane_only`), so such a layer keeps this path and CUDA graphs. Host-planned calls in between first read
everything back (`release`).
"""

from __future__ import annotations

from collections import deque

import torch

from .cpu.lane import lane_for
from .device_path import MAX_DEVICE_PAIRS, count_call
from .mapped_readback import read_back
from .pinning import bank_range, verify_bank

GRAPH_BLOCKS = 8  # replays whose routing is in flight (graphs.py); when all are, the oldest is waited for
RING = 64  # routing records in flight; when all are, the oldest is waited for (bounds the bookkeeping lag)


def uses_mapped(ex, layer: int, num_tokens: int) -> bool:
    m = ex.mapped
    return (m is not None and ex.device_plan and 0 < num_tokens * ex.k <= MAX_DEVICE_PAIRS
            and m.ready(layer) and m.fits(layer, num_tokens))


class MappedDecode:
    def __init__(self, ex):
        self.ex = ex
        self.table = ex.cache.device_table(ex.device)
        self.base: dict[int, int] | None = None  # layer -> device address of its verified, mapped bank
        self.lane_only: set[int] = set()  # verified banks not page-locked: the CPU lane takes every miss of theirs
        self.lane = None  # CpuLane over the mapped banks, made with them (`ready`)
        # (event, layers, T, int32 tensor [n, 3, P] (ids, rows read, how served), its rows of `layers` (None: all, in
        # order), ring index or -1) not read back yet
        self.records: deque = deque()
        self.landing: deque = deque()  # (event, layer, experts): admissions whose table entries are hidden
        cuda = ex.device.type == "cuda"
        self.ring = [torch.empty(3, MAX_DEVICE_PAIRS, dtype=torch.int32, pin_memory=cuda) for _ in range(RING)]
        self.entry = torch.full((3, MAX_DEVICE_PAIRS), -1, dtype=torch.int32, device=ex.device)  # eager calls' record
        self._ring_busy = [False] * RING
        self.next = 0
        # CUDA-graph decode (graphs.py): the captured calls write their records here, int32 [L, 3, P]; after each
        # replay one copy moves all layers' into the next page-locked block, read back like ring entries
        self.graph_buf = torch.full((ex.L, 3, MAX_DEVICE_PAIRS), -1, dtype=torch.int32, device=ex.device)
        self.blocks = [torch.empty(ex.L, 3, MAX_DEVICE_PAIRS, dtype=torch.int32, pin_memory=cuda)
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
                    else:  # beyond the host-memory allowance: the CPU lane computes its misses
                        self.lane_only.add(i)
            self.lane = lane_for(self)
            if self.lane is None:
                self.lane_only.clear()  # no lane: those layers keep the host-planned path
        return layer in self.base or layer in self.lane_only

    def fits(self, layer: int, num_tokens: int) -> bool:
        """A lane-only layer's call needs a staging row per pair and the lane's token bound (no in-place reads)."""
        return layer in self.base or (num_tokens * self.ex.k <= 2 * self.ex.opts.prefill_slots
                                      and num_tokens <= self.lane.tmax)

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ex = self.ex
        self.poll()
        if self.lane is not None:
            self.lane.rest(False)
        T, k = topk_ids.shape
        count_call(ex, T)
        self.table.sync()
        y, record = self._kernel(layer, x, topk_ids, topk_weights, self.entry)
        r = self.next
        while self._ring_busy[r]:  # the entry is still to be read back (with graph blocks in between, the oldest
            self._pop(wait=True)   # record need not be this entry's): read back up to it
        entry = self.ring[r]
        self.next = (r + 1) % RING
        self._ring_busy[r] = True
        entry.copy_(record, non_blocking=True)
        ev = ex._record_compute()
        self.records.append((ev, [layer], T, entry[None], None, r))
        ex._prefill_done[:] = [ev, ev]  # staging wrote prefill-buffer rows: prefill uploads wait for this call
        return y

    def graph_call(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
        """A call inside a CUDA graph capture (or its warm-up): the kernels, and the entry into `graph_buf`; no host
        work (the table was uploaded before; `after_replay` does the bookkeeping)."""
        y, _ = self._kernel(layer, x, topk_ids, topk_weights, self.graph_buf[layer])
        if layer not in self.graph_layers:
            self.graph_layers.append(layer)
        return y

    def before_replay(self) -> None:
        self.ex.pipeline.abandon()  # a prefill forward that stopped part way may still copy into the staging rows
        if self.lane is not None:
            self.lane.rest(False)
        self.publish()

    def after_replay(self, num_tokens: int) -> None:
        """After a replay was queued: queue its entries' read-back and read back what has arrived (this runs while
        the GPU replays)."""
        self.record_step(num_tokens)
        self.poll()

    def record_step(self, num_tokens: int) -> None:
        """One async copy of every captured layer's entry (queued so far: a replay, or the capture's warm-up) into a
        page-locked block, read back by later polls like ring entries (in layer order)."""
        i = self.next_block
        self.next_block = (i + 1) % GRAPH_BLOCKS
        if self.block_copied[i] is not None:  # the block may still be unread: wait for its copy
            self.block_copied[i].synchronize()
        self.poll()  # reads back every completed record, the block's included
        block = self.blocks[i]
        block.copy_(self.graph_buf, non_blocking=True)
        ev = self.block_copied[i] = self.ex._record_compute()
        self.ex._prefill_done[:] = [ev, ev]  # as in __call__
        if self.graph_layers:  # one record for the whole step: its layers are read back in one vectorized pass
            layers = sorted(self.graph_layers)
            self.records.append((ev, layers, num_tokens, block, layers, -1))  # block: [L, 3, P]

    def _kernel(self, layer, x, topk_ids, topk_weights, entry):
        """-> (fp32 [T, H], the call's record: `entry` int32 [3, 64] filled as the module docstring says)."""
        ex = self.ex
        bank, P = ex.banks[layer], topk_ids.numel()
        row = self.table.tensor[layer]
        if P > 2 * ex.opts.prefill_slots:  # no staging rows for every pair: records read in place (CUDA, mapped)
            pair_slot = row[topk_ids.reshape(-1).long()]
            _fill(entry, topk_ids, pair_slot, (pair_slot < 0).to(torch.int32))
            if ex.device.type != "cuda":
                return _bank_reference(ex, bank, x, topk_ids, topk_weights), entry
            from .kernels.nvfp4_decode_mma import decode_kernel

            y = decode_kernel(x.shape[0])(ex.pool, ex.layout, x, topk_ids, row, topk_weights,
                                          host_base=self.base[layer], host_stride=bank.stride)
            return self._check(y, bank, x, topk_ids, topk_weights), entry
        if ex.device.type != "cuda" and not ex.interpret:  # CPU emulation: plan and copy in PyTorch
            from .kernels.gather import plan_reference
            from .kernels.moe_reference import moe_ref

            pair_slot, copied = plan_reference(topk_ids, self.table.tensor, layer, ex.num_slots)
            ids = topk_ids.reshape(-1).tolist()
            for p in torch.nonzero(copied).flatten().tolist():
                ex.pool[int(pair_slot[p])] = bank.record(ids[p])
            _fill(entry, topk_ids, pair_slot, copied)
            y = moe_ref(ex.pool, ex.layout, x, pair_slot.long().view(topk_ids.shape), topk_weights)
            return y, entry
        from .kernels.gather import gather_missing
        from .kernels.nvfp4_decode import moe_nvfp4_device

        lane = self.lane if self.lane is not None and topk_ids.shape[0] <= self.lane.tmax else None
        base = self.base.get(layer, 0)  # 0: lane-only, every staged miss goes to the CPU (`CpuLane.split_all`)
        post = None if lane is None else (lambda s, c: lane.post(layer, x, topk_ids, topk_weights, s, c, ex.num_slots,
                                                                 cpu_only=base == 0))
        pair_slot, pair_copy = gather_missing(ex.pool, ex.layout, topk_ids, self.table.tensor, layer, base,
                                              bank.stride, ex.num_slots, between=post, entry=entry)
        # the result in x's dtype on CUDA, rounded once on the kernel's store (the interpreter's bf16 store truncates:
        # fp32 there); with the lane, its wait adds the CPU's share to the fp32 sum first
        out_dtype = x.dtype if ex.device.type == "cuda" and self.checked else torch.float32
        pairs = self._pairs(P).view(topk_ids.shape)
        copied = pair_copy if base else None  # the gate_up programs of pairs not copied run during the copy
        if lane is None:
            y = moe_nvfp4_device(ex.pool, ex.layout, x, pairs, pair_slot, topk_weights, out_dtype=out_dtype,
                                 copied=copied)
        else:
            y = lane.finish(moe_nvfp4_device(ex.pool, ex.layout, x, pairs, pair_slot, topk_weights, copied=copied),
                            out_dtype)
        return self._check(y, bank, x, topk_ids, topk_weights), entry

    def _check(self, got, bank, x, topk_ids, topk_weights) -> torch.Tensor:
        if not self.checked:  # once: a GPU that misread mapped host memory would compute garbage silently
            want = _bank_reference(self.ex, bank, x, topk_ids, topk_weights)
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not err <= 1e-2:
                raise RuntimeError(f"mapped expert reads disagree with the reference (relative error {err:.2e}); "
                                   "start with --pinned-memory 0 (no bank mapped: the CPU computes every miss)")
            self.checked = True
        return got

    def _pairs(self, n: int) -> torch.Tensor:
        """int32 [n] = 0 .. n-1 on the device (made once per n, so none is made during a graph capture)."""
        if n not in self._arange:
            self._arange[n] = torch.arange(n, dtype=torch.int32, device=self.ex.device)
        return self._arange[n]

    def poll(self) -> None:
        """Publish landed uploads, then read back every routing record whose copy has completed (no waiting)."""
        if self.lane is not None:
            self.lane.check()
            self.lane.refit()
        self.publish()
        while self.records and (self.records[0][0] is None or self.records[0][0].query()):
            self._pop(wait=False)

    def publish(self) -> None:
        """Show the table entries of admitted experts whose upload has landed (the next `sync` uploads)."""
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
        ev, layers, T, entries, rows, ring_index = self.records.popleft()
        if wait and ev is not None:
            ev.synchronize()
        entries = entries.numpy()
        read_back(self, layers, T, entries if rows is None else entries[rows])
        if ring_index >= 0:
            self._ring_busy[ring_index] = False


def _bank_reference(ex, bank, x, topk_ids, topk_weights) -> torch.Tensor:
    """The call's result with every record read from the bank on the host (a sync: the first CUDA call's check, and
    the CPU emulation of in-place reads)."""
    from .kernels.moe_reference import moe_ref

    ids = topk_ids.reshape(-1).long().cpu()
    uniq = torch.unique(ids).tolist()
    records = torch.stack([bank.record(e) for e in uniq])
    index = {e: i for i, e in enumerate(uniq)}
    pair_slots = torch.tensor([index[e] for e in ids.tolist()]).view(topk_ids.shape)
    return moe_ref(records, ex.layout, x.cpu(), pair_slots, topk_weights.cpu()).to(x.device)


def _fill(entry: torch.Tensor, topk_ids: torch.Tensor, pair_slot: torch.Tensor, how: torch.Tensor) -> None:
    """A call's record (int32 [3, 64]) where no plan kernel writes it: in-place reads and the CPU emulation."""
    P = topk_ids.numel()
    for i, t in enumerate((topk_ids.reshape(-1), pair_slot, how)):
        entry[i, :P].copy_(t)
