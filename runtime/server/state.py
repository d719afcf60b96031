"""Server settings (`ft serve` flags) and the per-app state the handlers share."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from ft.runtime.gpu.offload_config import FLAG_MODES as OFFLOAD_MODES
from ft.runtime.server.errors import ApiError
from ft.runtime.server.loop import EngineLoop
from ft.runtime.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServeSettings:
    ftw: Path
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    served_model_name: str | None = None  # None -> the FTW directory's name
    device: str = "cpu"
    kv_reserve_tokens: int = 8192
    max_prefill_length: int = 2048
    max_output_tokens: int = 32768
    max_running_requests: int = 4
    max_queued_requests: int = 64
    memory_ratio: float = 0.9  # CUDA only: share of free VRAM for weights + expert cache + KV
    vram_budget: int | None = None  # CUDA only: bytes for everything the engine allocates (overrides memory_ratio)
    dense_weights: str = "dequantized"  # CUDA only: quantized dense linears dequantized at load or kept as stored
    offload_mode: str = "mapped"  # CUDA only: how expert-cache misses are served (OffloadConfig modes)
    cuda_graphs: bool = True  # CUDA only: replay sync-free one-token decode steps from captured graphs
    keepalive_s: float = 15.0  # silence before an SSE keep-alive (OpenAI comment / Anthropic ping)

    def __post_init__(self) -> None:
        problems = []
        if self.api_key is not None and not self.api_key:
            problems.append("--api-key must not be empty (omit it to disable authentication)")
        if self.vram_budget is not None and self.vram_budget <= 0:
            problems.append(f"--vram-budget must be positive, got {self.vram_budget}")
        if self.dense_weights not in ("dequantized", "quantized"):
            problems.append(f"--dense-weights {self.dense_weights!r}; use dequantized or quantized")
        if self.offload_mode not in OFFLOAD_MODES:
            problems.append(f"--offload-mode {self.offload_mode!r}; use one of {', '.join(OFFLOAD_MODES)}")
        if not 0 < self.memory_ratio <= 1:
            problems.append(f"--memory-ratio must be in (0, 1], got {self.memory_ratio}")
        for flag, value in (("--kv-reserve-tokens", self.kv_reserve_tokens), ("--max-prefill-length",
                            self.max_prefill_length), ("--max-output-tokens", self.max_output_tokens),
                            ("--max-running-requests", self.max_running_requests),
                            ("--max-queued-requests", self.max_queued_requests)):
            if value < 1:
                problems.append(f"{flag} must be >= 1, got {value}")
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
