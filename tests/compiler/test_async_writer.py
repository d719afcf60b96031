"""The compile's background writer: items written in submission order; an oversized item (an embedding or LM head)
is written while the caller goes on, and a second one waits until the first is written."""

from __future__ import annotations

import threading

import pytest
import torch

from ft.compiler.async_writer import AsyncWriter


class _Writer:
    """Records add_tensor calls; writing `slow` blocks until `gate` is set."""

    def __init__(self, slow: str) -> None:
        self.slow, self.gate, self.written = slow, threading.Event(), []

    def add_tensor(self, name: str, t: torch.Tensor) -> None:
        if name == self.slow:
            assert self.gate.wait(10)
        self.written.append(name)


def _t(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


def test_an_oversized_write_does_not_stop_the_caller_but_a_second_one_waits():
    w = _Writer("embed")
    aw = AsyncWriter(w, max_pending=1024)
    aw.add_tensor("embed", _t(4096))  # over max_pending: queued, the call returns while it is written
    aw.add_tensor("small", _t(512))  # fits max_pending beside it
    assert w.written == []
    second = threading.Thread(target=aw.add_tensor, args=("head", _t(4096)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # the second oversized item waits for the first to be written
    w.gate.set()
    second.join(10)
    aw.drain()
    assert w.written == ["embed", "small", "head"]


def test_a_write_error_surfaces_on_the_next_call():
    class Failing:
        def add_tensor(self, name, t):
            raise OSError(28, "No space left on device")

    aw = AsyncWriter(Failing(), max_pending=1024)
    aw.add_tensor("embed", _t(4096))
    with pytest.raises(OSError, match="No space left"):
        aw.drain()
