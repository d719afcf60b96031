"""The FastAPI app behind `ft serve`: OpenAI + Anthropic endpoints over one engine loop, plus operations routes.

Routes: GET /health (no auth: 503 {"status": "loading"} -> 200 {"status": "ok"}; 500 {"status": "error"} if the
load failed, or while the engine's last step failed), GET /v1/models[/{id}], GET /v1/stats, GET /metrics (Prometheus),
GET /openapi.json (behind the key), and the API routers (openai_api, responses_api, anthropic_api). The engine loads
on the loop thread, started by the app's lifespan, so the socket is bound while the weights load. See specs/server.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ft.formats import startup_files
from ft.runtime.server import anthropic_api, openai_api, responses_api
from ft.runtime.server.errors import ApiError, BodyLimit, install_error_handlers
from ft.runtime.server.loop import EngineLoop
from ft.runtime.server.metrics import ServerMetrics, prometheus_text
from ft.runtime.server.parsers import THINK_OPEN
from ft.runtime.server.state import ServerState, ServeSettings, check_api_key, server_state

log = logging.getLogger("ft.server")
RECORD_QUIET_S = 1.0  # the start-up file list is recorded once the engine has had nothing to run this long


def load_engine(settings: ServeSettings) -> Any:
    """Build the engine from the serve flags (runs on the engine-loop thread)."""
    from ft.runtime.engine import Engine

    launched = process_age_s()  # the imports (and the CLI) before this: cold, seconds of the start
    t0 = time.perf_counter()
    engine = Engine(settings.ftw, settings.engine)
    loaded = time.perf_counter()
    engine.warm_up()  # before ready: the first request pays no start-up costs
    up = engine.startup
    up["launch_to_load_s"] = launched
    log.info("engine load began %s s after launch; loaded in %.1f s (model and experts %.1f, the tokenizer, parsed "
             "beside them, %.1f more), warmed up in %.2f s (the page-locking's end awaited %.2f, steps %s s) (device "
             "%s, KV budget %d tokens)", launched, loaded - t0, up["load_s"], up["tokenizer_s"],
             time.perf_counter() - loaded, up.get("pin_wait_s", 0.0), up.get("warm_up_steps_s"),
             settings.engine.device, engine.kv.total)
    return engine


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc, 10 ms steps); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        with open("/proc/uptime") as f:
            return round(float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def create_app(settings: ServeSettings, load: Callable[[], Any] | None = None, *,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The app; `on_fatal(reason)` is called when the engine cannot serve (its load failed or its loop stopped)."""
    metrics = ServerMetrics()
    loop = EngineLoop(load or (lambda: load_engine(settings)), on_events=metrics.on_engine_events, on_fatal=on_fatal)
    state = ServerState(settings, loop, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # noqa: ANN202
        loop.start()
        yield
        await asyncio.to_thread(loop.stop)

    app = FastAPI(title="ft", summary="OpenAI- and Anthropic-compatible MoE server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)  # the schema is served behind the key below
    app.state.server = state
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    app.include_router(_ops_router())
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    return app


def _model_card(state: ServerState) -> dict:
    engine = state.engine
    created = int(state.loop.loaded_at or state.metrics.started)
    template = getattr(getattr(engine, "tokenizer", None), "chat_template", None) or ""
    return {"id": state.model_name, "object": "model", "created": created, "owned_by": "ft",
            "max_model_len": engine.max_context, "context_length": engine.max_context,
            "max_output_tokens": state.settings.engine.max_output_tokens,
            "capabilities": {"reasoning": THINK_OPEN in template}}


def _ops_router() -> APIRouter:
    router = APIRouter()
    auth = [Depends(check_api_key)]

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        loop = server_state(request).loop
        if loop.status == "ok" and loop.failing:  # loaded, but its last step failed: requests fail now
            return JSONResponse({"status": "error", "error": loop.failing}, status_code=500)
        if loop.status == "ok":
            return JSONResponse({"status": "ok"})
        if loop.status == "error":
            return JSONResponse({"status": "error", "error": loop.error}, status_code=500)
        return JSONResponse({"status": "loading"}, status_code=503)

    @router.get("/v1/models", dependencies=auth)
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [_model_card(server_state(request))]}

    @router.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str, request: Request) -> dict:
        state = server_state(request)
        if model_id != state.model_name:
            raise ApiError("not_found", f"model {model_id!r} does not exist; this server serves "
                           f"{state.model_name!r}", param="model", code="model_not_found")
        return _model_card(state)

    @router.get("/v1/stats", dependencies=auth)
    async def stats(request: Request) -> dict:
        return server_state(request).stats()

    @router.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi(request: Request) -> dict:
        return request.app.openapi()

    @router.get("/metrics", dependencies=auth)
    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(server_state(request).stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


class ServeFailed(RuntimeError):
    """The engine could not serve (the reason is the message) and the server exited for it."""


def serve(settings: ServeSettings, *, log_level: str = "info") -> None:
    """Run the server until interrupted (blocking). If the model cannot load, or the engine loop stops, the server
    shuts down and ServeFailed is raised, so a supervisor sees the process fail, unless
    `settings.keep_alive_on_error` keeps it answering /health with the error."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def fatal(reason: str) -> None:
        failed.append(reason)
        if not settings.keep_alive_on_error and server is not None:
            server.should_exit = True

    def load() -> Any:  # then, while the ready server is idle, what this start read: the next one reads it first
        engine = load_engine(settings)
        idle = app.state.server.loop.wait_idle
        threading.Thread(target=startup_files.record, name="ft-startup-files", daemon=True,
                         kwargs={"exclude": settings.ftw, "pause": lambda: idle(RECORD_QUIET_S)}).start()
        return engine

    app = create_app(settings, load, on_fatal=fatal)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                                           timeout_graceful_shutdown=5))
    server.run()
    if failed and not settings.keep_alive_on_error:
        raise ServeFailed(failed[0])
