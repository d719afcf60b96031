"""Live servers for the API tests: real uvicorn on 127.0.0.1 (a free port) in a background thread, serving tiny
synthetic FTWs (truncated real Qwen tokenizers, the real chat templates).

  server        qwen3_moe tiny (Hermes JSON tools, the model opens <think> itself); generous limits.
  tight_server  same model, --api-key secret, 1 running + 1 queued request, small KV budget and output cap.
  think_server  qwen3_5_moe tiny (XML tools; the prompt opens <think>, so output starts inside reasoning).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from ft.runtime.server.app import create_app
from ft.runtime.server.state import ServeSettings
from ft.runtime.settings import EngineSettings


class LiveServer:
    def __init__(self, settings: ServeSettings, load: Callable[[], Any] | None = None) -> None:
        self.app = create_app(settings, load)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def start(self, wait_loaded: bool = True) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        if wait_loaded:
            while httpx.get(self.url + "/health").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the engine did not load")
                time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app.state.server

    @property
    def tokenizer(self):
        return self.state.loop.engine.tokenizer

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Poll /v1/stats until no request is running or waiting and the KV budget is free again."""
        deadline = time.monotonic() + timeout
        while True:
            stats = httpx.get(self.url + "/v1/stats", headers=self.headers).json()
            sched, kv = stats["scheduler"], stats["kv"]
            if sched["running"] == 0 and sched["waiting"] == 0 and kv["used_tokens"] == 0 \
                    and stats["requests"]["active"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {stats}")
            time.sleep(0.05)

    @property
    def headers(self) -> dict:
        key = self.state.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def _live(ftw: Path, served_model_name: str, api_key: str | None = None, **engine: Any):
    settings = ServeSettings(ftw=ftw, engine=EngineSettings(**engine), port=0, keepalive_s=2.0,
                             served_model_name=served_model_name, api_key=api_key)
    live = LiveServer(settings).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def make_server():
    """`make_server(settings, load=None, wait_loaded=True) -> LiveServer`, stopped after the test."""
    started: list[LiveServer] = []

    def make(settings: ServeSettings, load: Callable[[], Any] | None = None, wait_loaded: bool = True) -> LiveServer:
        live = LiveServer(settings, load)
        started.append(live)
        return live.start(wait_loaded)

    yield make
    for live in started:
        live.stop()


@pytest.fixture(scope="session")
def qwen3_ftw(ftw_for) -> Path:
    return ftw_for("qwen3_moe", "none")


@pytest.fixture(scope="session")
def server(qwen3_ftw):
    yield from _live(qwen3_ftw, served_model_name="tiny-qwen3", kv_reserve_tokens=8192, max_running_requests=4,
                     max_prefill_length=256)


@pytest.fixture(scope="session")
def tight_server(qwen3_ftw):
    yield from _live(qwen3_ftw, served_model_name="tiny-tight", api_key="secret", kv_reserve_tokens=400,
                     max_running_requests=1, max_queued_requests=1, max_output_tokens=8)


@pytest.fixture(scope="session")
def think_server(ftw_for):
    yield from _live(ftw_for("qwen3_5_moe", "none"), served_model_name="tiny-qwen35", kv_reserve_tokens=4096)


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
