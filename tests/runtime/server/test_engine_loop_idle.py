"""The engine loop's idle work: while no request runs it persists the kept prefix states (--prefix-cache-dir), and a
failure there (a full disk) is logged without stopping the server."""

from __future__ import annotations

import logging
import threading

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
