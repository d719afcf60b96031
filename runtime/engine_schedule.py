"""The engine's scheduling (`ft.runtime.engine.Engine` inherits it): which waiting requests run, how much each step
does, and what gives way when the KV budget is short.

Admission (`_admit`): waiting requests in queue order while `max_running_requests` and the budget allow (strict FIFO,
so a large request is never starved by later small ones), each taking a kept state whose tokens start its prompt
(`ft.runtime.prefix_cache`) and reserving only what it needs now: its prefill plus one token, rounded to a block, and,
when others run, one block of headroom left free for their growth. Kept states give way first.

Growth and preemption (recompute, as vLLM): before the forward, each scheduled request, oldest first, makes its
reservation and KV buffers cover the tokens it adds. When the budget cannot, the most recently admitted running
request is preempted: its state and reservation are freed and it goes back to the HEAD of the waiting queue.
Re-admitted, it prefills its prompt + the output it already has, then samples its next token; nothing already sent is
emitted again and its sampler state is untouched. The oldest running request is never preempted, so it always
advances. One alone that still cannot grow ends with "length" (unreachable while the engine owns the whole budget).

The methods use the engine's `_running`, `_waiting`, `kv`, `prefix`, `model`, `max_prefill_length`,
`max_running_requests` and `_counters`; `_finish` / `_release` are where a request's state and reservation end.
"""

from __future__ import annotations

from ft.runtime.model import Segment
from ft.runtime.request import Request, TokenEvent


class Scheduling:
    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running_requests:
            req = self._waiting[0]
            size = self.kv.rounded(req.prefill_length + 1, req.max_length)  # prefill + the first decode
            # A block of headroom for the running requests' growth: a request just preempted is not re-admitted (and
            # recomputed) straight away. Kept prefixes give way first.
            headroom = self.kv.block if self._running else 0
            hit = None
            if self.prefix is not None:  # a copy of a kept prefix is allocated now: only with room for it
                hit = self.prefix.take(req.prefill_ids, capacity=size, share=self.kv.free >= size + headroom)
            while not self.kv.try_reserve(req.request_id, size, headroom=headroom):
                if self.prefix is None or not self.prefix.evict():
                    if hit is not None and hit.state is not None:
                        hit.state.free()
                    return  # strict FIFO: later requests wait behind the head
            self._waiting.popleft()
            if hit is not None and hit.state is None:  # kept in host memory: copied to the device, in its reservation
                hit.state = self.prefix.restore(hit, size)
            if hit is None:
                req.state = self.model.new_state(req.max_length, capacity=size)
            else:
                req.state, req.num_prefilled = hit.state, hit.length
                req.snapshots.update(hit.snapshots)  # the conversation's earlier chunk ends stay reusable
                req.prefix_source = hit.source
                req.state.max_tokens = max(req.state.max_tokens, req.max_length)
                if req.state.capacity > size:  # KV buffers within the reservation (and max_length)
                    req.state.resize(size)
                if not req.output_ids:  # what usage reports: the first admission's reuse (not a recompute's)
                    req.num_cached = hit.length
            self._running.append(req)

    def _schedule(self, events: list[TokenEvent]) -> tuple[list[Request], Request | None]:
        """This step's work (every decode, one chunk of the oldest prefilling request), each with its KV grown to
        cover it, oldest first; may preempt (module docstring) or end a request (its event goes to `events`)."""
        prefill = next((r for r in self._running if r.is_prefilling), None)
        for req in list(self._running):
            if req.state is None:  # preempted by an older request's growth in this loop
                continue
            if req is prefill:
                self._secure(req, self._chunk_length(req), events)
            elif not req.is_prefilling:
                self._secure(req, 1, events)
        decodes = [r for r in self._running if not r.is_prefilling]
        return decodes, (prefill if prefill is not None and prefill.state is not None else None)

    def _secure(self, req: Request, num_tokens: int, events: list[TokenEvent]) -> None:
        """Make `req`'s reservation and KV buffers hold `num_tokens` more tokens, preempting the most recently
        admitted running requests (`req` itself last) until they do."""
        need = req.state.length + num_tokens
        while not self.kv.try_grow(req.request_id, need, req.max_length):
            if self.prefix is not None and self.prefix.evict():  # kept prefixes give way to running requests
                continue
            victim = self._running[-1]
            if victim is req and len(self._running) == 1:
                events.append(req.finish_event("length"))  # alone and still too long: capped by the budget
                self._finish(req)
                return
            self._preempt(victim)
            if victim is req:
                return
        req.state.ensure_capacity(need, at_most=self.kv.reserved(req.request_id))

    def _preempt(self, req: Request) -> None:
        assert self._running[-1] is req
        self._release(self._running.pop())
        req.preempt()
        self._waiting.appendleft(req)
        self._counters.add("preemptions")

    def _chunk_length(self, req: Request) -> int:
        """Tokens of `req`'s next prefill chunk: up to max_prefill_length, ending at its snapshot position if the
        chunk would cross it (models whose states rewind from snapshots, with the prefix cache on: the snapshot is
        taken at each chunk end)."""
        n = min(self.max_prefill_length, req.prefill_length - req.num_prefilled)
        at = req.snapshot_at
        if at is not None and self.prefix is not None and req.state.rewinds_from_snapshots and req.num_prefilled < at:
            n = min(n, at - req.num_prefilled)
        return n

    def _prepare_inputs(self, decodes: list[Request], prefill: Request | None) -> tuple[list[int], list]:
        """Concatenated input ids and one Segment per request: decodes first, then the prefill chunk."""
        input_ids: list[int] = []
        segments = []
        for req in decodes:
            input_ids.append(req.output_ids[-1])
            segments.append(Segment(req.state, 1, logits="last"))
        if prefill is not None:
            chunk = prefill.next_prefill_chunk(self._chunk_length(prefill))
            input_ids.extend(chunk)
            segments.append(Segment(prefill.state, len(chunk), logits="last"))
        return input_ids, segments

    def _finish(self, req: Request) -> None:
        self._running.remove(req)
        if self.prefix is not None and req.state is not None:  # kept for a later prompt that starts the same way
            state, req.state = req.state, None
            self.kv.release(req.request_id)
            self.prefix.put((req.prompt_ids + req.output_ids)[:state.length], state, req.snapshots,
                            replaces=req.prefix_source)
        self._release(req)
        self._ids.discard(req.request_id)
        self._counters.add("requests_finished")

    def _release(self, req: Request) -> None:
        """Free the state and the KV reservation (the request id stays in use)."""
        if req.state is not None:
            req.state.free()
            req.state = None
        self.kv.release(req.request_id)
