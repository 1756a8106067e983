"""One error shape for every failure: {"error": {"message", "type", "param", "code"}}, and the
exception that carries it. The HTTP side (api/errors.py) turns it into a response; a batch writes
its body into the line's entry of the error file. Codes are listed in docs/api.md."""

from __future__ import annotations

from pydantic import BaseModel

from queues.records import Failed
from shapes.text import TEXT_ENCODING


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "service_unavailable",
}

# Failures of a request that are not the request's fault: a retry may well succeed.
# (`worker_lost` and `unavailable` come from the worker side, docs/api.md.)
_UNAVAILABLE_CODES = frozenset({"cancelled", "worker_lost", "unavailable"})
_REQUEST_CODES = frozenset({"grammar_error"})  # engine/errors.py RequestError codes: the request's own fault


class ApiError(Exception):
    """A failure answered on purpose, with its status and OpenAI-style body."""

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

    def body(self) -> dict:
        return ErrorBody(error=self.detail).model_dump()


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def validation_error(errors: list) -> ApiError:
    """The 400 a body failing pydantic validation gets (also each line of a batch)."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    if first.get("type") == TEXT_ENCODING:  # checked over the whole body: the field is in its context
        param = first["ctx"]["field"]
    else:
        param = _param(tuple(first.get("loc", ())))
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return ApiError(400, message, param=param, code="invalid_value")


def failure(event: Failed) -> ApiError:
    """What the endpoint answers when the worker failed the request."""
    if event.code == "queue_timeout":  # its own deadline passed before any worker had a slot: 408
        return ApiError(408, event.message, code=event.code, param="queue_timeout", type="timeout_error")
    if event.code in _REQUEST_CODES:  # the request's own input failed it in the worker (its grammar)
        return ApiError(400, event.message, code=event.code)
    status = 503 if event.code in _UNAVAILABLE_CODES else 500
    return ApiError(status, event.message, code=event.code,
                    type="service_unavailable" if status == 503 else "server_error")
