"""One error shape for every failure: {"error": {"message", "type", "param", "code"}}.

Handlers turn each kind of failure into it, so a client never sees FastAPI's default
`{"detail": ...}` nor a plain-text page. The status codes and codes are listed in docs/api.md."""

from __future__ import annotations

import logging

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.schemas import ErrorBody, ErrorDetail

log = logging.getLogger("strata.api")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A failure the API answers on purpose, with its status and OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(
            message=message,
            type=type or _TYPE_BY_STATUS.get(status, "server_error"),
            param=param,
            code=code,
        )
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.detail, self.headers)


def error_response(status: int, detail: ErrorDetail, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status, headers=headers)


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


async def _on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


def validation_error(errors: list) -> ApiError:
    """The 400 a body failing pydantic validation gets (also used for each line of a batch)."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return ApiError(400, message, param=param, code="invalid_value")


async def _on_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(list(exc.errors())).response()


async def _on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return ApiError(exc.status_code, detail, code=codes.get(exc.status_code),
                    headers=dict(exc.headers or {})).response()


async def _on_redis_down(_request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
    log.warning("redis unavailable: %s", exc)
    return ApiError(503, "the queue (Redis) is unreachable; retry shortly", code="queue_unavailable",
                    headers={"Retry-After": "1"}).response()


async def _on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return ApiError(500, "internal server error", code="internal_error", type="server_error").response()


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
                await error.response()(scope, receive, send)


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
        await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
