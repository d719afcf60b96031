"""The engine loop's idle work: while no request runs it persists the kept prefix states (--prefix-cache-dir), and a
failure there (a full disk) is logged without stopping the server; other background work waits for it to be idle."""

from __future__ import annotations

import logging
import threading
import time

from ft.runtime.server.loop import EngineLoop


class _IdleEngine:
    """An engine with nothing to do whose persistence is counted (and fails when told to)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail
        self.called = threading.Event()

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> dict:
        return {}

    def persist_prefixes(self) -> int:
        self.calls += 1
        self.called.set()
        if self.fail:
            raise OSError(28, "No space left on device")
        return 0


def test_the_idle_loop_persists_kept_states():
    engine = _IdleEngine()
    loop = EngineLoop(lambda: engine)
    loop.start()
    try:
        assert engine.called.wait(5)
    finally:
        loop.stop()
    assert engine.calls >= 1 and loop.status == "ok"


def test_a_failing_write_is_logged_and_serving_goes_on(caplog):
    engine = _IdleEngine(fail=True)
    loop = EngineLoop(lambda: engine)
    with caplog.at_level(logging.WARNING):
        loop.start()
        try:
            assert engine.called.wait(5)
            engine.called.clear()
            assert engine.called.wait(5)  # tried again at a later idle moment: the loop is alive
        finally:
            loop.stop()
    assert loop.status == "ok" and loop.error is None
    assert caplog.text.count("could not write the kept states (OSError") == 1  # once, not at every idle tick


class _BusyEngine(_IdleEngine):
    """Has work until `done` is set; each step takes 10 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()
        self.steps = 0

    def has_unfinished(self) -> bool:
        return not self.done.is_set()

    def step(self) -> list:
        self.steps += 1
        time.sleep(0.01)
        return []


def test_wait_idle_blocks_while_the_engine_runs_and_until_it_has_been_quiet():
    """Background work (the start-up file list) waits for the engine: not while it steps, and only once it has had
    nothing to run for the quiet time; a stopping loop releases the waiter with False."""
    engine = _BusyEngine()
    loop = EngineLoop(lambda: engine)
    loop.start()
    try:
        got: list = []
        waiter = threading.Thread(target=lambda: got.append((loop.wait_idle(0.2), time.monotonic())))
        waiter.start()
        time.sleep(0.3)
        assert not got and engine.steps > 0  # busy: still waiting
        finished = time.monotonic()
        engine.done.set()
        waiter.join(5)
        assert got and got[0][0] is True and got[0][1] - finished >= 0.2
        late: list = []  # a waiter for a longer quiet time is released by the loop's stop
        waiter = threading.Thread(target=lambda: late.append(loop.wait_idle(60)))
        waiter.start()
        time.sleep(0.1)
        assert not late
    finally:
        loop.stop()
    waiter.join(5)
    assert late == [False]
