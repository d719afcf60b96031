"""The engine's decode steps in flight (`ft.runtime.engine.Engine` inherits them): a step of decodes only is launched,
its tokens sampled on the device (`sample_async`), and the host reads them back during the next `step` call, after it
has launched the following decode step from those device tokens when nothing else has to happen first. So the GPU
runs step n + 1 while the host turns step n's tokens into events.

The methods use the engine's `_running`, `_waiting`, `kv`, `model`, `max_running_requests`, `_inflight` and
`_counters`; `_accept` turns sampled tokens into events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ft.runtime.model import Segment
from ft.runtime.request import Request, TokenEvent
from ft.runtime.sampling import PendingSample, SampleOutput, _to_device, sample_async


@dataclass
class Inflight:
    """A decode step whose tokens are still on the device: its requests (rows, in order), their pending sample, and
    the host seconds spent on it not yet accounted."""
    requests: list[Request]
    pending: PendingSample
    seconds: float


class DecodeInFlight:
    def _launch(self, decodes: list[Request], input_ids: torch.Tensor, segments: list[Segment], *,
                since: float | None = None) -> None:
        """Forward one decode token per request and queue their sampling: the step is in flight (`Inflight`).
        `since`: this call is the only one to account the launch's time from then (a continuation's time is the
        landing call's)."""
        logits = self.model.forward(input_ids, segments)
        pending = sample_async(torch.cat(logits), [r.sampler for r in decodes])
        self._inflight = Inflight(decodes, pending, 0.0 if since is None else time.perf_counter() - since)

    def _continue(self, landing: Inflight) -> None:
        """Launch the next decode step while `landing` is still in flight, from its device tokens, if that step is
        what the synchronous path would run: no request waits to be admitted or is prefilling, and every running
        request that will not finish by `landing`'s token has the KV to grow by one without preempting anyone."""
        if any(r.is_prefilling for r in self._running) or (
                self._waiting and len(self._running) < self.max_running_requests):
            return
        rows = {id(r): j for j, r in enumerate(landing.requests)}
        decodes = [r for r in self._running if r.num_output_tokens + 1 < r.max_output_tokens]
        if not decodes or any(id(r) not in rows for r in decodes):
            return
        for req in decodes:
            need = req.state.length + 1
            if not self.kv.try_grow(req.request_id, need, req.max_length):
                return  # the synchronous path preempts or ends requests
            req.state.ensure_capacity(need, at_most=self.kv.reserved(req.request_id))
        ids = landing.pending.token_ids
        if len(decodes) < len(landing.requests):
            ids = ids.index_select(0, _to_device([rows[id(r)] for r in decodes], torch.long, ids.device))
        self._launch(decodes, ids, [Segment(r.state, 1, logits="last") for r in decodes])

    def _land(self, landing: Inflight, t0: float) -> list[TokenEvent]:
        """The tokens of a step in flight, as events of the requests still running (a request aborted or finished
        since has no more tokens)."""
        live = [(j, r) for j, r in enumerate(landing.requests) if r.finish_reason is None]
        out = landing.pending.result()
        self._counters.step(landing.seconds + time.perf_counter() - t0, [r for _, r in live], len(live), 0)
        return self._accept([r for _, r in live], SampleOutput(*([col[j] for j, _ in live] for col in out)))
