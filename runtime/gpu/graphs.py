"""CUDA-graph decode: one captured forward per batch size serves every decode step.

Eager decode at batch 1 is bound by the host, not the GPU: every layer issues dozens of small kernels from Python. A
replay issues the whole step at once.

What is captured, once per batch size G in `batch_sizes` (1, 2, 4, 8 ... up to the engine's max running requests):
`CausalLM.layers_pending` + `logits_head` on a decode batch of G rows (`ForwardBatch.tables`, see
`ft.runtime.layers.batch`). The sequence-mixing layers find each row's buffers through the static `tables`
[L, 2, G] and its position through the static `positions` [G]; nothing in the graph depends on which sequences
run or how long they are. So a graph is never captured again: not when a sequence grows (its KV buffers are
reallocated: the next step's tables hold the new addresses), not when another sequence joins.
The graph starts from token ids: it embeds them itself. Per step, outside the graph: ids, positions and tables,
written into one page-locked host buffer and copied with one non-blocking copy (`_Captured`; ids sampled on the device
are copied there on the device);
the experts' host bookkeeping (`before_replay`: the device slot table is uploaded if admits changed it;
`after_replay`, which runs while the GPU replays: call counters; mode mapped queues this replay's routing read-back,
reads back the previous steps' and admits experts).
B sequences replay the smallest captured G >= B; rows B..G-1 are padding: token 0, position 0, buffers of a scratch
state of one token. A real token's embedding keeps every value they produce finite, so padding can never poison
anything; their outputs are dropped.

A step is not replayed (`step` returns None and the model runs eagerly) unless every MoE layer's call of G tokens is
sync-free (`graph_ready`): mode resident, mode mapped once its banks are pinned and verified.
Hybrid / offload / cpu bring the routing to the host mid-step, which a graph cannot do.

Capture: the body runs once eagerly on a side stream on the scratch rows (compiles kernels, makes the paths'
first-call checks, which sync), then once under capture. `capture=False` runs the same decode batch eagerly instead
of replaying (CPU tests of everything but the capture itself).
"""

from __future__ import annotations

import logging
import time

import torch

from ft.runtime.layers.batch import ForwardBatch, SegmentRows, decode_inputs, decode_inputs_size

from .device_path import count_call, device_kernel, uses_device_plan
from .mapped_path import uses_mapped

log = logging.getLogger("ft.gpu")


# ---- the experts' side (GpuExperts) ----------------------------------------------------------------------------
def graph_ready(ex, num_tokens: int) -> bool:
    """Whether every MoE layer's call of `num_tokens` tokens is sync-free, so one step can be captured."""
    return ex.cache is not None and all(uses_device_plan(ex, layer, num_tokens) or uses_mapped(ex, layer, num_tokens)
                                        for layer in ex.moe_layers)


def graph_call(ex, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`GpuExperts.__call__` while a step is captured (or warmed up): the kernel only, no host bookkeeping."""
    T = topk_ids.shape[0]
    if uses_device_plan(ex, layer, T):
        return device_kernel(ex, layer, x, topk_ids, topk_weights)
    if uses_mapped(ex, layer, T):
        return ex.mapped.graph_call(layer, x, topk_ids, topk_weights)
    raise RuntimeError(f"MoE layer {layer} cannot run inside a CUDA graph in mode {ex.opts.mode}")


def before_replay(ex) -> None:
    if ex.mapped is not None:
        ex.mapped.before_replay()
    ex.cache.device_table(ex.device).sync()  # admits / publications since the last step, before the replay reads it


def after_replay(ex, num_tokens: int) -> None:
    """Right after the replay was queued, so this host work overlaps the GPU running it: counters; mode mapped
    queues the replay's routing read-back, then reads back what has arrived (the previous steps') and admits."""
    count_call(ex, num_tokens, calls=len(ex.moe_layers))
    if ex.mapped is not None:
        ex.mapped.after_replay(num_tokens)


# ---- the model's side --------------------------------------------------------------------------------------------
def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4 ... up to the first power of two >= max_batch."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


class _Captured:
    """The static inputs and outputs of the graph of batch size G.

    Inputs: one int64 device buffer [ids G | positions G | tables L*2*G], written by ONE non-blocking copy from a
    page-locked twin per step. Token ids already on the device (sampled there: `ft.runtime.engine`'s steps in
    flight) are copied over their slots on the device after it, so the host never waits for them. The graph embeds
    the ids itself (`Embedding`: a device table, or the GPU's gather from the page-locked host table)."""

    def __init__(self, model, size: int, scratch) -> None:
        dev, L = model.device, model.config.num_layers
        self.size = size
        pin = dev.type == "cuda"
        self.inputs = torch.zeros(decode_inputs_size(size, L, ids=True), dtype=torch.int64, device=dev)
        self.staging = torch.zeros(self.inputs.shape, dtype=torch.int64, pin_memory=pin)
        self.copied = torch.cuda.Event() if pin else None
        self.ids, self.pos, self.tables = decode_inputs(self.inputs, size, L, ids=True)
        self._ids, self._pos, self._tables = (t.numpy() for t in decode_inputs(self.staging, size, L, ids=True))
        self._scratch = scratch.addresses().numpy()
        self.batch = ForwardBatch([SegmentRows(i, 1, 0, scratch) for i in range(size)], self.pos, tables=self.tables)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # fp32 [G, V], the graph's output buffer

    def load(self, input_ids: torch.Tensor, states: list) -> None:
        """Write the step's inputs: ids of the B live rows (token 0 after them), positions, tables."""
        b = len(states)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the staging buffer
        ids, pos, tables = self._ids, self._pos, self._tables  # numpy views of the page-locked twin
        ids[:] = 0
        pos[:] = 0
        on_host = input_ids.device.type == "cpu"
        if on_host:
            ids[:b] = input_ids.numpy()
        for i, st in enumerate(states):
            pos[i] = st.length
            tables[:, :, i] = st.addresses().numpy()
        tables[:, :, b:] = self._scratch[:, :, None]
        self.inputs.copy_(self.staging, non_blocking=self.copied is not None)
        if self.copied is not None:
            self.copied.record()
        if not on_host:
            self.ids[:b].copy_(input_ids)


class DecodeGraphs:
    def __init__(self, model, experts, *, batch_sizes: tuple[int, ...] = (1,), capture: bool | None = None) -> None:
        self.model, self.ex = model, experts
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.batch_sizes = tuple(sorted(batch_sizes))
        self._graphs: dict[int, _Captured] = {}
        self._scratch = model.new_state(1)  # buffers of the padding rows
        self.failed: str | None = None  # why a capture failed; graphs stay off for this model after one
        self._ready: dict[tuple, bool] = {}  # `graph_ready` of calls that cannot change (no mapped banks)
        self.counters = {"replays": 0, "captures": 0, "capture_s": 0.0, "eager_steps": 0}

    def ready(self, size: int) -> bool:
        """`graph_ready(experts, size)`, remembered per (size, path switch, options) unless banks are mapped (they
        become ready one by one): a walk over every MoE layer costs tens of us of host time per step."""
        ex = self.ex
        if ex.mapped is not None:
            return graph_ready(ex, size)
        key = (size, ex.device_plan, ex.opts)
        if key not in self._ready:
            self._ready[key] = graph_ready(ex, size)
        return self._ready[key]

    def size_for(self, batch: int) -> int | None:
        return next((g for g in self.batch_sizes if g >= batch), None)

    def warm(self) -> None:
        """Capture every batch size now (at start), if the experts allow replays yet; later sizes are lazy."""
        for size in self.batch_sizes:
            if self.failed is None and graph_ready(self.ex, size) and size not in self._graphs:
                self._try_capture(size)

    def step(self, input_ids: torch.Tensor, states: list) -> torch.Tensor | None:
        """One decode token for each of `states` (input_ids [B], validated by the model) -> fp32 logits [B, V], or
        None when the step cannot be replayed (the caller runs it eagerly). Does not advance the states' lengths."""
        size = self.size_for(len(states))
        if size is None or self.failed is not None or not self.ready(size):
            self.counters["eager_steps"] += 1
            return None
        g = self._graphs.get(size) or self._try_capture(size)
        if g is None:
            self.counters["eager_steps"] += 1
            return None
        before_replay(self.ex)
        g.load(input_ids, states)
        if g.graph is not None:
            g.graph.replay()
        else:  # capture=False: the same decode batch, eagerly, over the live states' rows
            rows = [SegmentRows(i, 1, st.length, st) for i, st in enumerate(states)]
            rows += g.batch.segments[len(states):]
            g.logits = self._body(g.ids, ForwardBatch(rows, g.pos, tables=g.tables))
        after_replay(self.ex, len(states))  # the live rows' routing only (padding would bias admission)
        self.counters["replays"] += 1
        return g.logits[:len(states)].clone()  # the next replay overwrites the graph's buffer

    def _body(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ex, model = self.ex, self.model
        ex.graph_calls = True
        try:
            return model.logits_head(*model.layers_pending(model.embed_tokens(ids), batch))
        finally:
            ex.graph_calls = False

    def _try_capture(self, size: int) -> _Captured | None:
        try:
            return self._capture(size)
        except Exception as e:  # noqa: BLE001 - decode on eagerly rather than fail the request
            log.warning("CUDA graph capture failed, decoding eagerly from now on: %s: %s", type(e).__name__, e)
            self.failed = self.counters["capture_error"] = f"{type(e).__name__}: {e}"[:500]
            return None

    def _capture(self, size: int) -> _Captured | None:
        t0 = time.perf_counter()
        g = _Captured(self.model, size, self._scratch)
        g.load(torch.zeros(0, dtype=torch.int64), [])  # all rows padding: the warm-up touches only the scratch state
        if self.capture:
            before_replay(self.ex)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):  # compiles, first-call checks (sync)
                    self._body(g.ids, g.batch)
            finally:
                torch.cuda.current_stream().wait_stream(side)
                if self.ex.mapped is not None and self.ex.mapped.graph_layers:
                    self.ex.mapped.record_step(size)  # its staging rows are busy until this lands (prefill waits)
            if not graph_ready(self.ex, size):  # a first-call check turned a path off
                return None
            graph = torch.cuda.CUDAGraph()
            # thread_local: the uploader's staging thread may issue copies while this thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                g.logits = self._body(g.ids, g.batch)
            g.graph = graph
        self._graphs[size] = g
        self.counters["captures"] += 1
        self.counters["capture_s"] += time.perf_counter() - t0
        return g
