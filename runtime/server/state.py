"""Server settings (`ft serve` flags) and the per-app state the handlers share."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from ft.runtime.server.errors import ApiError
from ft.runtime.server.loop import EngineLoop
from ft.runtime.server.metrics import ServerMetrics
from ft.runtime.settings import EngineSettings


@dataclass(frozen=True)
class ServeSettings:
    """`ft serve`'s flags: the server's own, and the engine's (`EngineSettings`, validated when that is built)."""

    ftw: Path
    engine: EngineSettings = field(default_factory=EngineSettings)
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    served_model_name: str | None = None  # None -> the FTW directory's name
    keepalive_s: float = 15.0  # silence before an SSE keep-alive (OpenAI comment / Anthropic ping)
    keep_alive_on_error: bool = False  # a model that cannot load (or an engine that stops): keep serving /health 500
    max_request_bytes: int = 32 << 20  # a larger request body is answered 413 before it is parsed

    def __post_init__(self) -> None:
        problems = []
        if self.api_key is not None and not self.api_key:
            problems.append("--api-key must not be empty (omit it to disable authentication)")
        if self.max_request_bytes < 1024:
            problems.append(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port must be in 0..65535, got {self.port}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.ftw).resolve().name


@dataclass
class ServerState:
    settings: ServeSettings
    loop: EngineLoop
    metrics: ServerMetrics = field(default_factory=ServerMetrics)

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def engine(self) -> Any:
        """The loaded engine, or a 503 while loading (500 if loading failed)."""
        if self.loop.status == "ok":
            return self.loop.engine
        if self.loop.status == "error":
            raise ApiError("server", f"the model is unavailable: {self.loop.error}")
        raise ApiError("loading", "the model is still loading; retry shortly (GET /health says when it is ready)",
                       code="model_loading")

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ApiError("not_found", f"model {requested!r} does not exist; this server serves "
                           f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    def stats(self) -> dict:
        return self.metrics.snapshot(model=self.model_name, status=self.loop.status,
                                     engine_stats=self.loop.engine_stats)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def check_api_key(request: Request) -> None:
    """FastAPI dependency: `Authorization: Bearer KEY` or `x-api-key: KEY` (constant-time compare of digests)."""
    expected = server_state(request).settings.api_key
    if expected is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
    if given is None:
        raise ApiError("authentication", "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       code="invalid_api_key")
    if not hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest()):
        raise ApiError("authentication", "invalid API key", code="invalid_api_key")
