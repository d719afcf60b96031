"""The engine loop: one thread owns the (single-threaded) engine; asyncio handlers talk to it through commands.

Thread layout:
  event loop (uvicorn)  --submit/abort commands-->  engine thread: load, then forever
                                                       apply queued commands (add_request / abort)
                                                       engine.step()   (one prefill chunk + one batched decode)
                        <--TokenEvent batches------    loop.call_soon_threadsafe(queue.put_nowait, events)
The engine is loaded on this thread too (after the socket is bound), so /health can answer "loading" meanwhile.
An add is acknowledged through a concurrent Future, so a request the engine refuses (context overflow, full queue)
gets its HTTP error before any response byte is sent. Invariant: a request id has a sink from its accepted add until
its final event or its abort; events for ids without a sink (aborted by the client) are dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ft.server")


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineFailure(RuntimeError):
    """engine.step() raised: every running request ends with this error."""


class EngineLoop:
    def __init__(self, load: Callable[[], Any], *, on_events: Callable[[list], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self._load = load
        self._on_events = on_events
        self._on_fatal = on_fatal  # called (on the engine thread) with the reason once the engine cannot serve
        self.engine: Any = None
        self.status = "loading"  # loading -> ok | error
        self.error: str | None = None
        self.failing: str | None = None  # the last engine step failed with this (cleared by one that works)
        self.loaded_at: float | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ft-engine-loop", daemon=True)
        self.engine_stats: dict = {}  # snapshot of engine.stats(), refreshed by the loop thread
        self._persist_error: str | None = None  # the last failure of the idle prefix-state write (logged once)
        self._idle_since: float | None = None  # monotonic time since which the engine has had nothing to run

    # ---- called from the event loop -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def submit(self, request_id: str, prompt_ids: list[int], params: Any,
                     snapshot_at: int | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Engine refusals raise here unchanged."""
        if self._stopping.is_set() or not self._thread.is_alive():
            raise RuntimeError(self.error or "the server is shutting down")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", request_id, prompt_ids, params, snapshot_at, _Sink(loop, events), accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still be applied: commands run in order, so abort follows it
            raise
        return RequestStream(self, request_id, events)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def wait_idle(self, quiet_s: float) -> bool:
        """Block until the engine has had nothing to run for `quiet_s` seconds (True), or the loop stops (False):
        background work that would slow requests (`startup_files.record`) waits here between its pieces."""
        while not self._stopping.is_set() and self._thread.is_alive():
            since = self._idle_since
            if since is not None and time.monotonic() - since >= quiet_s:
                return True
            self._stopping.wait(min(0.05, quiet_s))
        return False

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------------------------

    def _fatal(self) -> None:
        if self._on_fatal is not None:
            self._on_fatal(self.error or "the engine stopped")

    def _main(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as e:  # noqa: BLE001 - reported through /health and on_fatal (ft serve exits)
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            log.exception("loading the engine failed")
            self._refuse_pending()
            self._fatal()
            return
        self.loaded_at = time.time()
        self.status = "ok"
        self._snapshot()
        try:
            while not self._stopping.is_set():
                self._wake.clear()  # cleared before draining: a command sent after the drain wakes the wait below
                if self._apply_commands():
                    self._snapshot()
                if self.engine.has_unfinished():
                    self._idle_since = None
                    self._step()
                    self._snapshot()
                else:
                    if self._idle_since is None:
                        self._idle_since = time.monotonic()
                    self._persist()
                    self._wake.wait(0.5)
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: say so on /health, fail requests
            self.status, self.error = "error", f"the engine loop stopped: {type(e).__name__}: {e}"
            log.exception("engine loop crashed")
            self._fatal()
        finally:
            self._refuse_pending()
            if callable(getattr(self.engine, "close", None)):  # GPU scheduler threads, page-locked banks
                self.engine.close()

    def _persist(self) -> None:
        """While idle: the kept prefix states to disk (--prefix-cache-dir), if they changed. A failure (a full disk)
        is logged, never fatal: serving goes on and the next idle moment tries again."""
        persist = getattr(self.engine, "persist_prefixes", None)
        if callable(persist):
            try:
                persist()
                self._persist_error = None
            except Exception as e:  # noqa: BLE001 - e.g. a full disk: the states stay in memory
                why = f"{type(e).__name__}: {e}"
                if why != self._persist_error:  # once per distinct failure, not at every idle tick
                    log.warning("prefix cache: could not write the kept states (%s)", why)
                self._persist_error = why

    def _apply_commands(self) -> bool:
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if command[0] == "add":
                _, request_id, prompt_ids, params, snapshot_at, sink, accepted = command
                try:
                    self.engine.add_request(request_id, prompt_ids, params, snapshot_at=snapshot_at)
                except Exception as e:  # noqa: BLE001 - handed to the waiting handler
                    accepted.set_exception(e)
                else:
                    self._sinks[request_id] = sink
                    accepted.set_result(None)
            else:
                _, request_id = command
                self._sinks.pop(request_id, None)
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - the request is dropped from the server side either way
                    log.exception("engine.abort(%s) failed", request_id)

    def _step(self) -> None:
        try:
            check = getattr(self.engine, "check_storage", None)
            if check is not None:  # one stat per data file: a truncated mapping must not be read (SIGBUS)
                check()
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests, keep the server up
            log.exception("engine.step() failed")
            failure = EngineFailure(f"the engine failed: {type(e).__name__}: {e}")
            self.failing = str(failure)
            for request_id, sink in list(self._sinks.items()):
                self._deliver(sink, failure)
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001
                    log.exception("abort after failure")
            self._sinks.clear()
            return
        if any(ev.token_id is not None for ev in events):  # the model produced tokens again (abort events don't)
            self.failing = None
        batches: dict[str, list] = {}
        for ev in events:
            if ev.request_id in self._sinks:
                batches.setdefault(ev.request_id, []).append(ev)
        for request_id, batch in batches.items():
            sink = self._sinks[request_id] if batch[-1].finish_reason is None else self._sinks.pop(request_id)
            self._deliver(sink, batch)
        if self._on_events is not None and events:
            self._on_events(events)

    @staticmethod
    def _deliver(sink: _Sink, item: Any) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def _snapshot(self) -> None:
        """engine.stats() is a few counters (microseconds next to a forward), so it is taken after every change."""
        self.engine_stats = self.engine.stats()

    def _refuse_pending(self) -> None:
        """Fail adds that will never be applied (load error or shutdown)."""
        reason = RuntimeError(self.error or "the server is shutting down")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add" and not command[5].done():
                command[5].set_exception(reason)
        for sink in self._sinks.values():
            self._deliver(sink, EngineFailure(str(reason)))
        self._sinks.clear()


class RequestStream:
    """The handler's end of one request: batches of TokenEvents in order, then nothing."""

    def __init__(self, owner: EngineLoop, request_id: str, events: asyncio.Queue) -> None:
        self.owner = owner
        self.request_id = request_id
        self._events = events
        self.finished = False
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None

    async def next_batch(self, timeout: float | None = None) -> list | None:
        """The next batch of events; None on timeout (the caller may send a keep-alive). Raises EngineFailure."""
        if self.finished:
            raise RuntimeError("the request already finished")
        try:
            item = await asyncio.wait_for(self._events.get(), timeout) if timeout else await self._events.get()
        except asyncio.TimeoutError:
            return None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if self.first_token_at is None and any(ev.token_id is not None for ev in item):
            self.first_token_at = time.perf_counter()
        if item[-1].finish_reason is not None:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it finished (client gone, handler error); frees its KV at once."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at
