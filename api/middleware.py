"""The two ASGI middlewares around the app, both answering in the one error shape: BodyLimit
refuses a body over its limit before any route reads it (413), CatchAll turns an exception no
handler took into a 500 (api/errors.py has the handlers)."""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import respond
from shapes.errors import ApiError

log = logging.getLogger("strata.api")


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
