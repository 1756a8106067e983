"""Every failure answered in the one error shape (shapes/errors.py): handlers turn each kind of
failure into it, so a client never sees FastAPI's default `{"detail": ...}` nor a plain-text
page. The status codes and codes are listed in docs/api.md."""

from __future__ import annotations

import logging

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shapes.errors import ApiError, validation_error

log = logging.getLogger("strata.api")


def respond(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return respond(exc)


async def _on_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return respond(validation_error(list(exc.errors())))


async def _on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # FastAPI raises 400 itself only for a body it cannot parse (not UTF-8, nested too deeply, broken multipart).
    codes = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return respond(ApiError(exc.status_code, detail, code=codes.get(exc.status_code),
                            headers=dict(exc.headers or {})))


async def _on_redis_down(_request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
    log.warning("redis unavailable: %s", exc)
    return respond(ApiError(503, "the queue (Redis) is unreachable; retry shortly", code="queue_unavailable",
                            headers={"Retry-After": "1"}))


async def _on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return respond(ApiError(500, "internal server error", code="internal_error", type="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(redis.exceptions.ConnectionError, _on_redis_down)
    app.add_exception_handler(redis.exceptions.TimeoutError, _on_redis_down)
    app.add_exception_handler(Exception, _on_unexpected)


class CatchAll:
    """ASGI middleware: an exception no handler took becomes a 500 in the error shape. (Starlette's
    own last-resort handler answers too, but then re-raises, and the server may reset the
    connection before the client has read the answer.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the last resort, logged in full
            log.exception("unexpected error", exc_info=exc)
            if not started:
                error = ApiError(500, "internal server error", code="internal_error", type="server_error")
                await respond(error)(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413 in the error shape, before any route
    reads it. A declared Content-Length is checked at once; a chunked body is read here (it is
    small by definition) and handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own limit (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.larger.get(scope.get("path", ""), self.max_bytes)
        length = _content_length(scope)
        if length is not None and length > max_bytes:
            return await self._refuse(scope, receive, send, max_bytes)
        if length is not None:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                return await self._refuse(scope, receive, send, max_bytes)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        error = ApiError(413, f"request body is larger than {max_bytes} bytes", code="request_too_large")
        await respond(error)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
