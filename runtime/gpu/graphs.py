"""CUDA-graph decode: a sequence's one-token steps replay one captured forward.

Eager decode at batch 1 is bound by the host, not the GPU: every layer issues dozens of small kernels from Python (the
profile of run I: 9.7 ms of host time per token for 4 layers, DeltaNet 5.8 of it, while the GPU is mostly idle). A
replay issues the whole step at once.

What is captured: `CausalLM.layers_forward` on a static batch (`ForwardBatch.static`: the token's position is read
from a device buffer, attention covers the whole KV buffer under a mask) and `logits_head`, for one token of one
`SequenceState`. Outside the graph, per step:
  * the embedding gather (`embed_tokens`: its table may stay in host memory), copied into the static input `h`;
  * the position, written into the static input `pos`;
  * the experts' host bookkeeping: `before_replay` (the device slot table is uploaded if admits changed it) and
    `after_replay`, which runs while the GPU replays (call counters; mode mapped queues this replay's routing
    read-back, then reads back the previous steps' and admits experts, which the step after next can hit).
The graph reads the state's buffers at their capture-time addresses (KV [capacity, nkv, hd]; DeltaNet conv and
recurrent states, updated in place). So a graph belongs to one state at one capacity: another state, or one whose KV
buffers grew (`ensure_capacity` reallocates), is captured anew (`MAX_GRAPHS` are kept, the oldest is dropped).
Rows of the KV buffers past the state's length are zeroed at capture: the mask gives them weight 0, and
0 * (garbage that happens to be NaN) would still be NaN.

A step is not replayed (`step` returns None and the model runs eagerly) unless every MoE layer's one-token call is
sync-free (`graph_ready`): mode resident, static's GPU layers, mode mapped once its banks are pinned and verified.
Hybrid / offload / cpu bring the routing to the host mid-step, which a graph cannot do.

Capture: the body runs once eagerly on a side stream (it compiles kernels and makes the paths' first-call checks,
which sync) with the state's DeltaNet buffers saved and restored around it, then once under capture.
`capture=False` runs the same static body eagerly instead of replaying (CPU tests of everything but the capture).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from ft.runtime.layers.batch import ForwardBatch, SegmentRows

from .device_path import count_call, device_kernel, uses_device_plan
from .mapped_path import uses_mapped

log = logging.getLogger("ft.gpu")

MAX_GRAPHS = 2  # captured states kept (a server mostly decodes one sequence; a second covers a switch)


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
    for _ in ex.moe_layers:
        count_call(ex, num_tokens)
    if ex.mapped is not None:
        ex.mapped.after_replay(num_tokens)


# ---- the model's side --------------------------------------------------------------------------------------------
class _Captured:
    """One state's static inputs, batch and (CUDA) graph."""

    def __init__(self, model, state) -> None:
        dev = model.device
        self.state = state
        self.buffers = _buffers(state)
        self.h = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=dev)   # the token's embedding
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)                           # its position
        self.batch = ForwardBatch([SegmentRows(0, 1, -1, state)], self.pos, static=True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None   # fp32 [1, V], the graph's output buffer

    def valid(self, state) -> bool:
        return state is self.state and not state.freed and _buffers(state) == self.buffers


def _buffers(state) -> tuple:
    """Addresses of every state buffer a captured graph reads (KV, conv, recurrent)."""
    tensors = [t for pair in state.kv.values() for t in pair] + [*state.conv.values(), *state.recurrent.values()]
    return tuple(t.data_ptr() for t in tensors)


class DecodeGraphs:
    def __init__(self, model, experts, *, capture: bool | None = None) -> None:
        self.model, self.ex = model, experts
        self.capture = model.device.type == "cuda" if capture is None else capture
        self._graphs: OrderedDict[int, _Captured] = OrderedDict()
        self._ready = False
        self.failed: str | None = None  # why a capture failed; graphs stay off for this model after one
        self.counters = {"replays": 0, "captures": 0, "capture_s": 0.0, "eager_steps": 0}

    def step(self, input_ids: torch.Tensor, state) -> torch.Tensor | None:
        """One decode token of `state` (input_ids [1], validated by the model) -> fp32 logits [1, V], or None when the
        step cannot be replayed (the caller runs it eagerly). Does not advance `state.length` (the model does)."""
        if not self._ready:
            # once true it stays so (pinning done; the paths' first-call checks ran at capture)
            self._ready = self.failed is None and graph_ready(self.ex, 1)
            if not self._ready:
                self.counters["eager_steps"] += 1
                return None
        h = self.model.embed_tokens(input_ids)
        g = self._graphs.get(id(state))
        if g is None or not g.valid(state):
            try:
                g = self._capture(state, h)
            except Exception as e:  # noqa: BLE001 - decode on eagerly rather than fail the request
                log.warning("CUDA graph capture failed, decoding eagerly from now on: %s: %s", type(e).__name__, e)
                self.failed = self.counters["capture_error"] = f"{type(e).__name__}: {e}"[:500]
                g = None
            if g is None:
                self._ready = False
                self.counters["eager_steps"] += 1
                return None
        before_replay(self.ex)
        g.h.copy_(h)
        g.pos.fill_(state.length)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.logits = self._body(g)
        after_replay(self.ex, 1)
        self.counters["replays"] += 1
        return g.logits.clone()  # the next replay overwrites the graph's buffer

    def _body(self, g: _Captured) -> torch.Tensor:
        ex = self.ex
        ex.graph_calls = True
        try:
            return self.model.logits_head(self.model.layers_forward(g.h, g.batch))
        finally:
            ex.graph_calls = False

    def _capture(self, state, h: torch.Tensor) -> _Captured | None:
        self._graphs.pop(id(state), None)
        while len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)
        t0 = time.perf_counter()
        for k, v in state.kv.values():  # see the module docstring: masked rows must hold finite values
            k[state.length:].zero_()
            v[state.length:].zero_()
        g = _Captured(self.model, state)
        if self.capture:
            before_replay(self.ex)
            g.h.copy_(h)
            g.pos.fill_(state.length)
            live = [*state.conv.values(), *state.recurrent.values()]
            saved = [t.clone() for t in live]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):  # compiles, first-call checks (sync); the state is restored below
                    self._body(g)
            finally:
                torch.cuda.current_stream().wait_stream(side)
                for t, s in zip(live, saved):
                    t.copy_(s)
                if self.ex.mapped is not None and self.ex.mapped.graph_layers:
                    self.ex.mapped.record_step(1)  # its fills are real: the host must mirror them
            if not graph_ready(self.ex, 1):  # a first-call check turned a path off
                return None
            graph = torch.cuda.CUDAGraph()
            # thread_local: the uploader's staging thread may issue copies while this thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                g.logits = self._body(g)
            g.graph = graph
        self._graphs[id(state)] = g
        self.counters["captures"] += 1
        self.counters["capture_s"] += time.perf_counter() - t0
        return g
