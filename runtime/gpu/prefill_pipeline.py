"""Prefill at a VRAM budget, pipelined across layers: every expert without a slot streamed once, ahead of its layer.

A prefill forward of T tokens with T * k >= BLIND * E routes to nearly every expert of every MoE layer (uniform
routing leaves a fraction e^-BLIND of them unrouted). So its misses are known before its routing is: the experts
without a VRAM slot. This path (mode mapped, layers whose bank is verified) streams them without waiting for any
routing, so the host never syncs on the GPU and the copy engine never idles at a layer boundary:

  schedule  at a forward's first MoE call: per MoE layer from there on, its experts without a slot in ascending
            order, cut into groups of G = prefill_slots. Group i goes to prefill buffer i % 2 (pool rows
            num_slots + (i % 2) * G ..). One lookup row per group (expert -> its buffer row, SKIP elsewhere) and
            one per layer for its hits (expert -> slot), uploaded together: int32 [groups + layers, E + 2].
  copies    on the uploader's stream, each run of consecutive experts one DMA from the page-locked bank; group i
            after the compute that last read its buffer (group i - 2). The copies run two groups ahead of the
            compute, across layer boundaries: layer l+1's experts stream while layer l's attention computes. A bank
            the host-memory allowance left un-page-locked (`MappedDecode.lane_only`) goes through the uploader's
            staging ring instead (pageable -> pinned memcpy on its thread, then DMA); the host waits for a staged
            group's memcpy only when its compute is queued, one group behind the copies.
  compute   per layer one device plan of the pairs by expert (`prefill_plan.plan_by_expert`), then the tile kernels
            once over the hits and once per group (after its copy), each call mapping blocks to slots through its
            lookup row; blocks of other experts are SKIP (-2) and write nothing, so the shared [P, H] output gets
            each pair's row exactly once, from the tiles a resident call uses: bit-identical to resident prefill.
  routing   copied back asynchronously and added to the cache's frequency counts once it has arrived, so decode
            admission knows the prompt's experts.

Streamed experts land in the prefill buffers only: decode-hot slots are never evicted. Bytes over the link per
forward: (experts without a slot) x record, whatever the routing. Smaller prefills keep the routed path
(`prefill_stream.py`: only routed misses, one host sync per layer).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from .device_path import count_call
from .pinning import bank_range

BLIND = 4  # T * k >= BLIND * E: stream every expert without a slot (expected unrouted share e^-BLIND, uniform)
SKIP = -2  # block slot: another call of the same plan computes these pairs (nvfp4_triton._down_kernel)
STAGED = "staged"  # a group's copies queued on the staging thread, not yet fenced


def uses_pipeline(ex, layer: int, num_tokens: int) -> bool:
    md = ex.mapped
    return (md is not None and ex.device_plan and num_tokens >= ex.opts.prefill_tokens
            and num_tokens * ex.k >= BLIND * ex.E and md.ready(layer))


class PrefillPipeline:
    def __init__(self, ex):
        self.ex = ex
        self.G = ex.opts.prefill_slots
        self.groups: list[tuple[int, np.ndarray]] = []  # (layer, experts ascending) in stream order
        self.span: dict[int, tuple[int, int, int]] = {}  # layer -> (first group, end group, its hits' lookup row)
        self.lut: torch.Tensor | None = None  # int32 [groups + layers, E + 2] on the device
        self.copied: list = []  # per group: event after its copies (None on the CPU), once issued
        self.expect: int | None = None  # the MoE layer the current schedule calls next
        self.after: dict[int, int | None] = {}  # scheduled layer -> the next one (None: the schedule's last)
        self.bank_base: dict[int, int] = {}  # scheduled page-locked layer -> address of its bank's first record
        self.routing: deque = deque()  # (event, layer, tokens, page-locked int32 [T * k]) not yet counted

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ex = self.ex
        if layer != self.expect:
            self._start(layer, topk_ids.shape[0])
        self._count_routing()
        T, k = topk_ids.shape
        count_call(ex, T)
        ex.counters["prefill_calls"] += 1
        first, end, hit_row = self.span[layer]
        run = _Runs(ex.pool, ex.layout, ex.E, x, topk_ids, topk_weights,
                    kernels=ex.device.type == "cuda" or ex.interpret)
        run(self.lut[hit_row])
        for i in range(first, end):
            if self.copied[i] is STAGED:  # its memcpy runs on the staging thread: wait until it is issued
                self.copied[i] = ex.uploader.fence()
            ex._wait(self.copied[i])
            run(self.lut[i])
            ex._prefill_done[i % 2] = ex._record_compute()
            self._issue(i + 2)  # into the buffer this group has just released
        self.expect = self.after[layer]
        self._keep_routing(layer, topk_ids)
        return run.result()

    def _start(self, layer: int, num_tokens: int) -> None:
        """A new forward: schedule the experts without a slot of this and the following MoE layers (up to the first
        that takes another path, which may use the prefill buffers itself) and issue the first two groups."""
        self.abandon()
        ex, cache, E = self.ex, self.ex.cache, self.ex.E
        ex._wait(ex.uploader.fence())  # admissions still landing are hits here: the kernels wait for them
        earlier = ex._record_compute()  # decode calls stage misses in the prefill buffers: copies wait for them
        if earlier is not None:
            ex.uploader.after_compute(earlier)
        layers = []
        for i in (i for i in ex.moe_layers if i >= layer):
            if not uses_pipeline(ex, i, num_tokens):
                break
            layers.append(i)
        self.groups, self.span = [], {}
        self.after = dict(zip(layers, [*layers[1:], None]))
        self.bank_base = {i: bank_range(ex.banks[i])[0] for i in layers if i in ex.mapped.base}
        for i in layers:
            missing = np.flatnonzero(cache.slot_of[i] < 0)
            first = len(self.groups)
            self.groups += [(i, missing[j:j + self.G]) for j in range(0, len(missing), self.G)]
            self.span[i] = (first, len(self.groups), -1)
        lut = np.full((len(self.groups) + len(layers), E + 2), SKIP, np.int32)
        for g, (_, experts) in enumerate(self.groups):
            lut[g, experts] = ex.num_slots + (g % 2) * self.G + np.arange(len(experts))
        for j, i in enumerate(layers):
            row = len(self.groups) + j
            slots = cache.slot_of[i]
            lut[row, :E] = np.where(slots >= 0, slots, SKIP)
            self.span[i] = self.span[i][:2] + (row,)
        host = torch.from_numpy(lut)
        cuda = ex.device.type == "cuda"
        self.lut = (host.pin_memory() if cuda else host).to(ex.device, non_blocking=cuda)  # no wait for the GPU
        self.copied = [None] * len(self.groups)
        self.expect = layer
        self._issue(0)
        self._issue(1)

    def abandon(self) -> None:
        """Another path runs (decode, or a forward that stopped part way): copies issued for groups no kernel will
        read must land before anything else writes their buffers."""
        if self.expect is not None:
            self.ex._wait(self.ex.uploader.fence())
            self.expect = None

    def _issue(self, i: int) -> None:
        """Queue group i's copies behind the compute that last read its buffer."""
        if i >= len(self.groups):
            return
        ex = self.ex
        layer, experts = self.groups[i]
        done = ex._prefill_done[i % 2]
        if done is not None:
            ex.uploader.after_compute(done)
        bank = ex.banks[layer]
        row = ex.num_slots + (i % 2) * self.G
        base = self.bank_base.get(layer)
        if base is None:  # not page-locked: each record through the staging ring, queued (`__call__` fences it)
            for j, e in enumerate(experts.tolist()):
                ex.uploader.upload(row + j, bank.record(e))
            self.copied[i] = STAGED
        else:
            starts = np.flatnonzero(np.r_[True, np.diff(experts) != 1])  # runs of consecutive experts: one DMA each
            ex.uploader.upload_ranges([(row + s, base + int(experts[s]) * bank.stride, (e - s) * bank.stride)
                                       for s, e in zip(starts.tolist(), np.r_[starts[1:], len(experts)].tolist())])
            self.copied[i] = ex.uploader.fence()
        ex.counters["prefill_streamed"] += len(experts)
        ex.counters["bytes_h2d"] += len(experts) * bank.stride

    def _keep_routing(self, layer: int, topk_ids: torch.Tensor) -> None:
        ids = topk_ids.reshape(-1).to(torch.int32)
        host = torch.empty(ids.shape, dtype=torch.int32, pin_memory=self.ex.device.type == "cuda")
        host.copy_(ids, non_blocking=True)
        self.routing.append((self.ex._record_compute(), layer, topk_ids.shape[0], host))

    def _count_routing(self) -> None:
        """Add the routing that has come back to the cache's frequency counts (never waits)."""
        while self.routing and (self.routing[0][0] is None or self.routing[0][0].query()):
            _, layer, T, host = self.routing.popleft()
            self.ex.cache.observe(layer, host.numpy(), T)

    def settle(self) -> None:
        """Wait for the routing still in flight and count it (counters are about to be read)."""
        for ev, *_ in self.routing:
            if ev is not None:
                ev.synchronize()
        self._count_routing()


class _Runs:
    """One call's plan of its pairs by expert, run once per lookup row (`__call__`); `result()` -> fp32 [T, H]."""

    def __init__(self, pool, layout, num_experts: int, x, topk_ids, topk_weights, *, kernels: bool):
        T, k = topk_ids.shape
        H, P = x.shape[1], T * k
        self.pool, self.layout, self.shape = pool, layout, (T, k, H)
        self.kernels = kernels
        if kernels:  # the Triton tile kernels (CUDA, or the interpreter)
            from .kernels.nvfp4_triton import pick_blocks
            from .prefill_plan import plan_by_expert

            self.blocks = pick_blocks(P / min(num_experts, P), H, layout.inter)  # a resident call's: same tiles
            self.sorted_pairs, self.bucket = plan_by_expert(topk_ids, num_experts, self.blocks["BLOCK_M"])
            self.out = torch.empty(P, H, dtype=torch.float32, device=x.device)  # each row written by one run
            self.x = x.to(torch.bfloat16).contiguous()
            self.w = topk_weights.reshape(-1).to(torch.float32).contiguous()
        else:  # CPU emulation: the reference over each run's pairs
            self.x, self.ids, self.w, self.parts = x, topk_ids.long(), topk_weights, []

    def __call__(self, lut_row: torch.Tensor) -> None:
        """lut_row int32 [E + 2]: expert -> pool row for the experts this run computes, SKIP for the others."""
        if self.kernels:
            from .kernels.nvfp4_triton import moe_blocks

            moe_blocks(self.pool, self.layout, self.x, self.shape[1], self.sorted_pairs,
                       lut_row.index_select(0, self.bucket), self.w, self.out, self.blocks)
        else:
            from .kernels.moe_reference import moe_ref

            slots = lut_row.long()[self.ids]
            self.parts.append(moe_ref(self.pool, self.layout, self.x, torch.where(slots >= 0, slots, -1), self.w))

    def result(self) -> torch.Tensor:
        if self.kernels:
            return self.out.view(*self.shape).sum(1)
        return sum(self.parts[1:], self.parts[0])
