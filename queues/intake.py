"""The API's side of the queue (asyncio): enqueue, read a request's output, cancel it."""

from __future__ import annotations

import time
from typing import Callable

import redis.asyncio as aioredis
import redis.exceptions

from queues import scripts
from queues.keys import Keys
from queues.records import Event, QueuedRequest, parse_event, text


def now_ms() -> int:
    return int(time.time() * 1000)


class Intake:
    def __init__(
        self,
        client: aioredis.Redis,
        model: str,
        *,
        max_waiting: int = 0,
        hard_limit: int = 0,
        retention_s: int = 3600,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.client = client
        self.keys = Keys(model)
        self.max_waiting = max_waiting
        self.hard_limit = hard_limit
        self.retention_s = retention_s
        self.clock = clock
        self._scripts = scripts.register(client)

    async def enqueue(self, request: QueuedRequest, fields: dict[str, str] | None = None) -> int:
        """Add a request; returns how many wait ahead of it. Raises QueueRefused. `fields` are
        written on the request hash too (e.g. `key_name`: who asked, for operators)."""
        call = scripts.enqueue_call(self.keys, request, self.clock(), self.max_waiting, self.hard_limit, fields)
        try:
            _member, ahead = await self._scripts["enqueue"](**call)
        except redis.exceptions.ResponseError as error:
            refused = scripts.refused(error)
            if refused:
                raise refused from None
            raise
        return int(ahead)

    async def read(
        self, request_id: str, after: str = "0-0", block_ms: int = 1000
    ) -> list[tuple[str, Event]]:
        """Output events after entry id `after` (empty when none came within block_ms).
        Entry ids are the stream's own, so a client can resume from the last one it saw."""
        reply = await self.client.xread({self.keys.out(request_id): after}, block=block_ms, count=256)
        events: list[tuple[str, Event]] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                events.append((text(entry_id), parse_event({text(a): text(b) for a, b in fields.items()})))
        return events

    async def cancel(self, request_id: str) -> str:
        k = self.keys
        status = await self._scripts["cancel"](
            keys=[k.waiting, k.req(request_id), k.out(request_id)],
            args=[self.clock(), self.retention_s],
        )
        return text(status)

    async def record(self, request_id: str) -> dict[str, str]:
        raw = await self.client.hgetall(self.keys.req(request_id))
        return {text(a): text(b) for a, b in raw.items()}
