"""Errors in each API's own shape and status.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}     (paths under /v1/messages)

| kind            | OpenAI status / type                    | Anthropic status / type        |
|-----------------|-----------------------------------------|--------------------------------|
| invalid_request | 400 invalid_request_error               | 400 invalid_request_error      |
| authentication  | 401 invalid_request_error (invalid_api_key) | 401 authentication_error   |
| not_found       | 404 invalid_request_error               | 404 not_found_error            |
| overloaded      | 429 rate_limit_error (queue_full)       | 529 overloaded_error           |
| loading         | 503 server_error (model_loading)        | 503 api_error                  |
| server          | 500 server_error                        | 500 api_error                  |
The full request queue answers 429 for OpenAI clients and Anthropic's own 529 "overloaded" for Anthropic clients;
both carry `Retry-After: 1` and both SDKs retry them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ft.server")

_KINDS = {  # kind -> (OpenAI status, OpenAI type, Anthropic status, Anthropic type)
    "invalid_request": (400, "invalid_request_error", 400, "invalid_request_error"),
    "authentication": (401, "invalid_request_error", 401, "authentication_error"),
    "not_found": (404, "invalid_request_error", 404, "not_found_error"),
    "too_large": (413, "invalid_request_error", 413, "request_too_large"),
    "overloaded": (429, "rate_limit_error", 529, "overloaded_error"),
    "loading": (503, "server_error", 503, "api_error"),
    "server": (500, "server_error", 500, "api_error"),
}


class ApiError(Exception):
    def __init__(self, kind: str, message: str, *, param: str | None = None, code: str | None = None) -> None:
        if kind not in _KINDS:
            raise ValueError(f"unknown error kind {kind!r}")
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param, code=code)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_payload(err: ApiError, anthropic: bool) -> tuple[int, dict[str, Any]]:
    openai_status, openai_type, anthropic_status, anthropic_type = _KINDS[err.kind]
    if anthropic:
        return anthropic_status, {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    return openai_status, {"error": {"message": err.message, "type": openai_type, "param": err.param,
                                     "code": err.code}}


def error_response(request: Request, err: ApiError) -> JSONResponse:
    status, body = error_payload(err, is_anthropic_path(request.url.path))
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.error()
    headers = {"Retry-After": "1"} if err.kind in ("overloaded", "loading") else None
    if err.kind == "authentication" and not is_anthropic_path(request.url.path):
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(body, status_code=status, headers=headers)


def sse_error(err: ApiError, anthropic: bool) -> str:
    """An error after the stream started (the status line is already sent)."""
    _, body = error_payload(err, anthropic)
    data = json.dumps(body, ensure_ascii=False)
    return f"event: error\ndata: {data}\n\n" if anthropic else f"data: {data}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    param = _param_path(first.get("loc", ()))
    if first.get("type") == "missing" and not param:
        return "the request body is missing or empty; send a JSON object", None
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}{more}", param


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_path(loc: tuple) -> str | None:
    """pydantic location -> `messages[0].role` (the body prefix and union-member tags such as `str` dropped)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in str(part) or "-" in str(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request, invalid(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication", 404: "not_found"}.get(exc.status_code, "invalid_request")
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        response = error_response(request, ApiError(kind, message))
        if exc.status_code == 405:
            response.status_code = 405
        return response

    @app.exception_handler(UnicodeEncodeError)
    async def _not_unicode(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()
        return error_response(request, invalid(
            f"the request's text is not valid Unicode: {bad} at character {exc.start} of a text field "
            f"({exc.reason}; a lone UTF-16 surrogate has no UTF-8 form)", code="invalid_unicode"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request, ApiError("server", f"internal error: {type(exc).__name__}: {exc}"))


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 in its API's error format, before the app
    parses any of it (a declared Content-Length is checked up front; a body without one is read up to the limit
    here, then handed on), so one huge request cannot hold the event loop in JSON parsing."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        err = ApiError("too_large", f"the request body exceeds {self.limit} bytes (--max-request-bytes)",
                       code="request_too_large")
        status, body = error_payload(err, is_anthropic_path(scope.get("path", "")))
        await JSONResponse(body, status_code=status)(scope, receive, send)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)  # the server stops reading at the declared length
        parts, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away while sending
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.limit:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body"):
                break
        replay = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def buffered() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, buffered, send)
