"""The engine: a FIFO of requests, a shared KV budget, chunked prefill and continuous batching over one model.

Lifecycle of a request: `add_request` validates it against the KV budget and queues it (waiting); `step` admits
waiting requests in queue order while `max_running_requests` and the budget allow (strict FIFO, so a large request is
never starved by later small ones). Admission reserves only what the request needs now (`ft.runtime.kv`): its
prefill plus one token, rounded to a block, and, when others run, one block of headroom left free for their growth.
Running requests then advance together in ONE `model.forward`: every request past its prefill contributes one decode
token, and the oldest request still prefilling contributes one chunk of at most `max_prefill_length` tokens, so a
long prompt never stalls running streams. Sampled tokens become TokenEvents; an aborted request frees its state and
KV reservation at once, a finished one hands them to the prefix cache (`ft.runtime.prefix_cache`, unless
`prefix_cache_entries` is 0): a later request whose prompt starts with the same tokens takes the state at admission
and prefills only the rest (`num_cached_tokens` on its events). Kept states give way first whenever an admission or
a running request's growth needs their KV.

Admission, growth and preemption: `ft.runtime.engine_schedule`.

Invariants: `_running` is in admission order and `_running + _waiting` in arrival order, preempted requests included;
`kv.used == sum of the running reservations + what the prefix cache holds <= kv.total`; a running state's KV
capacity <= its reservation, so the KV memory held stays within the budget; waiting requests hold neither state nor
KV.
The engine is single-threaded: its owner applies add/abort between calls to `step`.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import logging
from typing import Any

import torch

from ft.formats import FtwReader
from ft.runtime.engine_load import load_for_engine
from ft.runtime.engine_inflight import DecodeInFlight, Inflight
from ft.runtime.engine_schedule import Scheduling
from ft.runtime.engine_stats import EngineCounters
from ft.runtime.generate import GenerationResult, generate
from ft.runtime.gpu.sizing import OFFLOADED_PREFILL_CHUNK, PREFILL_CHUNK
from ft.runtime.kv import ContextOverflowError, KvBudget, QueueFullError
from ft.runtime import prefix_store
from ft.runtime.prefix_cache import PrefixCache, prefix_host_bytes
from ft.runtime.request import Request, StopStringFilter, TokenEvent
from ft.runtime.sampling import RequestSampler, SampleOutput, SamplingParams, sample
from ft.runtime.settings import EngineSettings
from ft.runtime.tokenizer import Tokenizer

log = logging.getLogger("ft.engine")
CPU_KV_TOKENS = 8192  # the KV budget without a VRAM plan (and without --kv-reserve-tokens)

__all__ = ["Engine", "EngineSettings", "SamplingParams", "TokenEvent", "ContextOverflowError", "QueueFullError",
           "generate", "GenerationResult"]


class Engine(Scheduling, DecodeInFlight):
    """Serves one FTW with `settings` (`ft.runtime.settings.EngineSettings`: device, KV budget, batch and queue bounds,
    and on CUDA the VRAM budget, pinned memory, dense weights, CUDA graphs). `experts` replaces the default CPU experts;
    on CUDA the engine builds the GPU expert scheduler itself, sized from `settings.vram_budget` bytes (dense weights,
    KV, buffers and expert slots all count) or, when it is None, `memory_ratio` x the free VRAM at start; `offload`
    (an OffloadConfig, for tests and benchmarks) replaces the scheduler options the settings imply (but for
    dense_weights, which still apply), and also runs the scheduler on the CPU emulation path. Decode steps replay
    captured CUDA graphs (`ft.runtime.gpu.graphs`) unless `settings.cuda_graphs` is off. `max_output_tokens` clamps
    every request's max_tokens (a larger request is not refused); `kv_block_tokens` is the step in which KV
    reservations grow (see `ft.runtime.kv`)."""

    def __init__(self, ftw_dir: str | Path | FtwReader, settings: EngineSettings | None = None, *,
                 experts: Any = None, offload: Any = None) -> None:
        s = self.settings = settings or EngineSettings()
        t0 = time.perf_counter()
        reader = ftw_dir if isinstance(ftw_dir, FtwReader) else FtwReader(Path(ftw_dir))
        with ThreadPoolExecutor(1, thread_name_prefix="ft-tokenizer") as pool:
            tokenizer = pool.submit(Tokenizer.from_reader, reader)  # parsed while the weights load (I/O, copies)
            self.model, experts, self.kernels = load_for_engine(reader, s, experts=experts, offload=offload)
            t1 = time.perf_counter()
            self.tokenizer = tokenizer.result()
        self._experts = experts  # None = the model's CPU experts
        self.config = self.model.config
        # seconds of each start-up phase (stats()["startup"]; the server logs them): model and experts, the wait for
        # the tokenizer after them, then `warm_up`'s steps
        self.startup: dict = {"load_s": round(t1 - t0, 3), "tokenizer_s": round(time.perf_counter() - t1, 3)}
        self.generation_config: dict = dict(reader.generation)  # generation_config.json defaults
        self.model_name = Path(reader.path).name.removesuffix(".ftw")  # the directory the user named
        self._reader = reader  # its data files are mapped: `check_storage` before a forward reads them
        self._save_routing = s.save_routing  # written once, at close
        self.device = torch.device(s.device)
        self.eos_token_ids = frozenset(self.config.eos_token_ids) | frozenset(
            self.generation_config.get("eos_token_ids") or ())
        plan = self.vram_plan = getattr(experts, "vram_plan", None)  # on CUDA: the KV budget the VRAM plan gave
        self.placement = getattr(experts, "placement", None)  # the placement plan it started from (`ft plan`)
        kv_tokens = plan.kv_tokens if plan is not None and plan.kv_tokens else (s.kv_reserve_tokens or CPU_KV_TOKENS)
        self.kv = KvBudget(kv_tokens, self.config.max_position_embeddings, s.kv_block_tokens)
        self.prefix = PrefixCache(self.kv, s.prefix_cache_entries, host_bytes=prefix_host_bytes(s),
                                  new_state=self.model.new_state) if s.prefix_cache_entries else None
        self._prefix_dir = Path(s.prefix_cache_dir) if s.prefix_cache_dir and self.prefix is not None else None
        if self._prefix_dir is not None:  # a previous run's kept conversations
            self._prefix_key = prefix_store.model_key(Path(self._reader.path), self.model.dtype)
            n = prefix_store.load(self.prefix, self._prefix_dir, self._prefix_key, self.model.new_state)
            log.info("prefix cache: %d kept states loaded from %s", n, self._prefix_dir)
        self._persisted = None  # the prefix cache's version last written (`persist_prefixes`)
        offloaded = plan is not None and plan.num_slots < plan.max_slots
        self.max_prefill_length = s.max_prefill_length or getattr(self.placement, "prefill_chunk", None) or (
            OFFLOADED_PREFILL_CHUNK if offloaded else PREFILL_CHUNK)
        self.max_running_requests = s.max_running_requests
        self.max_output_tokens = s.max_output_tokens
        self.max_queued_requests = s.max_queued_requests
        self._waiting: deque[Request] = deque()  # preempted requests come back at the head
        self._running: list[Request] = []  # admission order
        self._aborted: list[Request] = []  # abort events still to emit
        self._inflight: Inflight | None = None  # the decode step whose tokens are on their way (`step`)
        self._ids: set[str] = set()  # waiting + running
        self._counters = EngineCounters()

    def close(self) -> None:
        """Stop the experts implementation's worker threads (GPU scheduler) and release pinned host memory; with
        --prefix-cache-dir, bring the kept states' files up to date first, with --save-routing write the expert
        cache's counts."""
        if getattr(self, "_prefix_dir", None) is not None:
            n = prefix_store.save(self.prefix, self._prefix_dir, self._prefix_key)
            log.info("prefix cache: %d kept states written to %s", n, self._prefix_dir)
            self._prefix_dir = None
        kernels = getattr(self, "kernels", None)
        if kernels is not None and kernels.counter is not None:
            log.info("kernels: %d compiled since start (prebuilt: %s)", kernels.counter.compiled, kernels.decision)
        if getattr(self, "_save_routing", None):
            from ft.runtime.plan.routing import save_engine_counts

            save_engine_counts(self._save_routing, self._reader, self._experts)
            self._save_routing = None
        if callable(getattr(self._experts, "close", None)):
            self._experts.close()

    def persist_prefixes(self) -> int:
        """With --prefix-cache-dir: bring the directory up to date with the kept states if they changed since the
        last call (`prefix_store.save`); the server calls this while idle, so a process killed mid-session loses at
        most what changed since it was last idle. Returns the number of states written."""
        if getattr(self, "_prefix_dir", None) is None:
            return 0
        c = self.prefix.counters
        version = (c["stored"], c["hits"], c["evicted"])  # every change to the entries bumps one of these
        if version == self._persisted:
            return 0
        n = prefix_store.save(self.prefix, self._prefix_dir, self._prefix_key)
        self._persisted = version
        return n

    def warm_up(self, tokens: int = 16) -> None:
        """One short greedy request through the whole serving path (scheduling, prefill, a decode step, sampling,
        detokenizing), then forgotten: kept by no prefix cache, counted by no counter but the expert cache's routing
        counts. The server runs it before it says ready, so the first real request finds every lazy start-up cost
        (allocator growth, library handles, a kernel not prebuilt) already paid. On a GPU at a VRAM budget it first
        waits for the expert banks' page-locking (`startup["pin_wait_s"]`): until then decode takes the host-planned
        path without CUDA graphs, and the request runs the steady state's path, capturing its graphs."""
        n = min(tokens, self.kv.max_context - 2)  # room for its two output tokens
        if n < 1:
            return
        wait_pinned = getattr(self._experts, "wait_pinned", None)
        if callable(wait_pinned):
            t = time.perf_counter()
            wait_pinned()
            self.startup["pin_wait_s"] = round(time.perf_counter() - t, 3)
        prefix, self.prefix = self.prefix, None
        try:
            ids = [(31 * i + 7) % self.config.vocab_size for i in range(n)]
            self.add_request("ft-warm-up", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            steps = self.startup["warm_up_steps_s"] = []  # the prefill, then the decode steps (graph capture)
            while self.has_unfinished():
                t = time.perf_counter()
                self.step()
                steps.append(round(time.perf_counter() - t, 3))
        finally:
            self.prefix = prefix
        self._counters = EngineCounters()
        if callable(getattr(self._experts, "reset_stats", None)):
            self._experts.reset_stats()

    def check_storage(self) -> None:
        """Raise OSError if a data file of the FTW was truncated, replaced or removed since the engine opened it:
        reading the mapped weights would then kill the process (SIGBUS), so the server stops using them instead."""
        why = self._reader.changed()
        if why is not None:
            raise OSError(f"{why}; the model can no longer be served from it: restart the server")

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) one request can have."""
        return self.kv.max_context

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    snapshot_at: int | None = None) -> None:
        """Queue a request. Raises ContextOverflowError, QueueFullError, or ValueError (bad ids, duplicate id).
        `snapshot_at`: a prompt position a later prompt is likely to share exactly (the server gives the start of the
        generation prompt's assistant header, where the next turn's re-rendered history may diverge); with the prefix
        cache on, a hybrid or deepseek_v4 model's prefill ends a chunk there, so its state is snapshotted there."""
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = [int(t) for t in prompt_ids]
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        self.kv.check_prompt(len(prompt_ids))
        if len(self._waiting) >= self.max_queued_requests:
            raise QueueFullError(f"the request queue is full ({self.max_queued_requests} waiting)")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        max_tokens = min(params.max_tokens, self.max_output_tokens)
        window = self.kv.max_context
        if params.max_tokens_required and len(prompt_ids) + max_tokens > window:
            raise ContextOverflowError(
                f"the prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {len(prompt_ids) + max_tokens} "
                f"tokens exceed the context window of {window} tokens; ask for max_tokens <= "
                f"{window - len(prompt_ids)} or a shorter prompt")
        req = Request(
            request_id=request_id, prompt_ids=prompt_ids, params=params, max_tokens=max_tokens,
            max_length=self.kv.max_length(len(prompt_ids), max_tokens), stop_token_ids=stop_ids,
            sampler=RequestSampler(params, prompt_ids, self.config.vocab_size, self.device),
            decoder=self.tokenizer.incremental_decoder(), stop_filter=StopStringFilter(params.stop),
            snapshot_at=snapshot_at if snapshot_at is not None and 0 < snapshot_at < len(prompt_ids) else None,
        )
        self._waiting.append(req)
        self._ids.add(request_id)
        self._counters.add("requests_total")
        self._counters.add("prompt_tokens_total", len(prompt_ids))

    def abort(self, request_id: str) -> None:
        """Drop a waiting (maybe preempted) or running request, free its KV now; its final event comes next step.
        Unknown or already finished ids are ignored (the caller may race with completion)."""
        req = next((r for r in self._running if r.request_id == request_id), None)
        if req is not None:
            self._running.remove(req)
        else:
            req = next((r for r in self._waiting if r.request_id == request_id), None)
            if req is None:
                return
            self._waiting.remove(req)
        req.finish_reason = "abort"
        self._release(req)
        self._ids.discard(request_id)
        self._aborted.append(req)
        self._counters.add("requests_aborted")

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One iteration: abort events, admission, KV growth (may preempt), one forward: decodes + a prefill chunk.

        A step of decodes only is left in flight: its tokens are sampled on the device and come to the host during
        the next call, which first launches the following decode step from those device tokens (`_continue`) when
        nothing else has to happen first. So the GPU runs step n + 1 while the host turns step n's tokens into events,
        and their events come one call later (a request that stops at step n has computed one token too many)."""
        t0 = time.perf_counter()
        events = [r.abort_event() for r in self._aborted]
        self._aborted.clear()
        landing, self._inflight = self._inflight, None
        if landing is not None:
            self._continue(landing)  # may put the next decode step in flight
            events += self._land(landing, t0)
            if self._inflight is not None:
                return events
            t0 = time.perf_counter()  # the landing's time is accounted: what follows is this step's own
        self._admit()
        decodes, prefill = self._schedule(events)
        if not decodes and prefill is None:
            return events

        input_ids, segments = self._prepare_inputs(decodes, prefill)
        if prefill is None:
            self._launch(decodes, torch.tensor(input_ids, dtype=torch.long), segments, since=t0)
            return events
        # host ids: the forward validates them on the host and copies them without waiting for the GPU
        logits = self.model.forward(torch.tensor(input_ids, dtype=torch.long), segments)
        # Requests that sample this step: every decode, and the prefill request once its prompt is done.
        sampling = [(r, lg) for r, lg in zip(decodes, logits)]
        prefill.num_prefilled += segments[-1].num_tokens
        if self.prefix is not None and prefill.state.rewinds_from_snapshots:  # a later prompt may share this much
            prefill.snapshots[prefill.state.length] = prefill.state.snapshot()  # exactly: each chunk's end
        if not prefill.is_prefilling:
            sampling.append((prefill, logits[-1]))
        if sampling:
            out = sample(torch.cat([lg[-1:] for _, lg in sampling]), [r.sampler for r, _ in sampling])
            events += self._accept([r for r, _ in sampling], out)
        self._counters.step(time.perf_counter() - t0, [r for r, _ in sampling], len(decodes),
                             segments[-1].num_tokens)
        return events

    def _accept(self, requests: list[Request], out: SampleOutput) -> list[TokenEvent]:
        events = []
        for j, req in enumerate(requests):
            events.append(req.accept(out.token_ids[j], out.logprobs[j], out.top_logprobs[j]))
            if req.finish_reason is not None:
                self._finish(req)
        return events

    # ---- observability --------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since start (`EngineCounters`), the queue and the KV budget. "moe" holds the experts
        implementation's own counters when it has any, "cuda_graphs" the decode graphs', "kernels" (CUDA) the
        prebuilt kernels' decision and the kernels compiled since start (`ft.runtime.gpu.prebuilt`), "startup" the
        seconds of the start-up phases."""
        cached = self.prefix.held() if self.prefix is not None else 0  # kept prefixes: theirs, not the requests'
        out = self._counters.snapshot() | {"running": len(self._running), "waiting": len(self._waiting),
                                           "kv_tokens_used": self.kv.used - cached, "kv_tokens_cached": cached,
                                           "kv_tokens_total": self.kv.total}
        if callable(getattr(self._experts, "stats", None)):  # e.g. the GPU expert cache's hit/miss counters
            out["moe"] = self._experts.stats()
        if self.model.graphs is not None:  # CUDA-graph decode: replays, captures and their seconds, eager steps
            out["cuda_graphs"] = dict(self.model.graphs.counters)
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.stats()
        if self.kernels is not None:  # prebuilt kernels used or why not, and the kernels compiled since start
            out["kernels"] = self.kernels.stats()
        if self.placement is not None:
            out["plan"] = self.placement.stats()
        out["startup"] = dict(self.startup)
        return out
