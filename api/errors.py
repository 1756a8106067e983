"""Every failure answered in the one error shape (shapes/errors.py): handlers turn each kind of
failure into it, so a client never sees FastAPI's default `{"detail": ...}` nor a plain-text
page. The status codes and codes are listed in docs/api.md. What answers before any handler
(a body too large, an exception no handler took) is api/middleware.py."""

from __future__ import annotations

import logging

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
